//! The training configuration: what a recipe says once defaults, `extends` and overrides are applied.
//!
//! Every key is documented in `docs/recipes.md`; the doc comments here are the short form of it.
//! A [`Config`] is plain data. [`recipe`] builds one from TOML layers and [`Config::validate`]
//! rejects what cannot train, naming the keys involved.
//!
//! A key is defined in one place, its field: each section is declared with `section!`, which
//! keeps a field's doc, its default and whether a resumed run may change it together, and
//! validates itself beside its struct. A unit test holds docs/recipes.md's tables to the fields.
//!
//! The sections live in one file each, re-exported here so that every item is `config::X`:
//! - `mod.rs`: [`Key`], the `section!` macro, [`SECTIONS`], the top level ([`Config`]) and the
//!   checks the sections share;
//! - `model.rs`: `[model]` and `[model.rope_scaling]` ([`ModelConfig`], [`RopeScaling`],
//!   [`Family`], [`Gelu`]);
//! - `attention.rs`: `[model.mla]` and `[model.yarn]` ([`MlaConfig`], [`Yarn`]);
//! - `moe.rs`: `[model.moe]` ([`MoeConfig`]);
//! - `train.rs`: `[train]`, `[train.fp8]` and `[train.diagnostics]` ([`TrainConfig`],
//!   [`BatchSize`], [`Precision`], [`Fp8Recipe`], [`Fp8Config`], [`DiagnosticsConfig`],
//!   [`PipelineSplit`], [`PipelineSchedule`], [`AttentionImpl`], [`Remat`]);
//! - `optim.rs`: `[optim]` and `[optim.muon]` ([`OptimConfig`], [`Schedule`], [`OptimName`],
//!   [`MuonConfig`], [`AdjustLr`], [`MuonDistribution`]);
//! - `data.rs`: `[data]` and `[[data.mixture]]` ([`DataConfig`], [`DataSource`], [`MixtureSource`]);
//! - `mesh.rs`: `[mesh]` ([`MeshConfig`]);
//! - `count.rs`, `flat.rs` and `recipe.rs`: parameter counts, flattened keys and recipe resolution.

pub mod count;
pub mod flat;
pub mod recipe;

use anyhow::{Result, anyhow, bail};
use serde::{Deserialize, Serialize};

pub use recipe::{Origin, Override, Resolved, resolve};

/// One key of a configuration section, as its field declares it.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// The field's name (the key within its section).
    pub name: &'static str,
    /// Whether a resumed run may give it another value than the checkpoint's: it does not
    /// change what the next step computes (a run control, where the data lives, how the same
    /// global batch is cut over devices). The others must match (`checkpoint/resume.rs`).
    pub resumable: bool,
    /// Its default as TOML (`None` for an absent optional key), for the test that holds
    /// docs/recipes.md to the code.
    pub default: fn() -> Option<toml::Value>,
}

/// Declares a configuration section: the struct, its `Default` from the defaults written beside
/// the fields (`pub name: Type = default,`), and its [`Key`]s (`SECTION::KEYS`). `@resumable`
/// before a field marks a key that a resumed run may change ([`Config::resumable`]).
macro_rules! section {
    (@resumable resumable) => { true };
    (@resumable) => { false };
    (
        $(#[$attr:meta])*
        pub struct $name:ident {
            $(
                $(#[$field_attr:meta])*
                $(@$flag:ident)?
                pub $field:ident: $ty:ty = $default:expr
            ),* $(,)?
        }
    ) => {
        $(#[$attr])*
        pub struct $name {
            $($(#[$field_attr])* pub $field: $ty,)*
        }

        impl Default for $name {
            fn default() -> Self {
                $name { $($field: $default,)* }
            }
        }

        impl $name {
            /// This section's keys, in the order of its fields.
            pub const KEYS: &'static [Key] = &[$(Key {
                name: stringify!($field),
                resumable: section!(@resumable $($flag)?),
                default: || toml::Value::try_from(<$name as Default>::default().$field).ok(),
            },)*];
        }
    };
}

// Declared after `section!`, which they use.
mod attention;
mod data;
mod mesh;
mod model;
mod moe;
mod optim;
mod train;

pub use attention::*;
pub use data::*;
pub use mesh::*;
pub use model::*;
pub use moe::*;
pub use optim::*;
pub use train::*;

/// Every section's keys by the section's dotted name (`""`: the top level).
pub const SECTIONS: [(&str, &[Key]); 13] = [
    ("", Config::KEYS),
    ("model", ModelConfig::KEYS),
    ("model.rope_scaling", RopeScaling::KEYS),
    ("model.yarn", Yarn::KEYS),
    ("model.mla", MlaConfig::KEYS),
    ("model.moe", MoeConfig::KEYS),
    ("train", TrainConfig::KEYS),
    ("train.fp8", Fp8Config::KEYS),
    ("train.diagnostics", DiagnosticsConfig::KEYS),
    ("optim", OptimConfig::KEYS),
    ("optim.muon", MuonConfig::KEYS),
    ("data", DataConfig::KEYS),
    ("mesh", MeshConfig::KEYS),
];

section! {
    /// A full training configuration.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct Config {
        /// One line on what the recipe is for.
        @resumable
        pub description: String = String::new(),
        /// A recipe this one starts from: a built-in name or a path relative to this file. Its keys
        /// apply first; this file's keys win.
        #[serde(skip_serializing_if = "Option::is_none")]
        @resumable
        pub extends: Option<String> = None,
        /// The model architecture.
        pub model: ModelConfig = ModelConfig::default(),
        /// Batch shape, length of the run and seeding.
        pub train: TrainConfig = TrainConfig::default(),
        /// AdamW and the learning-rate schedule.
        pub optim: OptimConfig = OptimConfig::default(),
        /// Where training tokens come from.
        pub data: DataConfig = DataConfig::default(),
        /// How devices split the work: data, fsdp and tensor axes, within and across nodes.
        pub mesh: MeshConfig = MeshConfig::default(),
    }
}

impl Config {
    /// Checks everything a training run needs to be consistent, section by section; errors name
    /// the keys involved.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.train.validate(&self.model)?;
        self.optim.validate()?;
        if self.optim.qk_clip > 0.0 && self.model.qk_norm() {
            bail!(
                "optim.qk_clip = {}: this model normalises every q and k head after its projection (model.qk_norm: Qwen3, Gemma 3), so rescaling the projections cannot lower its logits; set optim.qk_clip = 0",
                self.optim.qk_clip
            );
        }
        // The mesh's sizes are checked against the devices and the model when a run starts
        // (`parallel/mesh.rs`): the tensor axis splits every family, GPT's biases included.
        self.data.validate(&self.model)
    }

    /// Whether a resumed run may change the dotted `key` (`train.steps`): whether its field is
    /// declared `@resumable`. An unknown key is not.
    pub fn resumable(key: &str) -> bool {
        let (section, name) = key.rsplit_once('.').unwrap_or(("", key));
        SECTIONS.iter().any(|(s, keys)| *s == section && keys.iter().any(|k| k.name == name && k.resumable))
    }
}

/// Finite and greater than zero (false for NaN).
fn positive_number(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// Finite and at least `min` (false for NaN).
fn at_least(x: f64, min: f64) -> bool {
    x.is_finite() && x >= min
}

/// The first of `keys` whose value is 0, as an error.
fn check_positive(keys: &[(&str, usize)]) -> Result<()> {
    match keys.iter().find(|(_, value)| *value == 0) {
        Some((key, _)) => Err(anyhow!("{key} must be greater than 0")),
        None => Ok(()),
    }
}

/// The first of `keys` whose value is above its bound, as an error.
fn check_at_most(keys: &[(&str, usize, usize)]) -> Result<()> {
    match keys.iter().find(|(_, value, max)| value > max) {
        Some((key, value, max)) => Err(anyhow!("{key} = {value} is more than this engine trains (at most {max})")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use toml::Value;

    use super::*;

    /// docs/recipes.md's tables of keys, as the code declares them: every key documented once,
    /// with its default; no key documented that the code lacks; a section for every nested
    /// table. `—` (required) stands for a default of 0, which validation refuses; `none` for an
    /// absent optional key or an empty list.
    #[test]
    fn docs_recipes_md_documents_every_key_with_its_default() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/recipes.md");
        let text = std::fs::read_to_string(path).unwrap();
        let (mut section, mut headings, mut rows) = (None, BTreeSet::new(), BTreeMap::new());
        for line in text.lines() {
            if line.starts_with('#') {
                let title = line.trim_start_matches('#').trim();
                section = match title {
                    "Top level" => Some(String::new()),
                    _ => title.strip_prefix("`[").and_then(|t| t.split_once("]`")).map(|(s, _)| s.to_owned()),
                };
                headings.extend(section.clone());
                continue;
            }
            let Some(section) = &section else { continue };
            if !line.starts_with("| `") {
                continue;
            }
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`').trim_start_matches("[[").trim_end_matches("]]");
            let key = if section.is_empty() { name.to_owned() } else { format!("{section}.{name}") };
            assert!(rows.insert(key.clone(), cells[3].to_owned()).is_none(), "docs/recipes.md lists {key} twice");
        }
        let number = |v: &Value| v.as_float().or_else(|| v.as_integer().map(|i| i as f64));
        for (section, keys) in SECTIONS {
            for key in keys {
                let dotted = if section.is_empty() { key.name.to_owned() } else { format!("{section}.{}", key.name) };
                if SECTIONS.iter().any(|(s, _)| *s == dotted) {
                    assert!(headings.contains(&dotted), "docs/recipes.md has no section for [{dotted}]");
                    continue;
                }
                let cell = rows.remove(&dotted).unwrap_or_else(|| panic!("docs/recipes.md does not document {dotted}"));
                let default = (key.default)();
                match cell.as_str() {
                    "—" => assert_eq!(default, Some(Value::Integer(0)), "{dotted} is documented as required"),
                    "none" => assert!(
                        default.is_none() || default == Some(Value::Array(Vec::new())),
                        "{dotted} is documented with no default, the code's is {default:?}"
                    ),
                    cell => {
                        let written = cell.trim_matches('`');
                        let mut doc: toml::Table = format!("v = {written}")
                            .parse()
                            .unwrap_or_else(|e| panic!("{dotted}: default {cell} is not TOML: {e}"));
                        let doc = doc.remove("v").unwrap();
                        let code = default.unwrap_or_else(|| panic!("{dotted} has no default in the code"));
                        let same = match (number(&doc), number(&code)) {
                            (Some(a), Some(b)) => a == b,
                            _ => doc == code,
                        };
                        assert!(same, "{dotted}: docs/recipes.md says the default is {written}, the code {code}");
                    }
                }
            }
        }
        assert!(rows.is_empty(), "docs/recipes.md documents keys the configuration lacks: {:?}", rows.keys());
    }

    /// Resumability is the field's: run controls and the mesh may change, what the next step
    /// computes may not; nested and unknown keys are not resumable.
    #[test]
    fn keys_say_whether_a_resumed_run_may_change_them() {
        for key in ["description", "extends", "train.steps", "train.keep_last", "data.path", "mesh.ici_data"] {
            assert!(Config::resumable(key), "{key}");
        }
        for key in ["model.d_model", "train.seq_len", "train.batch_size", "optim.lr", "model.moe.top_k", "mesh", "x.y"]
        {
            assert!(!Config::resumable(key), "{key}");
        }
        let mesh = MeshConfig::KEYS.iter().filter(|k| !k.resumable).map(|k| k.name).collect::<Vec<_>>();
        assert!(mesh.is_empty(), "every mesh key is resumable: {mesh:?}");
    }
}
