//! `engine data prepare`: text and JSONL files → token shards.
//!
//! Inputs are read in the order given (a directory: its files, recursively, in name order).
//! A `.jsonl` file holds one JSON object per line whose `text` field is a document (blank lines
//! are skipped); any other file is plain text: one document, or, with a separator line, the
//! documents between separator lines. Every document is tokenized without special tokens and
//! closed by the end-of-sequence token. Documents are tokenized in parallel (rayon) in batches
//! and written in input order, so the shards do not depend on the number of threads.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::digest::sha256_file;
use anyhow::{Context, Result, anyhow, bail};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::shard::{self, ShardWriter};
use super::tokenizer::TextTokenizer;
use crate::fsutil::write_atomic;

/// Text gathered before a batch is tokenized in parallel.
const BATCH_BYTES: usize = 8 << 20;

/// What to prepare.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// `tokenizer.json` or SentencePiece `.model` file (or a directory holding one).
    pub tokenizer: PathBuf,
    /// Input files and directories.
    pub inputs: Vec<PathBuf>,
    /// Output directory (created; must not hold shards already).
    pub out: PathBuf,
    /// The end-of-sequence token's text, overriding the tokenizer's own.
    pub eos: Option<String>,
    /// In plain-text files, a line equal to this separates documents.
    pub separator: Option<String>,
    /// A new shard is started once the current one holds this many tokens.
    pub shard_tokens: u64,
    /// The recipe's `model.vocab_size` and the recipe's name: the tokenizer must fit in it.
    pub max_vocab: Option<(usize, String)>,
    /// Show a progress bar.
    pub progress: bool,
}

/// What was prepared; also written as `prepare.json` in the output directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrepareReport {
    /// The tokenizer file.
    pub tokenizer: String,
    /// Its SHA-256.
    pub tokenizer_sha256: String,
    /// Its vocabulary size.
    pub vocab_size: usize,
    /// The end-of-sequence token closing every document.
    pub eos_token: String,
    /// Its id.
    pub eos_id: u32,
    /// Bytes per token in the shards.
    pub token_bytes: u32,
    /// Documents written.
    pub documents: u64,
    /// Tokens written (end-of-sequence tokens included).
    pub tokens: u64,
    /// Bytes of input read.
    pub input_bytes: u64,
    /// The input files, in the order read.
    pub inputs: Vec<String>,
    /// The shard files (names in the output directory), in order.
    pub shards: Vec<String>,
    /// Wall time.
    pub seconds: f64,
}

/// Runs a preparation; on error, removes the shards it wrote.
pub fn prepare(opts: &PrepareOptions) -> Result<PrepareReport> {
    let mut tokenizer = TextTokenizer::open(&opts.tokenizer)?;
    if let Some(eos) = &opts.eos {
        tokenizer.set_eos(eos)?;
    }
    let eos = tokenizer.eos_id()?;
    if let Some((vocab, recipe)) = &opts.max_vocab
        && tokenizer.vocab_size > *vocab
    {
        bail!(
            "tokenizer {} has a vocabulary of {} tokens, more than model.vocab_size = {vocab} of recipe `{recipe}`",
            tokenizer.path.display(),
            tokenizer.vocab_size
        );
    }
    if opts.shard_tokens == 0 {
        bail!("--shard-tokens must be at least 1");
    }
    let files = input_files(&opts.inputs)?;
    let created = !opts.out.exists();
    check_out_dir(&opts.out)?;

    let mut written: Vec<PathBuf> = Vec::new();
    let result = run(opts, &tokenizer, eos, &files, &mut written);
    if result.is_err() {
        for path in &written {
            let _ = std::fs::remove_file(path);
        }
        if created {
            let _ = std::fs::remove_dir(&opts.out);
        }
    }
    result
}

fn run(
    opts: &PrepareOptions,
    tokenizer: &TextTokenizer,
    eos: u32,
    files: &[PathBuf],
    written: &mut Vec<PathBuf>,
) -> Result<PrepareReport> {
    let start = Instant::now();
    let total_bytes: u64 = files.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum();
    let bar = opts.progress.then(|| {
        let bar = indicatif::ProgressBar::new(total_bytes);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40.cyan/blue} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}  {msg}",
            )
            .expect("valid template"),
        );
        bar
    });

    let mut shards =
        Shards { out: opts.out.clone(), vocab: tokenizer.vocab_size, eos, current: None, names: Vec::new() };
    let (mut documents, mut tokens) = (0u64, 0u64);
    for file in files {
        let mut flush = |batch: Vec<String>| -> Result<()> {
            let encoded: Vec<Vec<u32>> = batch
                .par_iter()
                .map(|doc| {
                    let mut ids = tokenizer.encode(doc)?;
                    ids.push(eos);
                    Ok(ids)
                })
                .collect::<Result<_>>()
                .with_context(|| file.display().to_string())?;
            for ids in &encoded {
                let w = shards.writer(written)?;
                w.push_document(ids)?;
                documents += 1;
                tokens += ids.len() as u64;
                if w.tokens() >= opts.shard_tokens {
                    shards.close()?;
                }
            }
            if let Some(bar) = &bar {
                bar.set_message(format!("{documents} documents, {tokens} tokens"));
            }
            Ok(())
        };
        read_documents(file, opts.separator.as_deref(), &mut flush, &mut |n| {
            if let Some(bar) = &bar {
                bar.inc(n);
            }
        })?;
    }
    shards.close()?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if documents == 0 {
        bail!("the inputs hold no documents");
    }
    let report = PrepareReport {
        tokenizer: tokenizer.path.display().to_string(),
        tokenizer_sha256: sha256_file(&tokenizer.path)?,
        vocab_size: tokenizer.vocab_size,
        eos_token: tokenizer.eos.as_ref().map(|(t, _)| t.clone()).unwrap_or_default(),
        eos_id: eos,
        token_bytes: shard::token_bytes_for(tokenizer.vocab_size),
        documents,
        tokens,
        input_bytes: total_bytes,
        inputs: files.iter().map(|f| f.display().to_string()).collect(),
        shards: shards.names,
        seconds: start.elapsed().as_secs_f64(),
    };
    let manifest = opts.out.join(shard::MANIFEST);
    write_atomic(&manifest, serde_json::to_string_pretty(&report)?.as_bytes())?;
    written.push(manifest);
    Ok(report)
}

/// The shard being written and those finished.
struct Shards {
    out: PathBuf,
    vocab: usize,
    eos: u32,
    current: Option<ShardWriter>,
    names: Vec<String>,
}

impl Shards {
    fn writer(&mut self, written: &mut Vec<PathBuf>) -> Result<&mut ShardWriter> {
        if self.current.is_none() {
            let name = format!("shard-{:05}.{}", self.names.len(), shard::EXTENSION);
            let path = self.out.join(&name);
            self.current = Some(ShardWriter::create(&path, self.vocab, self.eos)?);
            written.push(path);
            self.names.push(name);
        }
        Ok(self.current.as_mut().expect("just created"))
    }

    fn close(&mut self) -> Result<()> {
        if let Some(w) = self.current.take() {
            w.finish()?;
        }
        Ok(())
    }
}

/// The files the inputs name: files as given, directories walked recursively in name order.
pub fn input_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("cannot list {}", dir.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()?;
        entries.sort();
        for e in entries {
            if e.is_dir() {
                walk(&e, out)?;
            } else if e.file_name().is_some_and(|n| !n.to_string_lossy().starts_with('.')) {
                out.push(e);
            }
        }
        Ok(())
    }
    if inputs.is_empty() {
        bail!("no --input given");
    }
    let mut files = Vec::new();
    for input in inputs {
        let meta = std::fs::metadata(input).map_err(|e| anyhow!("input {}: {e}", input.display()))?;
        if meta.is_dir() {
            walk(input, &mut files)?;
        } else {
            files.push(input.clone());
        }
    }
    if files.is_empty() {
        bail!("the inputs hold no files");
    }
    Ok(files)
}

/// An output directory must hold no complete preparation. What an interrupted one left (shards
/// without `prepare.json`, temporary shard files) is removed, with a line saying so.
fn check_out_dir(out: &Path) -> Result<()> {
    if out.exists() {
        let entries: Vec<_> = std::fs::read_dir(out)
            .with_context(|| format!("--out {}", out.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let foreign_shard =
            |p: &PathBuf| p.extension().is_some_and(|x| x == shard::EXTENSION) && !name(p).starts_with("shard-");
        if entries.iter().any(|p| name(p) == shard::MANIFEST || foreign_shard(p)) {
            bail!("--out {} already holds shards; choose another directory or remove them", out.display());
        }
        let leftovers: Vec<&PathBuf> = entries
            .iter()
            .filter(|p| {
                let n = name(p);
                let ours = n.starts_with("shard-") || n.starts_with(".shard-");
                ours && (p.extension().is_some_and(|x| x == shard::EXTENSION) || n.contains(".tmp-"))
            })
            .collect();
        for path in &leftovers {
            std::fs::remove_file(path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
        if !leftovers.is_empty() {
            eprintln!(
                "removed {} files left in {} by an interrupted `engine data prepare`",
                leftovers.len(),
                out.display()
            );
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))
}

/// Reads one input file's documents, handing them to `flush` in batches of about
/// [`BATCH_BYTES`], and the bytes read to `progress`. Errors name the file and line.
fn read_documents(
    path: &Path,
    separator: Option<&str>,
    flush: &mut dyn FnMut(Vec<String>) -> Result<()>,
    progress: &mut dyn FnMut(u64),
) -> Result<()> {
    #[derive(Deserialize)]
    struct Record {
        text: Option<String>,
    }
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let (mut line, mut number) = (Vec::new(), 0usize);
    let (mut batch, mut batch_bytes) = (Vec::new(), 0usize);
    let mut doc = String::new();
    let mut push = |doc: String, batch: &mut Vec<String>, batch_bytes: &mut usize| -> Result<()> {
        if doc.is_empty() {
            return Ok(());
        }
        *batch_bytes += doc.len();
        batch.push(doc);
        if *batch_bytes >= BATCH_BYTES {
            *batch_bytes = 0;
            flush(std::mem::take(batch))?;
        }
        Ok(())
    };
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line).with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        number += 1;
        progress(n as u64);
        let text = std::str::from_utf8(&line).map_err(|e| {
            anyhow!("{}:{number}: not valid UTF-8 (at byte {} of the line)", path.display(), e.valid_up_to() + 1)
        })?;
        if jsonl {
            if text.trim().is_empty() {
                continue;
            }
            let record: Record = serde_json::from_str(text.trim_end_matches(['\n', '\r']))
                .map_err(|e| anyhow!("{}:{number}: {e}", path.display()))?;
            let text =
                record.text.ok_or_else(|| anyhow!("{}:{number}: the object has no `text` field", path.display()))?;
            push(text, &mut batch, &mut batch_bytes)?;
        } else if separator.is_some_and(|s| text.trim_end_matches(['\n', '\r']) == s) {
            push(std::mem::take(&mut doc), &mut batch, &mut batch_bytes)?;
        } else {
            doc.push_str(text);
        }
    }
    push(doc, &mut batch, &mut batch_bytes)?;
    if !batch.is_empty() {
        flush(batch)?;
    }
    Ok(())
}
