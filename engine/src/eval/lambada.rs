//! LAMBADA: predict the last word of a passage from the rest (the zero-shot evaluation of the
//! Pax recipes).
//!
//! The data is JSON lines with a `text` field, as in OpenAI's release of the test set
//! (`lambada_test.jsonl`). The last word is what follows the passage's last space. The context's
//! tokens are those of the text before that space; the target is what the tokens of the whole
//! passage add after their longest common prefix with the context's (so a tokenizer that merges
//! across the boundary is handled). An example counts as correct when greedy decoding from the
//! context yields exactly the target tokens, which, with teacher forcing, is: at every target
//! position the most likely token is the target token. Tokens the tokenizer puts before a text
//! (a beginning-of-sequence token) are put before every passage.

use std::io::BufRead;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use super::Loaded;
use crate::backend::Backend;
use crate::backend::cpu::Cpu;
use crate::data::tokenizer::TextTokenizer;

/// Passages evaluated together.
const BATCH: usize = 8;

/// What `engine eval --task lambada` prints.
#[derive(Debug, Clone, Serialize)]
pub struct LambadaResult {
    /// `"lambada"`.
    pub task: &'static str,
    /// Passages evaluated.
    pub examples: usize,
    /// Passages whose last word was predicted exactly.
    pub correct: usize,
    /// `correct / examples`.
    pub accuracy: f64,
    /// Whether each passage was predicted correctly, in file order.
    pub per_example: Vec<bool>,
}

/// One passage as tokens: the input sequence and where the target starts in it.
struct Example {
    tokens: Vec<u32>,
    target_start: usize,
}

/// Reads the passages of `path` and turns them into examples; errors name the line.
fn examples(path: &Path, tokenizer: &TextTokenizer, max_len: usize) -> Result<Vec<Example>> {
    #[derive(Deserialize)]
    struct Record {
        text: Option<String>,
    }
    let p = path.display();
    let file = std::fs::File::open(path).with_context(|| format!("cannot open {p}"))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).split(b'\n').enumerate() {
        let n = i + 1;
        let line = line.with_context(|| format!("cannot read {p}"))?;
        let line = std::str::from_utf8(&line).map_err(|_| anyhow!("{p}:{n}: not valid UTF-8"))?;
        if line.trim().is_empty() {
            continue;
        }
        let record: Record = serde_json::from_str(line).map_err(|e| anyhow!("{p}:{n}: {e}"))?;
        let text = record.text.ok_or_else(|| anyhow!("{p}:{n}: the object has no `text` field"))?;
        let text = text.trim_end();
        let cut = text.rfind(' ').ok_or_else(|| anyhow!("{p}:{n}: the text has no space, so no last word"))?;
        if text[cut + 1..].chars().all(invisible) {
            bail!("{p}:{n}: the last word (after the last space) shows no character, so there is nothing to predict");
        }
        let mut context = tokenizer.prefix.clone();
        context.extend(tokenizer.encode(&text[..cut])?);
        let mut full = tokenizer.prefix.clone();
        full.extend(tokenizer.encode(text)?);
        let common = context.iter().zip(&full).take_while(|(a, b)| a == b).count();
        if common == full.len() || common == 0 {
            bail!("{p}:{n}: cannot tell the last word's tokens apart from the context's");
        }
        // Keep the end of passages longer than the model's context.
        let drop = full.len().saturating_sub(max_len);
        if drop >= common {
            bail!("{p}:{n}: the last word alone is longer than the model's {max_len} positions");
        }
        out.push(Example { target_start: common - drop, tokens: full[drop..].to_vec() });
    }
    if out.is_empty() {
        bail!("{p} holds no passages");
    }
    Ok(out)
}

/// Whether a character shows nothing: whitespace, a control character, or an invisible format
/// character (zero-width space, joiners, word joiner, byte-order mark, soft hyphen). A last word
/// made only of them is empty: scoring it would count a passage nobody can predict.
fn invisible(c: char) -> bool {
    c.is_whitespace()
        || c.is_control()
        || matches!(c, '\u{200B}'..='\u{200D}' | '\u{2060}' | '\u{FEFF}' | '\u{00AD}' | '\u{180E}')
}

/// Last-word accuracy of `m` on the passages of `data`.
pub fn lambada(m: &Loaded, tokenizer: &TextTokenizer, data: &Path) -> Result<LambadaResult> {
    let c = m.config();
    if tokenizer.vocab_size > c.vocab_size {
        bail!(
            "tokenizer {} has a vocabulary of {} tokens, more than the model's {}",
            tokenizer.path.display(),
            tokenizer.vocab_size,
            c.vocab_size
        );
    }
    let examples = examples(data, tokenizer, c.max_seq_len)?;
    let seq = examples.iter().map(|e| e.tokens.len()).max().expect("at least one");
    let batch = BATCH.min(examples.len());
    let mut cpu = Cpu::new();
    let plan = m.model.plan(&mut cpu, batch, seq);
    cpu.upload(plan.params, &m.params);
    let v = c.vocab_size;
    let mut logits = vec![0f32; batch * seq * v];
    let mut per_example = Vec::with_capacity(examples.len());
    for group in examples.chunks(batch) {
        // Right-padded with token 0: attention is causal, so padding never reaches earlier positions.
        let mut tokens = vec![0u32; batch * seq];
        for (r, e) in group.iter().enumerate() {
            tokens[r * seq..r * seq + e.tokens.len()].copy_from_slice(&e.tokens);
        }
        cpu.upload_idx(plan.tokens, &tokens);
        cpu.upload_idx(plan.targets, &vec![0; batch * seq]);
        m.model.forward(&mut cpu, &plan, None, &mut crate::model::Alone);
        cpu.download(plan.logits, &mut logits);
        for (r, e) in group.iter().enumerate() {
            let correct = (e.target_start..e.tokens.len()).all(|i| {
                let row = &logits[(r * seq + i - 1) * v..(r * seq + i) * v];
                argmax(row) == e.tokens[i] as usize
            });
            per_example.push(correct);
        }
    }
    let correct = per_example.iter().filter(|&&c| c).count();
    Ok(LambadaResult {
        task: "lambada",
        examples: per_example.len(),
        correct,
        accuracy: correct as f64 / per_example.len() as f64,
        per_example,
    })
}

/// Index of the largest value (the first of equal ones, as `torch.argmax`).
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}
