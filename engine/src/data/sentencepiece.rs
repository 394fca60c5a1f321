//! SentencePiece `.model` files, read without the SentencePiece library: the few fields of the
//! `ModelProto` protobuf that decide how text is encoded, turned into the equivalent
//! `tokenizers` pipeline (normalizer + Unigram or BPE model), as transformers'
//! `convert_slow_tokenizer` does, but following SentencePiece's own rules where the two differ.
//!
//! What SentencePiece does to a text, and how it is reproduced:
//! - normalization: the precompiled character map (`Precompiled`), then, with
//!   `remove_extra_whitespaces`, leading and trailing spaces dropped and runs of spaces
//!   collapsed, then with `add_dummy_prefix` a space in front, and with `escape_whitespaces`
//!   every space written `▁` (U+2581);
//! - the model runs over the whole normalized text (no pre-tokenization): Unigram's Viterbi
//!   (the same optimized search), or BPE merging the adjacent pair whose merged piece scores
//!   highest (leftmost first), expressed as `tokenizers` merges ranked by that score;
//! - only normal and user-defined pieces can match text: control pieces (`<s>`, `</s>`), the
//!   unknown piece and byte pieces are never produced from text in SentencePiece, so they are
//!   renamed (Unigram) or given no merge (BPE) here; unknown characters become the unknown
//!   piece, consecutive ones fused into one, or their UTF-8 bytes with `byte_fallback`.
//!
//! The fixture test (`tests/fixtures/tokenizers/`) compares the result with encodings made by
//! the Python `sentencepiece` package.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::models::unigram::Unigram;
use tokenizers::normalizers::replace::ReplacePattern;
use tokenizers::normalizers::{Precompiled, Prepend, Replace, Sequence};
use tokenizers::{NormalizedString, Normalizer, NormalizerWrapper, Tokenizer};

/// The kind of a piece (`ModelProto.SentencePiece.Type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceType {
    /// A piece text can be cut into.
    Normal,
    /// The unknown piece.
    Unknown,
    /// A control symbol such as `<s>`: never produced from text.
    Control,
    /// Always cut out as one piece.
    UserDefined,
    /// A byte `<0xAB>` for `byte_fallback`.
    Byte,
    /// Not used.
    Unused,
}

/// One vocabulary entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// Its text.
    pub piece: String,
    /// Its score (log probability for Unigram, minus the merge rank for BPE).
    pub score: f32,
    /// Its kind.
    pub kind: PieceType,
}

/// The model algorithm (`TrainerSpec.model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelType {
    /// Unigram language model.
    Unigram,
    /// Byte-pair encoding.
    Bpe,
    /// Whitespace-delimited words (not supported).
    Word,
    /// Characters (not supported).
    Char,
}

/// The fields of a `.model` file that decide the encoding.
#[derive(Debug, Clone)]
pub struct SpModel {
    /// The vocabulary; a piece's index is its id.
    pub pieces: Vec<Piece>,
    /// Unigram or BPE.
    pub model_type: ModelType,
    /// Unknown characters become their UTF-8 bytes.
    pub byte_fallback: bool,
    /// Whitespace marks the end of a piece instead of its start (not supported).
    pub treat_whitespace_as_suffix: bool,
    /// `unk_id`, `bos_id`, `eos_id`, `pad_id` (-1 when absent).
    pub unk_id: i32,
    /// Beginning-of-sequence id.
    pub bos_id: i32,
    /// End-of-sequence id.
    pub eos_id: i32,
    /// Padding id.
    pub pad_id: i32,
    /// The normalization rule's name (e.g. `nmt_nfkc`, `identity`).
    pub normalizer_name: String,
    /// The compiled character map; empty means none.
    pub precompiled_charsmap: Vec<u8>,
    /// Prepend a space to the text.
    pub add_dummy_prefix: bool,
    /// Drop leading and trailing spaces, collapse runs of spaces.
    pub remove_extra_whitespaces: bool,
    /// Write spaces as `▁`.
    pub escape_whitespaces: bool,
}

/// A protobuf field: its number and value.
enum Field<'a> {
    Varint(u64),
    Fixed32(u32),
    Bytes(&'a [u8]),
}

/// Reads the fields of one protobuf message (wire format: varint keys, four wire types used).
fn fields(mut buf: &[u8]) -> Result<Vec<(u32, Field<'_>)>> {
    fn varint(buf: &mut &[u8]) -> Result<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = buf.split_first().ok_or_else(|| anyhow!("truncated varint"))?;
            *buf = rest;
            value |= ((byte & 0x7f) as u64) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        bail!("varint longer than 10 bytes")
    }
    let mut out = Vec::new();
    while !buf.is_empty() {
        let key = varint(&mut buf)?;
        let (number, wire) = ((key >> 3) as u32, key & 7);
        let field = match wire {
            0 => Field::Varint(varint(&mut buf)?),
            1 => {
                buf = buf.get(8..).ok_or_else(|| anyhow!("truncated 64-bit field {number}"))?;
                continue;
            }
            2 => {
                let len = varint(&mut buf)? as usize;
                let (bytes, rest) = (buf.get(..len).ok_or_else(|| anyhow!("truncated field {number}"))?, &buf[len..]);
                buf = rest;
                Field::Bytes(bytes)
            }
            5 => {
                let bytes = buf.get(..4).ok_or_else(|| anyhow!("truncated 32-bit field {number}"))?;
                buf = &buf[4..];
                Field::Fixed32(u32::from_le_bytes(bytes.try_into().expect("4 bytes")))
            }
            w => bail!("field {number} has wire type {w}, which this reader does not handle"),
        };
        out.push((number, field));
    }
    Ok(out)
}

fn text(bytes: &[u8], what: &str) -> Result<String> {
    String::from_utf8(bytes.to_vec()).map_err(|_| anyhow!("{what} is not valid UTF-8"))
}

impl SpModel {
    /// Parses a serialized `ModelProto`.
    pub fn parse(bytes: &[u8]) -> Result<SpModel> {
        let mut m = SpModel {
            pieces: Vec::new(),
            model_type: ModelType::Unigram,
            byte_fallback: false,
            treat_whitespace_as_suffix: false,
            unk_id: 0,
            bos_id: 1,
            eos_id: 2,
            pad_id: -1,
            normalizer_name: String::new(),
            precompiled_charsmap: Vec::new(),
            add_dummy_prefix: true,
            remove_extra_whitespaces: true,
            escape_whitespaces: true,
        };
        for (number, field) in fields(bytes)? {
            match (number, field) {
                (1, Field::Bytes(b)) => m.pieces.push(parse_piece(b, m.pieces.len())?),
                (2, Field::Bytes(b)) => {
                    for (n, f) in fields(b).context("trainer_spec")? {
                        match (n, f) {
                            (3, Field::Varint(v)) => {
                                m.model_type = match v {
                                    1 => ModelType::Unigram,
                                    2 => ModelType::Bpe,
                                    3 => ModelType::Word,
                                    4 => ModelType::Char,
                                    _ => bail!("unknown model_type {v}"),
                                }
                            }
                            (24, Field::Varint(v)) => m.treat_whitespace_as_suffix = v != 0,
                            (35, Field::Varint(v)) => m.byte_fallback = v != 0,
                            (40, Field::Varint(v)) => m.unk_id = v as i32,
                            (41, Field::Varint(v)) => m.bos_id = v as i32,
                            (42, Field::Varint(v)) => m.eos_id = v as i32,
                            (43, Field::Varint(v)) => m.pad_id = v as i32,
                            _ => {}
                        }
                    }
                }
                (3, Field::Bytes(b)) => {
                    for (n, f) in fields(b).context("normalizer_spec")? {
                        match (n, f) {
                            (1, Field::Bytes(s)) => m.normalizer_name = text(s, "normalizer name")?,
                            (2, Field::Bytes(s)) => m.precompiled_charsmap = s.to_vec(),
                            (3, Field::Varint(v)) => m.add_dummy_prefix = v != 0,
                            (4, Field::Varint(v)) => m.remove_extra_whitespaces = v != 0,
                            (5, Field::Varint(v)) => m.escape_whitespaces = v != 0,
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        if m.pieces.is_empty() {
            bail!("no pieces: not a SentencePiece model");
        }
        Ok(m)
    }

    /// Reads a `.model` file.
    pub fn open(path: &Path) -> Result<SpModel> {
        let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        SpModel::parse(&bytes).with_context(|| format!("{} is not a SentencePiece model", path.display()))
    }

    /// The id of a piece of the given kind, by its text.
    fn id_of(&self, id: i32) -> Option<u32> {
        (id >= 0 && (id as usize) < self.pieces.len()).then_some(id as u32)
    }

    /// The end-of-sequence piece: its text and id.
    pub fn eos(&self) -> Option<(String, u32)> {
        self.id_of(self.eos_id).map(|id| (self.pieces[id as usize].piece.clone(), id))
    }

    /// The beginning-of-sequence piece: its text and id.
    pub fn bos(&self) -> Option<(String, u32)> {
        self.id_of(self.bos_id).map(|id| (self.pieces[id as usize].piece.clone(), id))
    }

    /// The `tokenizers` pipeline that encodes text as SentencePiece does: the normalizer and
    /// the model separately, since user-defined pieces are cut out of the normalized text
    /// between the two ([`SpTokenizer`]).
    pub fn to_tokenizer(&self) -> Result<SpTokenizer> {
        if self.treat_whitespace_as_suffix {
            bail!("treat_whitespace_as_suffix models are not supported");
        }
        let unk = self
            .pieces
            .iter()
            .position(|p| p.kind == PieceType::Unknown)
            .ok_or_else(|| anyhow!("the model has no unknown piece"))?;
        let model = match self.model_type {
            ModelType::Unigram => Tokenizer::new(self.unigram(unk)?),
            ModelType::Bpe => Tokenizer::new(self.bpe(unk)?),
            other => bail!("{other:?} SentencePiece models are not supported (Unigram and BPE are)"),
        };
        let mut user: Vec<(String, u32)> = (self.pieces.iter().enumerate())
            .filter(|(_, p)| p.kind == PieceType::UserDefined)
            .map(|(id, p)| (p.piece.clone(), id as u32))
            .collect();
        // Longest first: SentencePiece's prefix matcher takes the longest symbol that matches.
        user.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
        let names = (self.pieces.iter().enumerate()).map(|(id, p)| (p.piece.clone(), id as u32)).collect();
        Ok(SpTokenizer { normalizer: self.normalizer()?, model, user, names })
    }

    fn normalizer(&self) -> Result<NormalizerWrapper> {
        let regex = |pattern: &str, content: &str| -> Result<NormalizerWrapper> {
            Ok(Replace::new(ReplacePattern::Regex(pattern.into()), content).map_err(|e| anyhow!("{e}"))?.into())
        };
        let mut steps: Vec<NormalizerWrapper> = Vec::new();
        if !self.precompiled_charsmap.is_empty() {
            let p = Precompiled::from(&self.precompiled_charsmap)
                .map_err(|e| anyhow!("precompiled_charsmap of rule `{}`: {e}", self.normalizer_name))?;
            steps.push(p.into());
        }
        if self.remove_extra_whitespaces {
            // Only U+0020 counts as whitespace here, as in SentencePiece's normalizer.
            steps.push(regex("^ +", "")?);
            steps.push(regex(" +$", "")?);
            steps.push(regex(" {2,}", " ")?);
        }
        let space = if self.escape_whitespaces { "\u{2581}" } else { " " };
        if self.add_dummy_prefix {
            steps.push(Prepend::new(space.into()).into());
        }
        if self.escape_whitespaces {
            steps.push(Replace::new(" ", "\u{2581}").map_err(|e| anyhow!("{e}"))?.into());
        }
        Ok(Sequence::new(steps).into())
    }

    /// The text a piece is given in the `tokenizers` vocabulary: its own for pieces that can
    /// match text (and bytes, which byte fallback looks up by name), otherwise a name no text
    /// contains, so that `tokenizers` never cuts text into it.
    fn vocab_text(&self, id: usize) -> String {
        let p = &self.pieces[id];
        match p.kind {
            PieceType::Normal | PieceType::Byte => p.piece.clone(),
            // User-defined pieces are cut out before the model runs.
            _ => format!("\u{FFFF}{id}\u{FFFF}{}", p.piece),
        }
    }

    fn unigram(&self, unk: usize) -> Result<Unigram> {
        let vocab: Vec<(String, f64)> = (0..self.pieces.len())
            .map(|id| {
                let p = &self.pieces[id];
                let score = match p.kind {
                    // Matchable in `tokenizers` by their name; never worth choosing.
                    PieceType::Byte => -1e6,
                    _ => p.score as f64,
                };
                (self.vocab_text(id), score)
            })
            .collect();
        Unigram::from(vocab, Some(unk), self.byte_fallback).map_err(|e| anyhow!("cannot build the Unigram model: {e}"))
    }

    fn bpe(&self, unk: usize) -> Result<BPE> {
        let vocab: Vocab = (0..self.pieces.len()).map(|id| (self.vocab_text(id), id as u32)).collect();
        let mergeable: HashMap<&str, usize> = self
            .pieces
            .iter()
            .enumerate()
            .filter(|(_, p)| p.kind == PieceType::Normal)
            .map(|(id, p)| (p.piece.as_str(), id))
            .collect();
        // Every way to build a normal piece from two pieces, best score first (ties: lower id),
        // so `tokenizers`' lowest-rank-first merging follows SentencePiece's highest score first.
        let mut order: Vec<usize> =
            (0..self.pieces.len()).filter(|&id| self.pieces[id].kind == PieceType::Normal).collect();
        order.sort_by(|&a, &b| self.pieces[b].score.total_cmp(&self.pieces[a].score).then(a.cmp(&b)));
        let mut merges = Vec::new();
        for id in order {
            let piece = &self.pieces[id].piece;
            for (cut, _) in piece.char_indices().skip(1) {
                let (left, right) = piece.split_at(cut);
                if mergeable.contains_key(left) && mergeable.contains_key(right) {
                    merges.push((left.to_owned(), right.to_owned()));
                }
            }
        }
        BPE::builder()
            .vocab_and_merges(vocab, merges)
            .unk_token(self.vocab_text(unk))
            .fuse_unk(true)
            .byte_fallback(self.byte_fallback)
            .build()
            .map_err(|e| anyhow!("cannot build the BPE model: {e}"))
    }
}

/// A SentencePiece model as `tokenizers` parts: normalize the whole text, cut out the
/// user-defined pieces, run the model on what lies between.
pub struct SpTokenizer {
    normalizer: NormalizerWrapper,
    /// The Unigram or BPE model, with no normalizer of its own.
    model: Tokenizer,
    /// User-defined pieces and their ids, longest first.
    user: Vec<(String, u32)>,
    /// Every piece's id by its text (control pieces included).
    names: HashMap<String, u32>,
}

impl SpTokenizer {
    /// The ids of a text, as SentencePiece's `encode` gives them.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut normalized = NormalizedString::from(text);
        self.normalizer.normalize(&mut normalized).map_err(|e| anyhow!("cannot normalize: {e}"))?;
        let mut rest = normalized.get();
        let mut ids = Vec::new();
        let run = |segment: &str, ids: &mut Vec<u32>| -> Result<()> {
            if !segment.is_empty() {
                let enc = self.model.encode_fast(segment, false).map_err(|e| anyhow!("cannot tokenize: {e}"))?;
                ids.extend_from_slice(enc.get_ids());
            }
            Ok(())
        };
        let mut plain = 0;
        while plain < rest.len() {
            let here = &rest[plain..];
            match self.user.iter().find(|(piece, _)| here.starts_with(piece.as_str())) {
                Some((piece, id)) => {
                    run(&rest[..plain], &mut ids)?;
                    ids.push(*id);
                    rest = &here[piece.len()..];
                    plain = 0;
                }
                None => plain += here.chars().next().map_or(1, char::len_utf8),
            }
        }
        run(rest, &mut ids)?;
        Ok(ids)
    }

    /// The id of a piece by its text, whatever its kind.
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.names.get(piece).copied()
    }

    /// Largest id plus one.
    pub fn vocab_size(&self) -> usize {
        self.names.len()
    }
}

fn parse_piece(bytes: &[u8], id: usize) -> Result<Piece> {
    let mut p = Piece { piece: String::new(), score: 0.0, kind: PieceType::Normal };
    for (n, f) in fields(bytes).with_context(|| format!("piece {id}"))? {
        match (n, f) {
            (1, Field::Bytes(b)) => p.piece = text(b, &format!("piece {id}"))?,
            (2, Field::Fixed32(v)) => p.score = f32::from_bits(v),
            (3, Field::Varint(v)) => {
                p.kind = match v {
                    1 => PieceType::Normal,
                    2 => PieceType::Unknown,
                    3 => PieceType::Control,
                    4 => PieceType::UserDefined,
                    5 => PieceType::Unused,
                    6 => PieceType::Byte,
                    _ => bail!("piece {id} has unknown type {v}"),
                }
            }
            _ => {}
        }
    }
    if p.piece.is_empty() {
        bail!("piece {id} is empty");
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Encodes a protobuf message by hand: (field, wire type, payload).
    fn message(fields: &[(u32, u8, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        let varint = |out: &mut Vec<u8>, mut v: u64| {
            while v >= 0x80 {
                out.push((v as u8) | 0x80);
                v >>= 7;
            }
            out.push(v as u8);
        };
        for (n, wire, payload) in fields {
            varint(&mut out, ((*n as u64) << 3) | *wire as u64);
            match wire {
                2 => {
                    varint(&mut out, payload.len() as u64);
                    out.extend_from_slice(payload);
                }
                _ => out.extend_from_slice(payload),
            }
        }
        out
    }

    fn piece(text: &str, score: f32, kind: u8) -> (u32, u8, Vec<u8>) {
        (1, 2, message(&[(1, 2, text.as_bytes().to_vec()), (2, 5, score.to_le_bytes().to_vec()), (3, 0, vec![kind])]))
    }

    #[test]
    fn a_hand_made_unigram_model_parses_and_encodes() {
        let trainer = message(&[(3, 0, vec![1]), (42, 0, vec![2])]);
        let normalizer = message(&[(1, 2, b"identity".to_vec()), (4, 0, vec![1])]);
        let bytes = message(&[
            piece("<unk>", 0.0, 2),
            piece("<s>", 0.0, 3),
            piece("</s>", 0.0, 3),
            piece("\u{2581}ab", -1.0, 1),
            piece("\u{2581}", -2.0, 1),
            piece("a", -3.0, 1),
            piece("b", -3.0, 1),
            (2, 2, trainer),
            (3, 2, normalizer),
        ]);
        let m = SpModel::parse(&bytes).unwrap();
        assert_eq!((m.model_type, m.eos()), (ModelType::Unigram, Some(("</s>".into(), 2))));
        assert!(m.add_dummy_prefix && m.remove_extra_whitespaces);
        let t = m.to_tokenizer().unwrap();
        let ids = |s: &str| t.encode(s).unwrap();
        assert_eq!(ids("  ab  ba"), [3, 4, 6, 5]);
        // Control pieces are not cut out of text; unknown characters fuse into one piece.
        assert_eq!(ids("a</s>"), [4, 5, 0]);
    }

    #[test]
    fn damaged_files_are_refused() {
        assert!(SpModel::parse(b"").is_err());
        assert!(SpModel::parse(&[0x0a, 0x20, 0x01]).unwrap_err().to_string().contains("truncated"));
    }
}
