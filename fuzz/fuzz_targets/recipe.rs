//! The recipe and `--set` parser: a recipe file (the input up to a line `---`) resolved with
//! the `--set` overrides that follow (one a line), and the overrides alone on a built-in recipe.
//! A valid configuration is also counted, as `recipes show` does. Anything may be refused; no
//! input may panic, hang or overflow.
#![no_main]

use engine::config::{Override, resolve};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (recipe, sets) = text.split_once("\n---\n").unwrap_or((&text, ""));
    let path = std::env::temp_dir().join(format!("fuzz-recipe-{}.toml", std::process::id()));
    std::fs::write(&path, recipe).unwrap();
    let overrides: Vec<Override> =
        sets.lines().map(|l| Override { text: l.to_owned(), origin: "--set".into() }).collect();
    for name in [path.to_str().unwrap(), "tiny-llama2"] {
        if let Ok(r) = resolve(name, &overrides) {
            let c = &r.config;
            let _ = c.model.param_count();
            let _ = c.model.train_flops_per_token(c.train.seq_len);
        }
    }
});
