//! Provenance you can check: the SBOM and an in-toto statement of SLSA build provenance,
//! attached to a pushed index as OCI referrers (artifact manifests whose `subject` is the
//! index), and `distro verify`, which fetches them and checks them against the image.
//!
//! - The SBOM artifact (`artifactType` `application/spdx+json`) holds one layer per platform:
//!   that platform's `/opt/distro/sbom.spdx.json`, byte for byte, annotated with the platform.
//! - The provenance artifact (`application/vnd.in-toto+json`) holds one in-toto Statement v1
//!   whose subjects are the index and each platform manifest and whose predicate is SLSA
//!   Provenance v1: the build's parameters (image, version, platforms) and its resolved
//!   dependencies, read from what the image records about itself (its annotations: the
//!   project's revision, the base by digest, each upstream source's pin, patched tree and patch
//!   count), and the builder.
//!
//! Both are made from the image alone, so `distro push` of a layout attaches the same ones as
//! `distro build --push`, and `distro verify` recomputes what they must say. How they reach the
//! registry (its referrers API, or the tag-schema fallback) is [`referrers`].
use crate::oci::digest::Digest;
use crate::oci::json::canonical;
use crate::oci::manifest::{Descriptor, ImageParts, OCI_MANIFEST};
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::PathBuf;

pub mod referrers;
pub mod signature;
pub mod test_summary;

/// The SBOM artifact's type (and its layers' media type).
pub const SBOM_TYPE: &str = "application/spdx+json";
/// The provenance artifact's type (and its layer's media type).
pub const INTOTO_TYPE: &str = "application/vnd.in-toto+json";
/// The empty config of an artifact manifest, and its one content: `{}`.
pub const EMPTY_TYPE: &str = "application/vnd.oci.empty.v1+json";
/// The annotation naming the platform of an SBOM layer.
pub const PLATFORM_ANNOTATION: &str = "io.github.llm-distro.platform";
/// SLSA Provenance v1's predicate type.
pub const SLSA_PROVENANCE: &str = "https://slsa.dev/provenance/v1";
/// The build type the statement names: what its parameters mean is documented there.
pub const BUILD_TYPE: &str = "https://github.com/llm-distro/llm-distro/blob/main/docs/images.md#provenance";

/// An image, as the attestations see it: the index and each platform's manifest and SBOM.
#[derive(Clone, Debug, Default)]
pub struct Subject {
    /// The index's descriptor (media type, digest, size).
    pub index: Option<Descriptor>,
    /// The index's annotations.
    pub annotations: BTreeMap<String, String>,
    /// Per platform (`linux/amd64`, `linux/arm64/v8`): its manifest's digest and the
    /// `/opt/distro/sbom.spdx.json` its layers hold, if any.
    pub platforms: BTreeMap<String, (Digest, Option<Vec<u8>>)>,
}

impl Subject {
    /// Reads an image: the index `bytes` (of `media_type`), its manifests through `manifest`,
    /// and the path of a layer's blob through `layer` (only each platform's last layer, where
    /// `distro build` puts `/opt/distro`, is read).
    pub fn read(
        media_type: &str,
        bytes: &[u8],
        manifest: impl Fn(&Descriptor) -> Result<Vec<u8>>,
        layer: impl Fn(&Descriptor) -> Result<PathBuf>,
    ) -> Result<Subject> {
        let top: Value = serde_json::from_slice(bytes).context("the index is not JSON")?;
        let mut s = Subject {
            index: Some(Descriptor::of(media_type, bytes)),
            annotations: top["annotations"]
                .as_object()
                .map(|o| o.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned()))).collect())
                .unwrap_or_default(),
            platforms: BTreeMap::new(),
        };
        for entry in top["manifests"].as_array().into_iter().flatten() {
            let Ok(d) = serde_json::from_value::<Descriptor>(entry.clone()) else { continue };
            let Some(p) = d.platform.as_ref().and_then(platform_name) else { continue };
            let parts = ImageParts::parse(&manifest(&d)?).with_context(|| format!("{p}: manifest {}", d.digest))?;
            let sbom = match parts.layers.last() {
                Some(last) => sbom_in_layer(&layer(last)?, &format!("{p}'s /opt/distro layer {}", last.digest))?,
                None => None,
            };
            s.platforms.insert(p, (d.digest, sbom));
        }
        Ok(s)
    }

    fn index_digest(&self) -> String {
        self.index.as_ref().map(|d| d.digest.to_string()).unwrap_or_default()
    }
}

/// `os/architecture[/variant]` of an index entry's platform.
pub fn platform_name(p: &Value) -> Option<String> {
    let name = format!("{}/{}", p["os"].as_str()?, p["architecture"].as_str()?);
    Some(match p["variant"].as_str() {
        Some(v) => format!("{name}/{v}"),
        None => name,
    })
}

/// `opt/distro/sbom.spdx.json` in a gzip layer, if it holds one, read within
/// [`crate::oci::layer_files::MAX_OPT_DISTRO_INFLATED`]; `what` names the layer in the error.
fn sbom_in_layer(path: &std::path::Path, what: &str) -> Result<Option<Vec<u8>>> {
    const SBOM: &str = "opt/distro/sbom.spdx.json";
    let cap = crate::oci::layer_files::MAX_OPT_DISTRO_INFLATED;
    Ok(crate::oci::layer_files::files(path, &[SBOM], cap, what)?.remove(SBOM))
}

/// The dependencies the statement must list, by name, from the image's own annotations: the
/// project's revision, the base by digest, and each upstream source (pin, patched tree, patch
/// count).
pub fn dependencies(s: &Subject) -> BTreeMap<String, Value> {
    let a = &s.annotations;
    let get = |k: &str| a.get(k).cloned().unwrap_or_default();
    let mut deps = BTreeMap::new();
    deps.insert(
        "revision".to_string(),
        json!({"name": "revision", "uri": format!("git+{}", a.get("org.opencontainers.image.source").map_or("unknown", String::as_str)),
               "digest": {"gitCommit": get("org.opencontainers.image.revision")}}),
    );
    let base_digest = get("org.opencontainers.image.base.digest");
    let (alg, hex) = base_digest.split_once(':').unwrap_or(("sha256", ""));
    deps.insert(
        "base".to_string(),
        json!({"name": "base", "uri": format!("oci://{}", get("org.opencontainers.image.base.name")), "digest": {alg: hex}}),
    );
    let prefix = crate::image::pins::PIN_ANNOTATION_PREFIX;
    let names: std::collections::BTreeSet<&str> =
        a.keys().filter_map(|k| k.strip_prefix(prefix)?.rsplit_once('.').map(|(n, _)| n)).collect();
    for name in names {
        let field = |f: &str| a.get(&format!("{prefix}{name}.{f}")).cloned().unwrap_or_default();
        let mut annotations = json!({"pin": field("pin"), "patches": field("patches")});
        if a.contains_key(&format!("{prefix}{name}.overridden")) {
            annotations["overridden"] = json!(field("overridden"));
        }
        deps.insert(
            format!("source:{name}"),
            json!({"name": format!("source:{name}"), "digest": {"gitTree": field("tree")}, "annotations": annotations}),
        );
    }
    deps
}

/// Who built it: the CI run when there is one (GitHub Actions' variables), else this tool.
pub fn builder() -> (String, Option<String>) {
    let id = format!("https://github.com/llm-distro/llm-distro/distro@{}", env!("CARGO_PKG_VERSION"));
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let run = match (env("GITHUB_SERVER_URL"), env("GITHUB_REPOSITORY"), env("GITHUB_RUN_ID")) {
        (Some(server), Some(repo), Some(run)) => Some(format!("{server}/{repo}/actions/runs/{run}")),
        _ => None,
    };
    (id, run)
}

/// The in-toto Statement v1 with SLSA Provenance v1 for `s`, as canonical JSON.
pub fn statement(s: &Subject) -> Vec<u8> {
    let a = &s.annotations;
    let mut subjects = vec![json!({"name": "index", "digest": digest_map(&s.index_digest())})];
    for (p, (d, _)) in &s.platforms {
        subjects.push(json!({"name": p, "digest": digest_map(d.as_str())}));
    }
    let (id, run) = builder();
    let mut metadata = json!({});
    if let Some(created) = a.get("org.opencontainers.image.created") {
        metadata["startedOn"] = json!(created);
    }
    if let Some(run) = run {
        metadata["invocationId"] = json!(run);
    }
    let v = json!({
        "_type": "https://in-toto.io/Statement/v1",
        "subject": subjects,
        "predicateType": SLSA_PROVENANCE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {
                    "image": a.get("org.opencontainers.image.title"),
                    "version": a.get("org.opencontainers.image.version"),
                    "platforms": s.platforms.keys().collect::<Vec<_>>(),
                },
                "resolvedDependencies": dependencies(s).into_values().collect::<Vec<_>>(),
            },
            "runDetails": {"builder": {"id": id}, "metadata": metadata},
        },
    });
    canonical(&v)
}

fn digest_map(d: &str) -> Value {
    let (alg, hex) = d.split_once(':').unwrap_or(("sha256", d));
    json!({alg: hex})
}

/// An artifact to attach: its manifest (subject: the index) and the blobs it references.
#[derive(Clone, Debug)]
pub struct Artifact {
    /// `artifactType`.
    pub artifact_type: &'static str,
    /// The artifact manifest's bytes.
    pub manifest: Vec<u8>,
    /// The empty config and the layers' contents.
    pub blobs: Vec<Vec<u8>>,
}

/// The canonical bytes of an artifact manifest of `artifact_type` whose subject is `index`: the
/// empty config, `layers`, and `created` as its creation time.
pub fn artifact_manifest(artifact_type: &str, index: &Descriptor, created: &str, layers: &[Descriptor]) -> Vec<u8> {
    let subject = Descriptor { platform: None, annotations: None, ..index.clone() };
    canonical(&json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": Descriptor::of(EMPTY_TYPE, b"{}"),
        "layers": layers,
        "subject": subject,
        "annotations": {"org.opencontainers.image.created": created},
    }))
}

/// The SBOM artifact (one layer per platform that has an SBOM) and the provenance artifact.
pub fn artifacts(s: &Subject) -> Vec<Artifact> {
    let Some(index) = &s.index else { return Vec::new() };
    let created = s.annotations.get("org.opencontainers.image.created").cloned().unwrap_or_default();
    let manifest =
        |artifact_type: &str, layers: &[Descriptor]| artifact_manifest(artifact_type, index, &created, layers);
    let mut out = Vec::new();
    let sboms: Vec<(&String, &Vec<u8>)> =
        s.platforms.iter().filter_map(|(p, (_, sbom))| Some((p, sbom.as_ref()?))).collect();
    if !sboms.is_empty() {
        let layers: Vec<Descriptor> = sboms
            .iter()
            .map(|(p, bytes)| Descriptor {
                annotations: Some(BTreeMap::from([(PLATFORM_ANNOTATION.to_string(), p.to_string())])),
                ..Descriptor::of(SBOM_TYPE, bytes)
            })
            .collect();
        let mut blobs = vec![b"{}".to_vec()];
        blobs.extend(sboms.iter().map(|(_, b)| b.to_vec()));
        out.push(Artifact { artifact_type: SBOM_TYPE, manifest: manifest(SBOM_TYPE, &layers), blobs });
    }
    let st = statement(s);
    out.push(Artifact {
        artifact_type: INTOTO_TYPE,
        manifest: manifest(INTOTO_TYPE, &[Descriptor::of(INTOTO_TYPE, &st)]),
        blobs: vec![b"{}".to_vec(), st],
    });
    out
}

/// What `distro verify` found attached: the SBOM layers (platform -> bytes) and the statements.
#[derive(Clone, Debug, Default)]
pub struct Attached {
    /// Whether an SBOM artifact was found.
    pub sbom_artifact: bool,
    /// Each SBOM layer, by its platform annotation.
    pub sboms: BTreeMap<String, Vec<u8>>,
    /// Each provenance statement's bytes.
    pub statements: Vec<Vec<u8>>,
}

/// Every way the attachments disagree with the image, one line each (none: verified).
pub fn check(s: &Subject, attached: &Attached) -> Vec<String> {
    let mut out = Vec::new();
    if !attached.sbom_artifact {
        out.push("sbom: none is attached".to_string());
    } else {
        for (p, (_, sbom)) in &s.platforms {
            match (sbom, attached.sboms.get(p)) {
                (Some(have), Some(got)) if have == got => {}
                (Some(have), Some(got)) => out.push(format!(
                    "sbom {p}: the attached SBOM ({}) is not the image's /opt/distro/sbom.spdx.json ({})",
                    Digest::of(got),
                    Digest::of(have)
                )),
                (Some(_), None) => out.push(format!("sbom {p}: none is attached for this platform")),
                (None, _) => out.push(format!("sbom {p}: the image holds no /opt/distro/sbom.spdx.json")),
            }
        }
        for p in attached.sboms.keys().filter(|p| !s.platforms.contains_key(*p)) {
            out.push(format!("sbom {p}: attached for a platform the index does not have"));
        }
    }
    if attached.statements.is_empty() {
        out.push("provenance: none is attached".to_string());
    }
    for bytes in &attached.statements {
        out.extend(check_statement(s, bytes));
    }
    out
}

fn check_statement(s: &Subject, bytes: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(v) = serde_json::from_slice::<Value>(bytes) else {
        return vec!["provenance: the statement is not JSON".to_string()];
    };
    if v["_type"] != "https://in-toto.io/Statement/v1" {
        out.push(format!("provenance: _type is {}, not an in-toto Statement v1", v["_type"]));
    }
    if v["predicateType"] != SLSA_PROVENANCE {
        out.push(format!("provenance: predicateType is {}, not {SLSA_PROVENANCE}", v["predicateType"]));
    }
    let subjects: Vec<String> = v["subject"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| {
            let (alg, hex) = x["digest"].as_object()?.iter().next()?;
            Some(format!("{alg}:{}", hex.as_str()?))
        })
        .collect();
    let mut want = vec![("the index".to_string(), s.index_digest())];
    want.extend(s.platforms.iter().map(|(p, (d, _))| (format!("the {p} manifest"), d.to_string())));
    for (what, d) in want {
        if !subjects.contains(&d) {
            out.push(format!("provenance: its subjects do not name {what} ({d})"));
        }
    }
    let got: BTreeMap<String, &Value> = v["predicate"]["buildDefinition"]["resolvedDependencies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| Some((d["name"].as_str()?.to_owned(), d)))
        .collect();
    let expected = dependencies(s);
    for (name, want) in &expected {
        match got.get(name) {
            None => out.push(format!("provenance: no dependency {name}; the image records {}", short(want))),
            Some(have) if *have != want => {
                out.push(format!("provenance: dependency {name} is {}; the image records {}", short(have), short(want)))
            }
            Some(_) => {}
        }
    }
    for name in got.keys().filter(|n| !expected.contains_key(*n)) {
        out.push(format!("provenance: dependency {name} is not in the image"));
    }
    out
}

/// A dependency in one line: its digest and annotations.
fn short(d: &Value) -> String {
    let mut s = d["digest"].to_string();
    if d["annotations"].is_object() {
        s += &format!(" {}", d["annotations"]);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subject() -> Subject {
        let prefix = crate::image::pins::PIN_ANNOTATION_PREFIX;
        Subject {
            index: Some(Descriptor::of(crate::oci::manifest::OCI_INDEX, b"index")),
            annotations: BTreeMap::from([
                ("org.opencontainers.image.revision".into(), "a".repeat(40)),
                ("org.opencontainers.image.base.name".into(), "docker.io/nvidia/cuda:13".into()),
                ("org.opencontainers.image.base.digest".into(), format!("sha256:{}", "b".repeat(64))),
                ("org.opencontainers.image.created".into(), "2026-03-05T00:00:00Z".into()),
                (format!("{prefix}upstream.pin"), "c".repeat(40)),
                (format!("{prefix}upstream.tree"), "d".repeat(40)),
                (format!("{prefix}upstream.patches"), "1".into()),
            ]),
            platforms: BTreeMap::from([
                ("linux/amd64".into(), (Digest::of(b"amd64"), Some(b"{\"sbom\":1}".to_vec()))),
                ("linux/arm64/v8".into(), (Digest::of(b"arm64"), Some(b"{\"sbom\":2}".to_vec()))),
            ]),
        }
    }

    /// What `distro verify` reads back from the artifacts `artifacts` made.
    fn attached(arts: &[Artifact]) -> Attached {
        let mut a = Attached::default();
        for art in arts {
            let m: Value = serde_json::from_slice(&art.manifest).unwrap();
            assert_eq!(m["subject"]["digest"], json!(Digest::of(b"index").to_string()));
            assert_eq!(m["config"]["mediaType"], EMPTY_TYPE);
            for (l, blob) in m["layers"].as_array().unwrap().iter().zip(&art.blobs[1..]) {
                assert_eq!(l["digest"], json!(Digest::of(blob).to_string()));
                if art.artifact_type == SBOM_TYPE {
                    a.sbom_artifact = true;
                    a.sboms.insert(l["annotations"][PLATFORM_ANNOTATION].as_str().unwrap().into(), blob.clone());
                } else {
                    a.statements.push(blob.clone());
                }
            }
        }
        a
    }

    #[test]
    fn the_attachments_of_an_image_verify_against_it() {
        let s = subject();
        let arts = artifacts(&s);
        assert_eq!(arts.iter().map(|a| a.artifact_type).collect::<Vec<_>>(), [SBOM_TYPE, INTOTO_TYPE]);
        let a = attached(&arts);
        assert_eq!(check(&s, &a), Vec::<String>::new());
        let st: Value = serde_json::from_slice(&a.statements[0]).unwrap();
        let deps = st["predicate"]["buildDefinition"]["resolvedDependencies"].as_array().unwrap();
        assert_eq!(deps.len(), 3, "revision, base, one source: {deps:?}");
        assert_eq!(st["subject"].as_array().unwrap().len(), 3, "the index and two platforms");
        // The same image gives the same artifacts (a re-push adds nothing).
        assert_eq!(artifacts(&s)[1].manifest, arts[1].manifest);
    }

    #[test]
    fn each_mismatch_is_one_line_naming_it() {
        let s = subject();
        let mut a = attached(&artifacts(&s));
        // The provenance altered: another revision, a source's tree, and a dropped platform.
        let mut st: Value = serde_json::from_slice(&a.statements[0]).unwrap();
        for d in st["predicate"]["buildDefinition"]["resolvedDependencies"].as_array_mut().unwrap() {
            match d["name"].as_str().unwrap() {
                "revision" => d["digest"]["gitCommit"] = json!("e".repeat(40)),
                "source:upstream" => d["digest"]["gitTree"] = json!("f".repeat(40)),
                _ => {}
            }
        }
        st["subject"].as_array_mut().unwrap().pop();
        a.statements[0] = serde_json::to_vec(&st).unwrap();
        a.sboms.insert("linux/amd64".into(), b"other".to_vec());
        let lines = check(&s, &a);
        assert_eq!(lines.len(), 4, "{lines:#?}");
        assert!(lines[0].starts_with("sbom linux/amd64: the attached SBOM (sha256:"), "{}", lines[0]);
        assert!(lines[1].contains("do not name the linux/arm64/v8 manifest"), "{}", lines[1]);
        assert!(lines[2].starts_with("provenance: dependency revision is {\"gitCommit\":\"eeee"), "{}", lines[2]);
        assert!(lines[3].starts_with("provenance: dependency source:upstream is {\"gitTree\":\"ffff"), "{}", lines[3]);
        assert!(lines.iter().all(|l| !l.contains('\n')));
        assert_eq!(check(&s, &Attached::default()), ["sbom: none is attached", "provenance: none is attached"]);
    }
}
