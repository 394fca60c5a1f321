//! Embeds every recipe in `recipes/` into the binary, so that `engine train --recipe NAME` works
//! anywhere, without the repository.

use std::{env, fs, path::Path};

fn main() {
    let dir = Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap()).join("../recipes");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut names: Vec<String> = fs::read_dir(&dir)
        .expect("recipes/ directory")
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.strip_suffix(".toml").map(str::to_owned)
        })
        .collect();
    names.sort();
    let mut out = String::from(
        "/// Built-in recipes: (name, TOML text), sorted by name.\npub static BUILTIN: &[(&str, &str)] = &[\n",
    );
    for name in names {
        let path = dir.join(format!("{name}.toml"));
        out += &format!("    ({name:?}, include_str!({:?})),\n", path.display().to_string());
    }
    out += "];\n";
    fs::write(Path::new(&env::var("OUT_DIR").unwrap()).join("recipes.rs"), out).unwrap();
}
