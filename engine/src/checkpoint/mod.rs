//! Checkpoints: one directory per saved step, written so that a crash never leaves one that
//! looks complete but is not (docs/checkpoints.md).
//!
//! ```text
//! RUN_DIR/checkpoints/step-000120/
//!   shard-*-of-N.safetensors, .json  each saving device's flat buffers and chunks ([`sharded`])
//!   config.toml                      the resolved configuration
//!   hf/...                           files of the Hugging Face model this one started from (optional)
//!   state.json                       step, data position, seed, config hash, SHA-256 of every other file
//! ```
//!
//! Training saves the sharded format on every mesh, one device included
//! (`train/checkpointer.rs`); the whole-file format (`model.safetensors` under Hugging
//! Face names, `optimizer.safetensors` with the moments), which single devices saved before, is
//! still read, and [`write()`] still writes it for `import-hf`. A save writes everything into a
//! `.tmp-*` sibling, flushes every file, writes `state.json` last, flushes the directory and
//! renames it to `step-000120`: a directory under a `step-*` name is complete. Loading verifies
//! every file's size and SHA-256 against `state.json` and refuses a damaged checkpoint, naming
//! the file.
//!
//! One job a file: `format.rs` is what a step's directory holds and how it is written and
//! verified, `sharded.rs` the per-device shards in it, `housekeeping.rs` the checkpoints
//! directory (listing, pruning, clearing what interrupted saves leave), `resume.rs` the resume
//! policy (which checkpoint, and what may differ from it).
//!
//! The engine's randomness is counter-based ([`crate::rng`]): initialisation and data order are
//! pure functions of the seed, so the seed and the loader's position are the whole random state.

pub mod sharded;

mod format;
mod housekeeping;
mod resume;

use format::seal;
pub use format::{
    CONFIG_FILE, Checkpoint, Extras, FORMAT, FileSum, MODEL_FILE, OPTIMIZER_FILE, PAUSE_HOOK, Progress, STATE_FILE,
    Snapshot, State, VERSION, write, write_dir,
};
pub use housekeeping::{dir_name, latest, list, prune, remove_temporaries, set_aside_after};
pub use resume::{incompatible_keys, resume_point, resume_point_with};

/// What the tests of each part build on: a small configuration and a snapshot of its model.
#[cfg(test)]
pub(crate) mod testing {
    use super::Snapshot;
    use crate::config::{Config, Override, resolve};
    use crate::data::Position;
    use crate::model::{Layout, Model, init};

    pub fn small() -> Config {
        let set = |t: &str| Override { text: t.into(), origin: "--set".into() };
        resolve(
            "tiny-llama2",
            &[
                set("model.vocab_size=300"),
                set("model.d_model=16"),
                set("model.mlp_dim=32"),
                set("model.n_heads=2"),
                set("model.n_kv_heads=1"),
                set("model.head_dim=8"),
            ],
        )
        .unwrap()
        .config
    }

    pub fn snapshot(config: &Config, step: u64) -> (Layout, Snapshot) {
        let model = Model::new(&config.model);
        let params = init::params(&model, 3);
        let m: Vec<f32> = params.iter().map(|x| x * 0.5).collect();
        let v: Vec<f32> = params.iter().map(|x| x * x).collect();
        let position = Position { epoch: 1, index: 7, ..Position::default() };
        let snap = Snapshot { step, position, data_tokens: 1000, params, moments: Some((m, v)) };
        (model.layout, snap)
    }
}
