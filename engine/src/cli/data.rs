//! `engine data prepare`: tokenize text and JSONL files into token shards.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};
use engine::data::prepare::{PrepareOptions, prepare};

#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenize text, JSON lines, Parquet and Arrow files into token shards (docs/data.md).
    Prepare(PrepareArgs),
}

#[derive(Args)]
pub struct PrepareArgs {
    /// A Hugging Face tokenizer.json, a SentencePiece .model file, or a directory holding one.
    #[arg(long, value_name = "FILE")]
    tokenizer: PathBuf,
    /// Input files or directories (repeatable; directories are read recursively in name order).
    /// `.jsonl` and `.json` files hold one JSON object per line, `.parquet` and `.arrow` files a
    /// column of strings; other files are text. `.gz`, `.zst` and `.bz2` are decompressed.
    #[arg(long = "input", value_name = "PATH", required = true, num_args = 1..)]
    inputs: Vec<PathBuf>,
    /// Directory for the shards and prepare.json (created).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The end-of-sequence token closing every document [default: the tokenizer's].
    #[arg(long, value_name = "TOKEN")]
    eos: Option<String>,
    /// In text files, a line equal to LINE separates documents [default: one document per file].
    /// LINE may start with `-` (`--separator ---`).
    #[arg(long, value_name = "LINE", allow_hyphen_values = true)]
    separator: Option<String>,
    /// The JSON field, or Parquet or Arrow column, holding each document's text.
    #[arg(long, value_name = "NAME", default_value = "text")]
    text_field: String,
    /// Start a new shard once the current one holds this many tokens.
    #[arg(long, value_name = "N", default_value_t = 1 << 28)]
    shard_tokens: u64,
    /// Check that the tokenizer fits this recipe's model.vocab_size.
    #[arg(long, value_name = "NAME|FILE")]
    recipe: Option<String>,
}

pub fn run(cmd: DataCommand) -> Result<()> {
    let DataCommand::Prepare(args) = cmd;
    crate::PREPARING_DATA.store(true, std::sync::atomic::Ordering::Relaxed);
    let max_vocab = match &args.recipe {
        Some(recipe) => {
            let r = super::RecipeArgs { recipe: recipe.clone(), set: Vec::new() }.resolve(&[])?;
            Some((r.config.model.vocab_size, r.name))
        }
        None => None,
    };
    let opts = PrepareOptions {
        tokenizer: args.tokenizer,
        inputs: args.inputs,
        out: args.out.clone(),
        eos: args.eos,
        separator: args.separator,
        text_field: args.text_field,
        shard_tokens: args.shard_tokens,
        max_vocab,
        progress: std::io::stderr().is_terminal(),
    };
    let r = prepare(&opts)?;
    println!(
        "prepared {} documents, {} tokens in {} shard(s) of {}-bit tokens (vocabulary {}, end of sequence {:?} = {}) from {:.1} MB ({:.1} MB of text) in {:.2} s: {:.0} tokens/s, {:.0} documents/s, {:.1} MB/s -> {}",
        r.documents,
        r.tokens,
        r.shards.len(),
        8 * r.token_bytes,
        r.vocab_size,
        r.eos_token,
        r.eos_id,
        r.input_bytes as f64 / 1e6,
        r.text_bytes as f64 / 1e6,
        r.seconds,
        r.tokens as f64 / r.seconds,
        r.documents as f64 / r.seconds,
        r.input_bytes as f64 / 1e6 / r.seconds,
        args.out.display()
    );
    Ok(())
}
