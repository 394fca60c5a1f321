//! The recipe and `--set` parser: a recipe file (the input up to a line `---`) resolved with
//! the `--set` overrides that follow (one a line), and the overrides alone on a built-in recipe.
//! A valid configuration is also counted, as `recipes show` does, and a mixture's weights drawn
//! from as the loader draws (`data::mixture::Mixture`). Anything may be refused; no input may
//! panic, hang or overflow.
#![no_main]

use engine::config::{Override, resolve};
use engine::data::mixture::{Mixture, TRAIN_STREAM};
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
            if !c.data.mixture.is_empty() {
                let weights: Vec<f64> = c.data.mixture.iter().map(|m| m.weight).collect();
                let m = Mixture::new(&weights, c.train.seed, TRAIN_STREAM);
                let mut drawn = vec![0usize; weights.len()];
                (0..256).for_each(|g| drawn[m.source(g)] += 1);
                // A source of the largest weight has a share of at least 1/n: with n <= 16 it
                // is drawn some 16 times in 256 (the golden-ratio sequence strays by a few at
                // most), never 0 times (of two weights of 1e308, the first was, issue 37).
                let largest = weights.iter().copied().fold(0.0, f64::max);
                if weights.len() <= 16 {
                    assert!(weights.iter().zip(&drawn).all(|(&w, &d)| w < largest || d > 0), "{weights:?}: {drawn:?}");
                }
            }
        }
    }
});
