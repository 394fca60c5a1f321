//! The SBOM: SPDX 2.3 JSON of what went into one platform's image: the crates linked into
//! the engine (from the build's `Cargo.lock`, with checksums, and cargo's resolve for the
//! target, with licenses) and the base image, with the Debian packages its dpkg database lists
//! (each with a `pkg:deb` package URL).
use crate::dated::rfc3339;
use crate::oci::digest::{Digest, KeyHasher};
use crate::oci::json::canonical;
use crate::oci::platform::Platform;
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};

/// What the SBOM describes.
pub struct SbomInput<'a> {
    /// Image name (the definition's `name`), the SBOM's top package.
    pub image: &'a str,
    /// The dated tag (`NAME-YYYY-MM-DD`), the top package's version.
    pub version: &'a str,
    /// Platform the SBOM describes (its packages are those cargo resolves for it).
    pub platform: &'a Platform,
    /// SOURCE_DATE_EPOCH.
    pub epoch: u64,
    /// Revision of the project built (the commit, `-dirty` when the tree differed).
    pub revision: &'a str,
    /// Project repository URL, if known.
    pub repository: Option<&'a str>,
    /// The build's `Cargo.lock`.
    pub lock: &'a [u8],
    /// `cargo metadata --filter-platform` for the platform.
    pub metadata: &'a Value,
    /// Packages whose binaries are in the image (e.g. `engine`).
    pub roots: &'a [String],
    /// Base image: repository name (`docker.io/nvidia/cuda`), tag and platform manifest digest.
    pub base_name: String,
    /// Base tag, if any.
    pub base_tag: Option<String>,
    /// Base platform manifest digest.
    pub base_digest: &'a Digest,
    /// The base's distribution and Debian packages, when its layers were read.
    pub base_contents: Option<&'a super::dpkg::BaseContents>,
}

fn spdx_id(prefix: &str, name: &str, version: &str) -> String {
    let clean = |s: &str| {
        s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '-' }).collect::<String>()
    };
    format!("SPDXRef-{prefix}-{}-{}", clean(name), clean(version))
}

/// Renders the SBOM as canonical JSON.
pub fn sbom(input: &SbomInput) -> Result<Vec<u8>> {
    let lock: toml::Table = toml::from_str(std::str::from_utf8(input.lock)?).context("parsing Cargo.lock")?;
    let mut checksums: BTreeMap<(String, String), String> = BTreeMap::new();
    for p in lock.get("package").and_then(|p| p.as_array()).into_iter().flatten() {
        if let (Some(n), Some(v), Some(c)) = (
            p.get("name").and_then(|x| x.as_str()),
            p.get("version").and_then(|x| x.as_str()),
            p.get("checksum").and_then(|x| x.as_str()),
        ) {
            checksums.insert((n.into(), v.into()), c.into());
        }
    }
    let meta = input.metadata;
    let packages: BTreeMap<&str, &Value> = meta["packages"]
        .as_array()
        .context("cargo metadata without packages")?
        .iter()
        .filter_map(|p| p["id"].as_str().map(|id| (id, p)))
        .collect();
    let nodes: BTreeMap<&str, &Value> = meta["resolve"]["nodes"]
        .as_array()
        .context("cargo metadata without resolve")?
        .iter()
        .filter_map(|n| n["id"].as_str().map(|id| (id, n)))
        .collect();
    let members: BTreeSet<&str> =
        meta["workspace_members"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    let roots: Vec<&str> = packages
        .iter()
        .filter(|(id, p)| members.contains(*id) && input.roots.iter().any(|r| p["name"] == r.as_str()))
        .map(|(id, _)| *id)
        .collect();

    // Walk the graph: normal edges from the roots are linked in; build edges bring build tools.
    let mut linked: BTreeSet<&str> = roots.iter().copied().collect();
    let mut build: BTreeSet<&str> = BTreeSet::new();
    let mut edges: BTreeSet<(&str, &str, bool)> = BTreeSet::new();
    let mut todo: Vec<(&str, bool)> = roots.iter().map(|r| (*r, false)).collect();
    while let Some((id, in_build)) = todo.pop() {
        let Some(node) = nodes.get(id) else { continue };
        for dep in node["deps"].as_array().into_iter().flatten() {
            let Some(pkg) = dep["pkg"].as_str() else {
                continue;
            };
            let kinds: Vec<Option<&str>> =
                dep["dep_kinds"].as_array().into_iter().flatten().map(|k| k["kind"].as_str()).collect();
            let normal = kinds.iter().any(|k| k.is_none());
            let build_edge = kinds.contains(&Some("build"));
            if !normal && !build_edge {
                continue; // dev-only
            }
            let dep_in_build = in_build || !normal;
            edges.insert((id, pkg, dep_in_build));
            let new = if dep_in_build { !linked.contains(pkg) && build.insert(pkg) } else { linked.insert(pkg) };
            if new {
                todo.push((pkg, dep_in_build));
            }
        }
    }
    build.retain(|p| !linked.contains(p));

    let base_purpose = |id: &str| {
        if roots.contains(&id) { "APPLICATION" } else { "LIBRARY" }
    };
    let mut pkgs = Vec::new();
    let mut ids: BTreeMap<&str, String> = BTreeMap::new();
    for id in linked.iter().chain(build.iter()) {
        let p = packages[id];
        let name = p["name"].as_str().unwrap_or("");
        let version = p["version"].as_str().unwrap_or("");
        let sid = spdx_id("Crate", name, version);
        ids.insert(id, sid.clone());
        let source = p["source"].as_str();
        let (download, comment) = match source {
            Some(s) if s.starts_with("registry+") => {
                (format!("https://crates.io/api/v1/crates/{name}/{version}/download"), None)
            }
            Some(s) if s.starts_with("git+") => (s.to_string(), None),
            _ if members.contains(id) => match input.repository {
                Some(r) => (format!("git+{r}@{}", input.revision.trim_end_matches("-dirty")), None),
                None => ("NOASSERTION".into(), None),
            },
            _ => ("NOASSERTION".into(), Some("patched source; see /opt/distro/manifest.lock and /opt/distro/patches")),
        };
        let license = p["license"].as_str().map(|l| l.replace('/', " OR ")).unwrap_or_else(|| "NOASSERTION".into());
        let mut pkg = json!({
            "SPDXID": sid,
            "name": name,
            "versionInfo": version,
            "downloadLocation": download,
            "filesAnalyzed": false,
            "licenseConcluded": "NOASSERTION",
            "licenseDeclared": license,
            "copyrightText": "NOASSERTION",
            "primaryPackagePurpose": base_purpose(id),
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl", "referenceLocator": format!("pkg:cargo/{name}@{version}")}],
        });
        if let Some(c) = checksums.get(&(name.to_string(), version.to_string())) {
            pkg["checksums"] = json!([{"algorithm": "SHA256", "checksumValue": c}]);
        }
        if let Some(c) = comment {
            pkg["comment"] = json!(c);
        }
        pkgs.push(pkg);
    }
    let base_repo_tail = input.base_name.rsplit('/').next().unwrap_or(&input.base_name);
    pkgs.push(json!({
        "SPDXID": "SPDXRef-BaseImage",
        "name": input.base_name,
        "versionInfo": input.base_tag.clone().unwrap_or_else(|| input.base_digest.to_string()),
        "downloadLocation": "NOASSERTION",
        "filesAnalyzed": false,
        "licenseConcluded": "NOASSERTION",
        "licenseDeclared": "NOASSERTION",
        "copyrightText": "NOASSERTION",
        "primaryPackagePurpose": "CONTAINER",
        "checksums": [{"algorithm": "SHA256", "checksumValue": input.base_digest.hex()}],
        "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl", "referenceLocator": format!(
            "pkg:oci/{base_repo_tail}@sha256%3A{}?arch={}&repository_url={}", input.base_digest.hex(), input.platform.architecture, input.base_name)}],
    }));
    let mut deb_ids = Vec::new();
    if let Some(contents) = input.base_contents {
        for p in &contents.packages {
            let sid = spdx_id("Deb", &p.name, &format!("{}-{}", p.version, p.arch));
            pkgs.push(json!({
                "SPDXID": sid,
                "name": p.name,
                "versionInfo": p.version,
                "downloadLocation": "NOASSERTION",
                "filesAnalyzed": false,
                "licenseConcluded": "NOASSERTION",
                "licenseDeclared": "NOASSERTION",
                "copyrightText": "NOASSERTION",
                "primaryPackagePurpose": "LIBRARY",
                "comment": format!("from the base image's dpkg database ({})", p.arch),
                "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl", "referenceLocator": p.purl(contents)}],
            }));
            deb_ids.push(sid);
        }
    }
    pkgs.push(json!({
        "SPDXID": "SPDXRef-Image",
        "name": input.image,
        "versionInfo": input.version,
        "downloadLocation": "NOASSERTION",
        "filesAnalyzed": false,
        "licenseConcluded": "NOASSERTION",
        "licenseDeclared": "NOASSERTION",
        "copyrightText": "NOASSERTION",
        "primaryPackagePurpose": "CONTAINER",
    }));

    let mut rels = vec![
        json!({"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES", "relatedSpdxElement": "SPDXRef-Image"}),
        json!({"spdxElementId": "SPDXRef-Image", "relationshipType": "DESCENDANT_OF", "relatedSpdxElement": "SPDXRef-BaseImage"}),
    ];
    for sid in &deb_ids {
        rels.push(
            json!({"spdxElementId": "SPDXRef-BaseImage", "relationshipType": "CONTAINS", "relatedSpdxElement": sid}),
        );
    }
    for r in &roots {
        rels.push(
            json!({"spdxElementId": "SPDXRef-Image", "relationshipType": "CONTAINS", "relatedSpdxElement": ids[r]}),
        );
    }
    for (from, to, is_build) in &edges {
        rels.push(if *is_build {
            json!({"spdxElementId": ids[to], "relationshipType": "BUILD_DEPENDENCY_OF", "relatedSpdxElement": ids[from]})
        } else {
            json!({"spdxElementId": ids[from], "relationshipType": "DEPENDS_ON", "relatedSpdxElement": ids[to]})
        });
    }
    rels.sort_by_key(|r| r.to_string());
    rels.dedup();

    let mut k = KeyHasher::new("spdx-namespace-v1");
    k.part(input.lock).part(input.base_digest.as_str().as_bytes()).part(input.revision.as_bytes());
    let ns_base = input.repository.unwrap_or("https://spdx.invalid/distro");
    let doc = json!({
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": format!("{}-{}-{}", input.image, input.version, input.platform.slug()),
        "documentNamespace": format!("{}/spdx/{}/{}/{}", ns_base.trim_end_matches('/'), input.version, input.platform.slug(), k.finish()),
        "creationInfo": {"created": rfc3339(input.epoch), "creators": [concat!("Tool: distro-", env!("CARGO_PKG_VERSION"))]},
        "packages": pkgs,
        "relationships": rels,
    });
    Ok(canonical(&doc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_walk_licenses_and_checksums() {
        let lock = br#"version = 4
[[package]]
name = "engine"
version = "0.1.0"
[[package]]
name = "serde"
version = "1.0.0"
source = "registry+https://github.com/rust-lang/crates.io-index"
checksum = "abc"
[[package]]
name = "cc"
version = "1.2.0"
source = "registry+https://github.com/rust-lang/crates.io-index"
checksum = "def"
[[package]]
name = "proptest"
version = "1.0.0"
source = "registry+https://github.com/rust-lang/crates.io-index"
checksum = "111"
"#;
        let meta = json!({
            "workspace_members": ["path+file:///w/engine#0.1.0"],
            "packages": [
                {"id": "path+file:///w/engine#0.1.0", "name": "engine", "version": "0.1.0", "license": "Apache-2.0", "source": null},
                {"id": "reg#serde@1.0.0", "name": "serde", "version": "1.0.0", "license": "MIT/Apache-2.0", "source": "registry+https://github.com/rust-lang/crates.io-index"},
                {"id": "reg#cc@1.2.0", "name": "cc", "version": "1.2.0", "license": "MIT", "source": "registry+https://github.com/rust-lang/crates.io-index"},
                {"id": "reg#proptest@1.0.0", "name": "proptest", "version": "1.0.0", "license": "MIT", "source": "registry+https://github.com/rust-lang/crates.io-index"}
            ],
            "resolve": {"nodes": [
                {"id": "path+file:///w/engine#0.1.0", "deps": [
                    {"pkg": "reg#serde@1.0.0", "dep_kinds": [{"kind": null}]},
                    {"pkg": "reg#cc@1.2.0", "dep_kinds": [{"kind": "build"}]},
                    {"pkg": "reg#proptest@1.0.0", "dep_kinds": [{"kind": "dev"}]}
                ]},
                {"id": "reg#serde@1.0.0", "deps": []},
                {"id": "reg#cc@1.2.0", "deps": []},
                {"id": "reg#proptest@1.0.0", "deps": []}
            ]}
        });
        let p = Platform::parse("linux/amd64").unwrap();
        let bd = Digest::of(b"base");
        let contents = crate::image::dpkg::BaseContents {
            os_id: Some("ubuntu".into()),
            os_version: Some("24.04".into()),
            packages: vec![crate::image::dpkg::DebPackage {
                name: "libc6".into(),
                version: "2.39-0ubuntu8".into(),
                arch: "amd64".into(),
            }],
        };
        let input = SbomInput {
            image: "engine",
            version: "engine-2025-01-02",
            platform: &p,
            epoch: 0,
            revision: "abc",
            repository: Some("https://github.com/x/y"),
            lock,
            metadata: &meta,
            roots: &["engine".to_string()],
            base_name: "localhost:5000/debian".into(),
            base_tag: Some("bookworm".into()),
            base_digest: &bd,
            base_contents: Some(&contents),
        };
        let bytes = sbom(&input).unwrap();
        assert_eq!(bytes, sbom(&input).unwrap(), "deterministic");
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["spdxVersion"], "SPDX-2.3");
        let names: Vec<&str> = v["packages"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
        assert!(names.contains(&"serde") && names.contains(&"cc") && !names.contains(&"proptest"), "{names:?}");
        let serde = v["packages"].as_array().unwrap().iter().find(|p| p["name"] == "serde").unwrap();
        assert_eq!(serde["licenseDeclared"], "MIT OR Apache-2.0");
        assert_eq!(serde["checksums"][0]["checksumValue"], "abc");
        let libc = v["packages"].as_array().unwrap().iter().find(|p| p["name"] == "libc6").unwrap();
        assert_eq!(
            libc["externalRefs"][0]["referenceLocator"],
            "pkg:deb/ubuntu/libc6@2.39-0ubuntu8?arch=amd64&distro=ubuntu-24.04"
        );
        let rels = v["relationships"].as_array().unwrap();
        assert!(rels.iter().any(|r| r["relationshipType"] == "CONTAINS" && r["relatedSpdxElement"] == libc["SPDXID"]));
        let engine = v["packages"].as_array().unwrap().iter().find(|p| p["name"] == "engine").unwrap();
        assert_eq!(engine["downloadLocation"], "git+https://github.com/x/y@abc");
        let rels = v["relationships"].to_string();
        assert!(rels.contains("BUILD_DEPENDENCY_OF") && rels.contains("DEPENDS_ON") && rels.contains("DESCENDANT_OF"));
        assert_eq!(v["creationInfo"]["created"], "1970-01-01T00:00:00Z");
    }
}
