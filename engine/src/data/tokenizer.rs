//! Tokenizers: Hugging Face `tokenizer.json` files through the `tokenizers` crate, and
//! SentencePiece `.model` files through the engine's own encoder ([`super::sentencepiece`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};

use super::sentencepiece::{SpModel, SpTokenizer};

/// End-of-sequence tokens looked for, in this order, when a `tokenizer.json` comes without a
/// `tokenizer_config.json` naming one.
const EOS_CANDIDATES: [&str; 5] = ["</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|im_end|>"];

/// The tokenizer proper (one per tool run: its size does not matter).
#[allow(clippy::large_enum_variant)]
enum Inner {
    Json(tokenizers::Tokenizer),
    SentencePiece(SpTokenizer),
}

/// A tokenizer and the special tokens the engine needs.
pub struct TextTokenizer {
    inner: Inner,
    /// Where it was read from.
    pub path: PathBuf,
    /// `"tokenizer.json"` or `"sentencepiece"`.
    pub kind: &'static str,
    /// Largest id plus one, added tokens included.
    pub vocab_size: usize,
    /// The end-of-sequence token and its id, when known.
    pub eos: Option<(String, u32)>,
    /// Tokens the tokenizer puts before a text when asked for special tokens (e.g. BOS).
    pub prefix: Vec<u32>,
}

impl TextTokenizer {
    /// Opens a `tokenizer.json` (or any JSON tokenizer file) or a SentencePiece `.model` file;
    /// a directory means its `tokenizer.json`, else its `tokenizer.model`.
    pub fn open(path: &Path) -> Result<TextTokenizer> {
        let path = if path.is_dir() {
            ["tokenizer.json", "tokenizer.model"]
                .iter()
                .map(|n| path.join(n))
                .find(|p| p.exists())
                .ok_or_else(|| anyhow!("{} holds neither tokenizer.json nor tokenizer.model", path.display()))?
        } else {
            path.to_path_buf()
        };
        let bytes = std::fs::read(&path).with_context(|| format!("cannot read tokenizer {}", path.display()))?;
        let is_json = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        let mut t = if is_json {
            let inner = tokenizers::Tokenizer::from_bytes(&bytes)
                .map_err(|e| anyhow!("{} is not a valid tokenizer.json: {e}", path.display()))?;
            let eos = json_eos(&inner, &path);
            let vocab_size = inner.get_vocab(true).values().map(|&id| id as usize + 1).max().unwrap_or(0);
            let inner = Inner::Json(inner);
            TextTokenizer { inner, path: path.clone(), kind: "tokenizer.json", vocab_size, eos, prefix: Vec::new() }
        } else {
            let model = SpModel::parse(&bytes).with_context(|| {
                format!("{} is neither a tokenizer.json nor a SentencePiece .model file", path.display())
            })?;
            let inner = model.to_tokenizer().with_context(|| format!("{}", path.display()))?;
            let vocab_size = inner.vocab_size();
            let inner = Inner::SentencePiece(inner);
            TextTokenizer {
                inner,
                path: path.clone(),
                kind: "sentencepiece",
                vocab_size,
                eos: model.eos(),
                prefix: Vec::new(),
            }
        };
        t.prefix = t.special_prefix()?;
        Ok(t)
    }

    /// Replaces the end-of-sequence token by the one named `token`.
    pub fn set_eos(&mut self, token: &str) -> Result<()> {
        let id =
            self.token_id(token).ok_or_else(|| anyhow!("--eos {token}: no such token in {}", self.path.display()))?;
        self.eos = Some((token.to_owned(), id));
        Ok(())
    }

    /// The token ids of a text, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Json(t) => {
                let enc = t.encode_fast(text, false).map_err(|e| anyhow!("cannot tokenize: {e}"))?;
                Ok(enc.get_ids().to_vec())
            }
            Inner::SentencePiece(t) => t.encode(text),
        }
    }

    /// The id of a token, by its text.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Inner::Json(t) => t.token_to_id(token),
            Inner::SentencePiece(t) => t.token_id(token),
        }
    }

    /// The special tokens the tokenizer's post-processor puts before a text (such as a
    /// beginning-of-sequence token), found by encoding a probe with and without them.
    /// SentencePiece files carry no such rule: none.
    fn special_prefix(&self) -> Result<Vec<u32>> {
        let Inner::Json(t) = &self.inner else { return Ok(Vec::new()) };
        let probe = "a";
        let plain = self.encode(probe)?;
        let with = t.encode_fast(probe, true).map_err(|e| anyhow!("cannot tokenize: {e}"))?;
        let with = with.get_ids();
        match with.windows(plain.len().max(1)).position(|w| w == plain.as_slice()) {
            Some(at) if !plain.is_empty() => Ok(with[..at].to_vec()),
            _ => Ok(Vec::new()),
        }
    }

    /// The end-of-sequence id, or an error that says how to name one.
    pub fn eos_id(&self) -> Result<u32> {
        match &self.eos {
            Some((_, id)) => Ok(*id),
            None => bail!(
                "cannot tell the end-of-sequence token of {} (no tokenizer_config.json beside it names one, and none of {} exists); pass --eos TOKEN",
                self.path.display(),
                EOS_CANDIDATES.join(", ")
            ),
        }
    }
}

/// The end-of-sequence token of a `tokenizer.json`: the `eos_token` of a `tokenizer_config.json`
/// beside it, else the first of [`EOS_CANDIDATES`] the vocabulary has.
fn json_eos(t: &tokenizers::Tokenizer, path: &Path) -> Option<(String, u32)> {
    let config = path.with_file_name("tokenizer_config.json");
    let named = std::fs::read(&config)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| match &v["eos_token"] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_owned),
            _ => None,
        });
    named
        .into_iter()
        .chain(EOS_CANDIDATES.iter().map(|s| s.to_string()))
        .find_map(|name| t.token_to_id(&name).map(|id| (name, id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixtures of tests/fixtures/tokenizers: each tokenizer, and the ids the reference
    /// Python packages (`sentencepiece`, `tokenizers`) give the probe texts.
    fn fixtures() -> (PathBuf, serde_json::Value) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizers");
        let expected = serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        (dir, expected)
    }

    #[test]
    fn encodings_match_the_reference_libraries() {
        let (dir, expected) = fixtures();
        for name in ["spm-unigram.model", "spm-bpe.model", "spm-bpe-nfkc.model", "bytelevel-bpe.json"] {
            let t = TextTokenizer::open(&dir.join(name)).unwrap();
            let e = &expected[name];
            assert_eq!(t.vocab_size as u64, e["vocab_size"].as_u64().unwrap(), "{name}");
            assert_eq!(t.eos_id().unwrap() as u64, e["eos_id"].as_u64().unwrap(), "{name}");
            let mut wrong = Vec::new();
            for (text, ids) in e["texts"].as_array().unwrap().iter().zip(e["ids"].as_array().unwrap()) {
                let want: Vec<u32> = ids.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect();
                let got = t.encode(text.as_str().unwrap()).unwrap();
                if got != want {
                    wrong.push(format!("{text:?}: got {got:?}, want {want:?}"));
                }
            }
            assert!(wrong.is_empty(), "{name}:\n{}", wrong.join("\n"));
        }
    }

    #[test]
    fn special_tokens_are_found() {
        let (dir, expected) = fixtures();
        let t = TextTokenizer::open(&dir.join("bytelevel-bpe.json")).unwrap();
        assert_eq!(t.eos.as_ref().unwrap().0, "<|end_of_text|>");
        assert_eq!(t.prefix, [expected["bytelevel-bpe.json"]["bos_id"].as_u64().unwrap() as u32]);
        let sp = TextTokenizer::open(&dir.join("spm-bpe.model")).unwrap();
        assert_eq!((sp.eos.as_ref().unwrap().0.as_str(), sp.prefix.len()), ("</s>", 0));
        let mut other = TextTokenizer::open(&dir.join("spm-unigram.model")).unwrap();
        other.set_eos("<s>").unwrap();
        assert_eq!(other.eos_id().unwrap(), 1);
        assert!(other.set_eos("<nope>").unwrap_err().to_string().contains("no such token"));
    }
}
