//! OCI descriptors, image manifests and image indexes, as canonical JSON.
//!
//! Only OCI media types are written. Docker media types met in a base image are translated
//! (the blob bytes are the same; only the descriptor's type changes), never mixed in.
use super::digest::Digest;
use super::json::canonical;
use super::platform::Platform;
use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// `application/vnd.oci.image.index.v1+json`.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// `application/vnd.oci.image.manifest.v1+json`.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// `application/vnd.oci.image.config.v1+json`.
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// `application/vnd.oci.image.layer.v1.tar+gzip`.
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// Docker's manifest list (read only).
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// Docker's image manifest (read only).
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Every manifest type we can read, for `Accept` headers.
pub const ACCEPT_MANIFESTS: &str = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.list.v2+json;q=0.9, application/vnd.docker.distribution.manifest.v2+json;q=0.9";

/// The OCI media type for a layer or config media type found in a base image.
pub fn to_oci_media_type(mt: &str) -> Result<&'static str> {
    Ok(match mt {
        "application/vnd.oci.image.layer.v1.tar+gzip" | "application/vnd.docker.image.rootfs.diff.tar.gzip" => {
            OCI_LAYER_GZIP
        }
        "application/vnd.oci.image.layer.v1.tar+zstd" => "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.oci.image.layer.v1.tar" | "application/vnd.docker.image.rootfs.diff.tar" => {
            "application/vnd.oci.image.layer.v1.tar"
        }
        "application/vnd.oci.image.config.v1+json" | "application/vnd.docker.container.image.v1+json" => OCI_CONFIG,
        other => bail!("media type {other:?} is not supported in a base image"),
    })
}

/// Whether `mt` is an index (OCI or Docker list).
pub fn is_index(mt: &str) -> bool {
    mt == OCI_INDEX || mt == DOCKER_LIST
}

/// An OCI content descriptor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Descriptor {
    /// Media type of the content (an OCI type in what this tool writes).
    #[serde(rename = "mediaType")]
    pub media_type: String,
    /// Digest of the content.
    pub digest: Digest,
    /// Size of the content in bytes.
    pub size: u64,
    /// Platform (index entries only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Value>,
    /// Annotations (`org.opencontainers.image.*`, and the ref name in a layout's index).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
}

impl Descriptor {
    /// A descriptor of `bytes` with `media_type`.
    pub fn of(media_type: &str, bytes: &[u8]) -> Descriptor {
        Descriptor {
            media_type: media_type.into(),
            digest: Digest::of(bytes),
            size: bytes.len() as u64,
            platform: None,
            annotations: None,
        }
    }
}

/// The media type of a manifest's bytes. `mediaType` is optional in OCI documents (umoci and
/// skopeo leave it out of image manifests), so without it the shape decides, as registries do.
pub fn media_type_of(bytes: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(bytes).ok()?;
    if let Some(mt) = v.get("mediaType").and_then(Value::as_str) {
        return Some(mt.to_string());
    }
    if v.get("manifests").is_some_and(Value::is_array) {
        Some(OCI_INDEX.to_string())
    } else if v.get("config").is_some() && v.get("layers").is_some() {
        Some(OCI_MANIFEST.to_string())
    } else {
        None
    }
}

/// The digest of the entry for `platform` in an image index (OCI or Docker list) read from a
/// registry or a store; `None` when the index has no such entry. Errors say what is wrong with
/// the bytes; the caller names the index.
pub fn index_entry(bytes: &[u8], platform: &Platform) -> Result<Option<Digest>> {
    let index: Value = serde_json::from_slice(bytes).context("not JSON")?;
    let entries = index["manifests"].as_array().ok_or_else(|| anyhow!("an index without manifests"))?;
    let Some(entry) = entries.iter().find(|e| e.get("platform").is_some_and(|pv| platform.matches(pv))) else {
        return Ok(None);
    };
    let digest =
        Digest::parse(entry["digest"].as_str().unwrap_or("")).with_context(|| format!("the {platform} entry"))?;
    Ok(Some(digest))
}

/// What a build reads of an image manifest (OCI or Docker) read from a registry or a store.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageParts {
    /// The config's descriptor (OCI media type).
    pub config: Descriptor,
    /// The layers' descriptors, in order, with OCI media types (Docker ones translated).
    pub layers: Vec<Descriptor>,
}

impl ImageParts {
    /// Parses an image manifest: its descriptors, with OCI media types and without annotations
    /// or platforms. Errors say what is wrong with the bytes; the caller names the manifest.
    pub fn parse(bytes: &[u8]) -> Result<ImageParts> {
        let m: Value = serde_json::from_slice(bytes).context("not JSON")?;
        let desc = |v: &Value| -> Result<Descriptor> {
            let mut d: Descriptor = serde_json::from_value(v.clone()).context("a bad descriptor")?;
            d.media_type = to_oci_media_type(&d.media_type)?.to_string();
            d.annotations = None;
            d.platform = None;
            Ok(d)
        };
        let config = desc(&m["config"])?;
        if config.media_type != OCI_CONFIG {
            bail!("not an image manifest (its config is {})", config.media_type);
        }
        let layers =
            m["layers"].as_array().ok_or_else(|| anyhow!("no layers"))?.iter().map(desc).collect::<Result<_>>()?;
        Ok(ImageParts { config, layers })
    }
}

/// Canonical bytes of an image manifest.
pub fn image_manifest(
    config: &Descriptor,
    layers: &[Descriptor],
    annotations: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut v = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": config,
        "layers": layers,
    });
    if !annotations.is_empty() {
        v["annotations"] = serde_json::to_value(annotations)?;
    }
    Ok(canonical(&v))
}

/// Canonical bytes of an image index over per-platform manifests.
pub fn image_index(manifests: &[(Platform, Descriptor)], annotations: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let entries: Vec<Descriptor> = manifests
        .iter()
        .map(|(p, d)| Descriptor { platform: Some(p.to_json()), annotations: None, ..d.clone() })
        .collect();
    let mut v = json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": entries,
    });
    if !annotations.is_empty() {
        v["annotations"] = serde_json::to_value(annotations)?;
    }
    Ok(canonical(&v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_and_index_shape() {
        let cfg = Descriptor::of(OCI_CONFIG, b"{}");
        let layer = Descriptor::of(OCI_LAYER_GZIP, b"x");
        let m = image_manifest(&cfg, &[layer], &BTreeMap::from([("k".to_string(), "v".to_string())])).unwrap();
        let v: Value = serde_json::from_slice(&m).unwrap();
        assert_eq!(v["mediaType"], OCI_MANIFEST);
        assert_eq!(v["config"]["mediaType"], OCI_CONFIG);
        assert!(v["config"].get("platform").is_none());
        let md = Descriptor::of(OCI_MANIFEST, &m);
        let arm = Platform::parse("linux/arm64").unwrap();
        let idx = image_index(&[(arm, md)], &BTreeMap::new()).unwrap();
        let v: Value = serde_json::from_slice(&idx).unwrap();
        assert_eq!(v["manifests"][0]["platform"]["variant"], "v8");
        assert!(v.get("annotations").is_none());
        // Canonical: no whitespace, sorted keys.
        let s = String::from_utf8(idx).unwrap();
        assert!(s.starts_with(r#"{"manifests":[{"digest":"sha256:"#), "{s}");
        assert!(!s.contains(' '));
    }

    #[test]
    fn media_type_without_the_field_comes_from_the_shape() {
        assert_eq!(media_type_of(br#"{"schemaVersion":2,"config":{},"layers":[]}"#).as_deref(), Some(OCI_MANIFEST));
        assert_eq!(media_type_of(br#"{"schemaVersion":2,"manifests":[]}"#).as_deref(), Some(OCI_INDEX));
        assert_eq!(media_type_of(br#"{"mediaType":"x","manifests":[]}"#).as_deref(), Some("x"));
        assert_eq!(media_type_of(br#"{"schemaVersion":2}"#), None);
    }

    #[test]
    fn manifests_and_index_entries_parse_or_say_what_is_wrong() {
        let cfg = Descriptor::of("application/vnd.docker.container.image.v1+json", b"{}");
        let layer = Descriptor { annotations: Some(BTreeMap::new()), ..Descriptor::of(OCI_LAYER_GZIP, b"x") };
        let m = image_manifest(&cfg, std::slice::from_ref(&layer), &BTreeMap::new()).unwrap();
        let parts = ImageParts::parse(&m).unwrap();
        assert_eq!(parts.config.media_type, OCI_CONFIG, "Docker types translated");
        assert_eq!(parts.layers, [Descriptor { annotations: None, ..layer.clone() }]);
        let arm = Platform::parse("linux/arm64").unwrap();
        let idx = image_index(&[(arm.clone(), Descriptor::of(OCI_MANIFEST, &m))], &BTreeMap::new()).unwrap();
        assert_eq!(index_entry(&idx, &arm).unwrap(), Some(Digest::of(&m)));
        assert_eq!(index_entry(&idx, &Platform::parse("linux/amd64").unwrap()).unwrap(), None);
        let err = |r: Result<ImageParts>| format!("{:#}", r.unwrap_err());
        assert!(err(ImageParts::parse(b"{")).starts_with("not JSON"));
        assert!(err(ImageParts::parse(&idx)).starts_with("a bad descriptor"));
        let no_layers = format!(r#"{{"config":{}}}"#, serde_json::to_string(&cfg).unwrap());
        assert_eq!(err(ImageParts::parse(no_layers.as_bytes())), "no layers");
        let layer_as_config = image_manifest(&layer, &[], &BTreeMap::new()).unwrap();
        assert!(err(ImageParts::parse(&layer_as_config)).starts_with("not an image manifest"));
        assert!(index_entry(br#"{"manifests":{}}"#, &arm).is_err());
    }

    #[test]
    fn docker_types_translate() {
        assert_eq!(to_oci_media_type("application/vnd.docker.image.rootfs.diff.tar.gzip").unwrap(), OCI_LAYER_GZIP);
        assert_eq!(to_oci_media_type("application/vnd.docker.container.image.v1+json").unwrap(), OCI_CONFIG);
        assert!(to_oci_media_type("application/vnd.docker.image.rootfs.foreign.diff.tar.gzip").is_err());
    }
}
