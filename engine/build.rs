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
    // The texts themselves, not include_str! of their paths: the generated file must not depend
    // on where the checkout is (its length shifts every later source position the compiler
    // records, which changed the engine binary between two checkouts: not reproducible).
    for name in names {
        let path = dir.join(format!("{name}.toml"));
        let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        out += &format!("    ({name:?}, {text:?}),\n");
    }
    out += "];\n";
    fs::write(Path::new(&env::var("OUT_DIR").unwrap()).join("recipes.rs"), out).unwrap();
}
