//! docs/flags.md is the one table of baked-in flags: it must list exactly the variables of
//! images/engine.toml, with the same values.
use distro::image::def::ImageDef;
use std::collections::BTreeMap;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

#[test]
fn flags_table_matches_the_image_definition() {
    let def = ImageDef::load(&root().join("images/engine.toml")).unwrap();
    let doc = std::fs::read_to_string(root().join("docs/flags.md")).unwrap();
    let mut rows: BTreeMap<String, String> = BTreeMap::new();
    for line in doc.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let name = cells[1].trim_matches('`').to_string();
        let value = if cells[2] == "*(empty)*" { String::new() } else { cells[2].trim_matches('`').to_string() };
        assert!(!cells[3].is_empty(), "{name}: no reason given in docs/flags.md");
        assert!(rows.insert(name.clone(), value).is_none(), "{name} listed twice in docs/flags.md");
    }
    let defined: BTreeMap<String, String> = def.env.iter().map(|(k, v)| (k.clone(), v.value.clone())).collect();
    assert_eq!(rows, defined, "docs/flags.md and images/engine.toml [env] differ");
}

#[test]
fn engine_definition_is_valid_and_pinned() {
    let def = ImageDef::load(&root().join("images/engine.toml")).unwrap();
    let base = def.base_reference(root()).unwrap();
    assert!(base.digest.is_some(), "the production base must be pinned by digest");
    // The Dockerfile builds on the same base as the image definition (images/manifest.toml).
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    assert!(dockerfile.contains(&format!("ARG BASE={base}\n")), "Dockerfile's ARG BASE is not {base}");
    assert_eq!(def.cmd, ["engine", "info"]);
    assert!(def.files.iter().any(|f| f.dest == "/usr/local/bin/test-all" && f.mode == 0o755));
    assert!(!def.env.contains_key("ENGINE_FLAGS"));
}

#[test]
fn dockerfile_sets_the_same_flags() {
    let def = ImageDef::load(&root().join("images/engine.toml")).unwrap();
    let text = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    // The runtime stage's one ENV instruction, continued over lines with `\`.
    let runtime = &text[text.find("AS runtime").expect("a runtime stage")..];
    let start = runtime.find("\nENV ").expect("an ENV in the runtime stage") + 5;
    let mut env = BTreeMap::new();
    for line in runtime[start..].lines() {
        let item = line.trim().trim_end_matches('\\').trim();
        let (k, v) = item.split_once('=').expect("KEY=VALUE");
        env.insert(k.to_string(), v.trim_matches('"').to_string());
        if !line.trim_end().ends_with('\\') {
            break;
        }
    }
    let defined: BTreeMap<String, String> = def.env.iter().map(|(k, v)| (k.clone(), v.value.clone())).collect();
    assert_eq!(env, defined, "Dockerfile ENV and images/engine.toml [env] differ");
    assert!(runtime.contains(r#"CMD ["engine", "info"]"#));
    assert!(runtime.contains("WORKDIR /opt/engine"));
}
