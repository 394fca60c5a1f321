//! The `[data]` section (`DataConfig`), its `DataSource` and the `[[data.mixture]]` entries
//! (`MixtureSource`).

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::{Key, ModelConfig, positive_number};

/// Where the training tokens come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// The public-domain English text embedded in the binary, as byte tokens.
    #[default]
    Embedded,
    /// Uniformly random tokens from the seed.
    Synthetic,
    /// Token shards written by `engine data prepare` (`data.path`).
    Shards,
}

section! {
    /// The training data.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct DataConfig {
        /// Document masking: attention inside a packed sequence stops at each EOS (the id the
        /// shards record), so that a token attends only to its own document's (docs/data.md).
        pub document_mask: bool = false,
        /// With `document_mask`: positions restart at 0 at each document (the GPT family's learned
        /// positions).
        pub reset_positions: bool = false,
        /// Token source.
        pub source: DataSource = DataSource::Embedded,
        /// With `source = "shards"`: a directory of shards (read in name order) or one shard file.
        /// A relative path is relative to the working directory. The data may move between a run
        /// and its resumption; it may not change (its shards are checked).
        @resumable
        pub path: String = String::new(),
        /// With `source = "shards"`, in place of `path`: several prepared datasets, each sequence
        /// read from one of them in proportion to the weights ([`crate::data::mixture`]).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        pub mixture: Vec<MixtureSource> = Vec::new(),
        /// Prepared shards that `eval_loss` reads instead of a held-out tail of the training data
        /// (none is held out then). Empty: the tail.
        pub validation_path: String = String::new(),
    }
}

impl DataConfig {
    /// The source and its paths, and document masking against the model it runs on.
    pub(super) fn validate(&self, model: &ModelConfig) -> Result<()> {
        if self.reset_positions && !self.document_mask {
            bail!("data.reset_positions = true needs data.document_mask = true (positions restart at each document)");
        }
        if self.document_mask {
            if self.source != DataSource::Shards {
                bail!(
                    "data.document_mask = true needs an EOS id, which only prepared shards record; set data.source = \"shards\""
                );
            }
            if self.reset_positions && !model.is_gpt() {
                bail!(
                    "data.reset_positions = true is for learned positions (model.family = \"gpt\"): RoPE's scores depend only on the distance between tokens, which the mask keeps within a document"
                );
            }
        }
        self.check_mixture()?;
        match (self.source, self.path.is_empty() && self.mixture.is_empty()) {
            (DataSource::Shards, true) => {
                bail!(
                    "data.source = \"shards\" needs data.path (a directory written by `engine data prepare`) or [[data.mixture]] entries"
                );
            }
            (DataSource::Embedded | DataSource::Synthetic, false) => {
                bail!("data.path is set but data.source is not \"shards\"; set data.source = \"shards\"");
            }
            _ => {}
        }
        Ok(())
    }
}

/// One dataset of a mixture (`[[data.mixture]]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixtureSource {
    /// A directory of shards or one shard file, as `data.path`.
    pub path: String,
    /// Its relative share of the training sequences: positive; the weights need not sum to 1.
    pub weight: f64,
    /// Its name in `tokens_by_source` and checkpoints; the path when unset.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
}

impl MixtureSource {
    /// The source's name: `name`, else its path.
    pub fn name(&self) -> &str {
        if self.name.is_empty() { &self.path } else { &self.name }
    }
}

impl DataConfig {
    /// A mixture's entries: each with a path and a positive weight, names unique, in place of
    /// `data.path` and with shards only.
    fn check_mixture(&self) -> Result<()> {
        if self.mixture.is_empty() {
            return Ok(());
        }
        if !self.path.is_empty() {
            bail!(
                "data.path = {} and data.mixture are both set; a run reads data.path or the mixture's datasets, not both",
                self.path
            );
        }
        if self.source != DataSource::Shards {
            bail!("data.mixture is set but data.source is not \"shards\"; set data.source = \"shards\"");
        }
        for (i, m) in self.mixture.iter().enumerate() {
            if m.path.is_empty() {
                bail!("data.mixture[{i}].path is empty; name a directory written by `engine data prepare`");
            }
            if !positive_number(m.weight) {
                bail!("data.mixture[{i}].weight = {} ({}) must be a positive number", m.weight, m.name());
            }
            if let Some(j) = self.mixture[..i].iter().position(|o| o.name() == m.name()) {
                bail!(
                    "data.mixture[{j}] and data.mixture[{i}] are both named {}; give one a distinct `name`",
                    m.name()
                );
            }
        }
        Ok(())
    }
}
