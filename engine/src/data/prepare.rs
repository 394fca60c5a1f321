//! `engine data prepare`: corpora as they are published → token shards.
//!
//! Inputs are read in the order given (a directory: its files, recursively, in name order,
//! skipping the outputs of earlier preparations). [`readers`] reads each file's documents:
//! JSON lines (`.jsonl`, `.json`), Parquet and Arrow columns, plain text, through gzip, zstd or
//! bzip2 by name. Every document is tokenized without special tokens and closed by the
//! end-of-sequence token.
//!
//! Work is a pipeline. Reader threads take the files in order, each file's documents going, in
//! batches of about [`BATCH_BYTES`], through a channel of its own that holds at most two
//! batches; the main thread takes the files' channels in input order, tokenizes each batch in
//! parallel (rayon) and writes it. So files are read and decompressed in parallel with each other
//! and with tokenization, the shards do not depend on the number of threads, and memory holds a
//! few batches whatever the corpus's size. A long document comes in parts cut where its tokens do
//! not change ([`readers::seam`]), so no tokenizer call sees more than about
//! [`readers::PART_BYTES`] of text: the tokenizers crate takes about 200 times its input in
//! memory while it works, which made one 90 MB document take 15 GB.
//!
//! The output directory is locked (`DIR/.lock`, as run directories are) for the preparation's
//! life: a second preparation into it is refused instead of taking the first one's shards for an
//! interrupted preparation's leftovers.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Instant;

use crate::digest::sha256_file;
use anyhow::{Context, Result, anyhow, bail};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::readers::{self, Part, ReadOptions};
use super::shard::{self, ShardWriter};
use super::tokenizer::TextTokenizer;
use crate::fsutil::{DirLock, write_atomic};

/// Text gathered before a batch is tokenized in parallel.
const BATCH_BYTES: usize = 8 << 20;

/// Files read at once, at most.
const READERS: usize = 4;

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
    /// The JSON field, or Parquet or Arrow column, that holds the text (`text`).
    pub text_field: String,
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
    /// Bytes of input read (as stored: compressed files count their compressed size).
    pub input_bytes: u64,
    /// Bytes of text tokenized (decompressed).
    #[serde(default)]
    pub text_bytes: u64,
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
    check_out_outside_inputs(&opts.out, &opts.inputs)?;
    let files = input_files(&opts.inputs)?;
    let created = !opts.out.exists();
    std::fs::create_dir_all(&opts.out).with_context(|| format!("cannot create {}", opts.out.display()))?;
    let lock = DirLock::acquire(
        &opts.out,
        "--out",
        "wait for its `engine data prepare` to finish, or choose another directory",
    );
    let lock = match lock {
        Ok(lock) => lock,
        Err(e) => {
            if created {
                let _ = std::fs::remove_dir(&opts.out);
            }
            return Err(e);
        }
    };

    let mut written: Vec<PathBuf> = Vec::new();
    let result = check_out_dir(&opts.out).and_then(|()| run(opts, &tokenizer, eos, &files, &mut written));
    if result.is_err() {
        for path in &written {
            let _ = std::fs::remove_file(path);
        }
        if created {
            let _ = std::fs::remove_file(opts.out.join(".lock"));
            let _ = std::fs::remove_dir(&opts.out);
        }
    }
    drop(lock);
    result
}

/// One file's batches of document parts, or the error that ended its reading.
type Batch = Result<Vec<Part>>;

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
    let read_opts = ReadOptions {
        separator: opts.separator.clone(),
        text_field: opts.text_field.clone(),
        part_bytes: seams_keep_tokens(tokenizer)?.then_some(readers::PART_BYTES),
    };
    let progress = |n: u64| {
        if let Some(bar) = &bar {
            bar.inc(n);
        }
    };

    let mut shards =
        Shards { out: opts.out.clone(), vocab: tokenizer.vocab_size, eos, current: None, names: Vec::new() };
    let (mut documents, mut tokens, mut text_bytes) = (0u64, 0u64, 0u64);
    // Whether the document whose parts are coming has any text (a document of whitespace alone
    // may have no tokens, yet is a document). Its tokens are written part by part, never held
    // whole: the shard is not closed before the document ends, so it stays in one shard.
    let mut has_text = false;
    let (senders, receivers): (Vec<SyncSender<Batch>>, Vec<Receiver<Batch>>) =
        files.iter().map(|_| sync_channel::<Batch>(2)).unzip();
    let senders: Vec<std::sync::Mutex<Option<SyncSender<Batch>>>> =
        senders.into_iter().map(|s| std::sync::Mutex::new(Some(s))).collect();
    let next_file = AtomicU64::new(0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let readers = READERS.min(files.len()).min(rayon::current_num_threads().max(1)).max(1);
    std::thread::scope(|scope| -> Result<()> {
        for _ in 0..readers {
            scope.spawn(|| {
                loop {
                    let i = next_file.fetch_add(1, Ordering::Relaxed) as usize;
                    if i >= files.len() || stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let Some(tx) = senders[i].lock().expect("not poisoned").take() else { return };
                    let (mut batch, mut bytes) = (Vec::new(), 0usize);
                    let result = readers::read_file(&files[i], &read_opts, &progress, &mut |part| {
                        bytes += part.text.len();
                        batch.push(part);
                        if bytes >= BATCH_BYTES {
                            bytes = 0;
                            tx.send(Ok(std::mem::take(&mut batch))).map_err(|_| anyhow!("stopped"))?;
                        }
                        Ok(())
                    });
                    let last = match result {
                        Ok(()) => Ok(batch),
                        Err(e) => Err(e),
                    };
                    if tx.send(last).is_err() {
                        return; // the writer stopped: an error elsewhere
                    }
                }
            });
        }
        let started = Instant::now();
        let result = (|| -> Result<()> {
            for (file, rx) in files.iter().zip(&receivers) {
                loop {
                    // A file's channel closes after its last batch.
                    let Ok(batch) = rx.recv() else { break };
                    let batch = batch?;
                    let encoded: Vec<Vec<u32>> = batch
                        .par_iter()
                        .map(|part| tokenizer.encode(&part.text))
                        .collect::<Result<_>>()
                        .with_context(|| file.display().to_string())?;
                    for (part, ids) in batch.iter().zip(encoded) {
                        text_bytes += part.text.len() as u64;
                        has_text |= !part.text.is_empty();
                        if !ids.is_empty() {
                            shards.writer(written)?.push_tokens(&ids)?;
                            tokens += ids.len() as u64;
                        }
                        if !part.last {
                            continue;
                        }
                        if !std::mem::take(&mut has_text) {
                            continue; // an empty document is no document (and wrote no token)
                        }
                        let w = shards.writer(written)?;
                        w.push_tokens(&[eos])?;
                        w.end_document();
                        documents += 1;
                        tokens += 1;
                        if w.tokens() >= opts.shard_tokens {
                            shards.close()?;
                        }
                    }
                    if let Some(bar) = &bar {
                        let s = started.elapsed().as_secs_f64().max(1e-9);
                        bar.set_message(format!(
                            "{documents} documents ({:.0}/s), {tokens} tokens ({:.0}/s)",
                            documents as f64 / s,
                            tokens as f64 / s
                        ));
                    }
                }
            }
            Ok(())
        })();
        // Stop the readers (after an error: their channels close) before leaving the scope.
        stop.store(true, Ordering::Relaxed);
        drop(receivers);
        result
    })?;
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
        text_bytes,
        inputs: files.iter().map(|f| f.display().to_string()).collect(),
        shards: shards.names,
        seconds: start.elapsed().as_secs_f64(),
    };
    let manifest = opts.out.join(shard::MANIFEST);
    write_atomic(&manifest, serde_json::to_string_pretty(&report)?.as_bytes())?;
    written.push(manifest);
    Ok(report)
}

/// Whether cutting a document at [`readers::seam`]s keeps its tokens with this tokenizer,
/// tried on a probe text at every seam: true for tokenizers that split words at whitespace before
/// anything else (byte-level BPE); false for SentencePiece models (a piece starts with its
/// dummy prefix, and whole texts are cut by the Viterbi search's score resets) and tokenizer.json
/// files that normalize the whole text first (Llama 2's), whose documents are tokenized whole.
pub fn seams_keep_tokens(tokenizer: &TextTokenizer) -> Result<bool> {
    if tokenizer.kind == "sentencepiece" {
        return Ok(false); // its Viterbi search spans the whole text: a probe cannot show it safe
    }
    const PROBE: &str = "Hello, world.\nIt's 2024 now; fine\tok: x-y (z) \"q\" \u{e9}t\u{e9} 42.5%\nend.\nMIXED case\n\n  two  spaces\nlast";
    let whole = tokenizer.encode(PROBE)?;
    for at in (1..PROBE.len()).filter(|&i| readers::is_seam(PROBE, i)) {
        let mut parts = tokenizer.encode(&PROBE[..at])?;
        parts.extend(tokenizer.encode(&PROBE[at..])?);
        if parts != whole {
            return Ok(false);
        }
    }
    Ok(true)
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

/// The files the inputs name: files as given, directories walked recursively in name order,
/// without hidden files and without what preparations write (a directory holding a
/// `prepare.json` is skipped whole, and `*.tok` shards anywhere).
pub fn input_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("cannot list {}", dir.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()?;
        entries.sort();
        for e in entries {
            if e.file_name().is_none_or(|n| n.to_string_lossy().starts_with('.')) {
                continue;
            }
            if e.is_dir() {
                if !e.join(shard::MANIFEST).exists() {
                    walk(&e, out)?;
                }
            } else if e.extension().is_none_or(|x| x != shard::EXTENSION) {
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

/// Refuses an output directory inside (or equal to) an input directory: its shards would be
/// read as text by the next preparation of that input.
fn check_out_outside_inputs(out: &Path, inputs: &[PathBuf]) -> Result<()> {
    // The output may not exist yet: resolve its nearest existing ancestor.
    let absolute = std::path::absolute(out).with_context(|| format!("--out {}", out.display()))?;
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    while !existing.exists() {
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                existing = parent;
            }
            _ => break,
        }
    }
    let mut resolved = existing.canonicalize().unwrap_or_else(|_| existing.to_path_buf());
    resolved.extend(rest.iter().rev());
    for input in inputs {
        let Ok(dir) = input.canonicalize() else { continue };
        if dir.is_dir() && resolved.starts_with(&dir) {
            bail!(
                "--out {} is inside --input {}: a later preparation of it would read these shards as text; choose an --out outside it",
                out.display(),
                input.display()
            );
        }
    }
    Ok(())
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
            crate::say!(
                "removed {} files left in {} by an interrupted `engine data prepare`",
                leftovers.len(),
                out.display()
            );
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))
}
