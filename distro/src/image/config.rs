//! The image config: the base's config with our layers, environment, command and labels.
use super::def::ImageDef;
use crate::dated::rfc3339;
use crate::oci::digest::Digest;
use crate::oci::json::canonical;
use crate::oci::platform::Platform;
use anyhow::Result;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// One layer this build adds, for `rootfs.diff_ids` and `history`.
#[derive(Clone, Debug)]
pub struct AddedLayer {
    /// Digest of the uncompressed tar.
    pub diff_id: Digest,
    /// What the layer holds (the history entry's `created_by`).
    pub created_by: String,
}

/// Fields of the base's `config` object kept as they are (OCI image-spec fields only; Docker's
/// extensions such as `Healthcheck` or `OnBuild` are dropped with the Docker media types).
const KEPT_FROM_BASE: &[&str] =
    &["User", "ExposedPorts", "Volumes", "StopSignal", "Entrypoint", "WorkingDir", "Labels", "Env"];

/// Builds the canonical config bytes for `platform`.
pub fn image_config(
    base: &Value,
    def: &ImageDef,
    platform: &Platform,
    epoch: u64,
    added: &[AddedLayer],
    labels: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let created = rfc3339(epoch);
    let base_cfg = base.get("config").and_then(Value::as_object).cloned().unwrap_or_default();
    let mut cfg = Map::new();
    for k in KEPT_FROM_BASE {
        if let Some(v) = base_cfg.get(*k).filter(|v| !v.is_null()) {
            cfg.insert((*k).to_string(), v.clone());
        }
    }
    cfg.insert("Env".into(), json!(merge_env(base_cfg.get("Env"), def)));
    cfg.insert("Cmd".into(), json!(def.cmd));
    if let Some(ep) = &def.entrypoint {
        cfg.insert("Entrypoint".into(), json!(ep));
    }
    if let Some(w) = &def.workdir {
        cfg.insert("WorkingDir".into(), json!(w));
    }
    let mut all_labels: BTreeMap<String, String> = base_cfg
        .get("Labels")
        .and_then(Value::as_object)
        .map(|m| m.iter().filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string()))).collect())
        .unwrap_or_default();
    all_labels.extend(def.labels.clone());
    all_labels.extend(labels.clone());
    cfg.insert("Labels".into(), json!(all_labels));

    let mut diff_ids: Vec<Value> = base["rootfs"]["diff_ids"].as_array().cloned().unwrap_or_default();
    diff_ids.extend(added.iter().map(|a| json!(a.diff_id)));
    let mut history: Vec<Value> = base.get("history").and_then(Value::as_array).cloned().unwrap_or_default();
    history.extend(
        added.iter().map(|a| json!({"created": created, "created_by": a.created_by, "comment": "distro build"})),
    );

    let mut v = json!({
        "created": created,
        "architecture": platform.architecture,
        "os": platform.os,
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": history,
    });
    if let Some(var) = &platform.variant {
        v["variant"] = json!(var);
    }
    for k in ["os.version", "os.features"] {
        if let Some(x) = base.get(k) {
            v[k] = x.clone();
        }
    }
    Ok(canonical(&v))
}

/// The base's `Env` with the definition's variables replacing same-named ones in place and
/// new ones appended in key order.
pub fn merge_env(base_env: Option<&Value>, def: &ImageDef) -> Vec<String> {
    let mut env: Vec<String> = base_env
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default();
    for (k, var) in &def.env {
        let entry = format!("{k}={}", var.value);
        match env.iter_mut().find(|e| e.split_once('=').map(|(n, _)| n) == Some(k.as_str())) {
            Some(e) => *e = entry,
            None => env.push(entry),
        }
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def() -> ImageDef {
        ImageDef::parse(
            r#"name = "engine"
description = "d"
platforms = ["linux/arm64"]
base = "localhost:5000/b:1"
cmd = ["engine", "info"]
workdir = "/opt/engine"
[env.PATH]
value = "/usr/local/bin:/usr/bin:/bin"
reason = "r"
[env.NCCL_DEBUG]
value = "WARN"
reason = "r"
"#,
            "t",
        )
        .unwrap()
    }

    #[test]
    fn config_merges_base_and_ours() {
        let base = json!({
            "architecture": "arm64", "os": "linux", "created": "2020-01-01T00:00:00Z",
            "config": {"Env": ["PATH=/bin", "LANG=C"], "Entrypoint": ["/entry.sh"], "Labels": {"maintainer": "x"},
                       "Healthcheck": {"Test": ["NONE"]}},
            "rootfs": {"type": "layers", "diff_ids": ["sha256:aa"]},
            "history": [{"created": "2020-01-01T00:00:00Z", "created_by": "base"}],
            "container_config": {"junk": true}
        });
        let p = Platform::parse("linux/arm64").unwrap();
        let added = [AddedLayer { diff_id: Digest::of(b"t"), created_by: "engine".into() }];
        let labels = BTreeMap::from([("org.opencontainers.image.revision".to_string(), "abc".to_string())]);
        let bytes = image_config(&base, &def(), &p, 86_400, &added, &labels).unwrap();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["created"], "1970-01-02T00:00:00Z");
        assert_eq!(v["variant"], "v8");
        assert_eq!(v["config"]["Env"], json!(["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C", "NCCL_DEBUG=WARN"]));
        assert_eq!(v["config"]["Entrypoint"], json!(["/entry.sh"]), "base entrypoint kept");
        assert_eq!(v["config"]["Cmd"], json!(["engine", "info"]));
        assert_eq!(v["config"]["WorkingDir"], "/opt/engine");
        assert_eq!(v["config"]["Labels"]["maintainer"], "x");
        assert_eq!(v["config"]["Labels"]["org.opencontainers.image.revision"], "abc");
        assert!(v["config"].get("Healthcheck").is_none());
        assert!(v.get("container_config").is_none());
        assert_eq!(v["rootfs"]["diff_ids"].as_array().unwrap().len(), 2);
        let h = v["history"].as_array().unwrap();
        assert_eq!(h[0]["created_by"], "base");
        assert_eq!(h[1]["created"], "1970-01-02T00:00:00Z");
    }
}
