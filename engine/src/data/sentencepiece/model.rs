//! The `.model` file: the fields of SentencePiece's `ModelProto` protobuf that decide how text is
//! encoded, read with a small wire-format reader, and the checks the library makes when it loads
//! a model (`model_interface.cc`, `InitializePieces`) before the encoder is built.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};

use super::SpTokenizer;
use super::lookup::{Map, Trie};
use super::normalizer::{CharsMap, Normalizer};

/// The kind of a piece (`ModelProto.SentencePiece.Type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceType {
    /// A piece text can be cut into.
    Normal,
    /// The unknown piece.
    Unknown,
    /// A control symbol such as `<s>`: never produced from text.
    Control,
    /// Left as it is by the normalizer and never merged by BPE; Unigram scores it
    /// (bytes - 1) × 0.1, above any log probability.
    UserDefined,
    /// A byte `<0xAB>` for `byte_fallback`.
    Byte,
    /// In the vocabulary but never produced (BPE splits a merge into one back into its parts).
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
    /// Whitespace marks the end of a piece instead of its start: the dummy space goes last.
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

    /// The encoder of this model, after the checks SentencePiece makes when it loads a model
    /// (`InitializePieces`): no piece twice, one unknown piece, byte pieces only with
    /// `byte_fallback` and then all 256 of them, finite scores.
    pub fn to_tokenizer(&self) -> Result<SpTokenizer> {
        match self.model_type {
            ModelType::Unigram | ModelType::Bpe => {}
            other => bail!("{other:?} SentencePiece models are not supported (Unigram and BPE are)"),
        }
        // Normal, user-defined and unused pieces can match text; the others (control, unknown,
        // byte) are looked up by name only. Each group must not repeat a piece.
        let mut matchable: HashMap<&str, u32> = HashMap::new();
        let mut reserved: HashMap<&str, u32> = HashMap::new();
        let mut unk = None;
        let mut bytes = [u32::MAX; 256];
        for (id, p) in self.pieces.iter().enumerate() {
            let id = id as u32;
            let group = match p.kind {
                PieceType::Normal | PieceType::UserDefined | PieceType::Unused => &mut matchable,
                _ => &mut reserved,
            };
            if let Some(first) = group.insert(&p.piece, id) {
                bail!("piece {:?} is defined twice (ids {first} and {id})", p.piece);
            }
            if !p.score.is_finite() {
                bail!("piece {id} ({:?}) has the score {}", p.piece, p.score);
            }
            match p.kind {
                PieceType::Unknown if unk.is_some() => bail!("two unknown pieces (ids {} and {id})", unk.unwrap()),
                PieceType::Unknown => unk = Some(id),
                PieceType::Byte if !self.byte_fallback => {
                    bail!("byte piece {:?} (id {id}) although byte_fallback is off", p.piece)
                }
                PieceType::Byte => match byte_of(&p.piece) {
                    Some(b) => bytes[b as usize] = id,
                    None => bail!("byte piece {:?} (id {id}) is not <0x00>..<0xFF>", p.piece),
                },
                _ => {}
            }
        }
        let unk = unk.ok_or_else(|| anyhow!("the model has no unknown piece"))?;
        let byte_ids = if self.byte_fallback {
            if let Some(b) = bytes.iter().position(|&id| id == u32::MAX) {
                bail!("byte_fallback is on but the byte piece <0x{b:02X}> is missing");
            }
            Some(bytes)
        } else {
            None
        };
        let mut user = Trie::default();
        let mut vocab = Trie::default();
        for (piece, &id) in &matchable {
            vocab.insert(piece.as_bytes(), id);
            if self.pieces[id as usize].kind == PieceType::UserDefined {
                user.insert(piece.as_bytes(), id);
            }
        }
        // The unknown score: the lowest normal score minus kUnkPenalty (10), in f32.
        let min_score =
            (self.pieces.iter()).filter(|p| p.kind == PieceType::Normal).map(|p| p.score).fold(f32::MAX, f32::min);
        let charsmap = if self.precompiled_charsmap.is_empty() {
            None
        } else {
            Some(CharsMap::parse(&self.precompiled_charsmap).with_context(|| {
                format!("the precompiled_charsmap of normalizer `{}` is damaged", self.normalizer_name)
            })?)
        };
        let pieces: Map<String, u32> = matchable.iter().map(|(p, &id)| (p.to_string(), id)).collect();
        // PieceToId: the reserved pieces first, then the others.
        let mut names = pieces.clone();
        names.extend(reserved.iter().map(|(p, &id)| (p.to_string(), id)));
        Ok(SpTokenizer {
            normalizer: Normalizer {
                charsmap,
                add_dummy_prefix: self.add_dummy_prefix,
                remove_extra_whitespaces: self.remove_extra_whitespaces,
                escape_whitespaces: self.escape_whitespaces,
                treat_whitespace_as_suffix: self.treat_whitespace_as_suffix,
            },
            model_type: self.model_type,
            kinds: self.pieces.iter().map(|p| p.kind).collect(),
            scores: self.pieces.iter().map(|p| p.score).collect(),
            unk,
            unk_score: min_score - 10.0,
            byte_ids,
            user: user.freeze(),
            vocab: vocab.freeze(),
            pieces,
            names,
        })
    }
}

/// The byte of a byte piece: `<0xAB>` (two upper-case hex digits, as `ByteToPiece` writes them).
fn byte_of(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    let upper = hex.len() == 2 && hex.bytes().all(|c| c.is_ascii_digit() || (b'A'..=b'F').contains(&c));
    upper.then(|| u8::from_str_radix(hex, 16).ok()).flatten()
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
    use super::super::testing::*;
    use super::*;

    #[test]
    fn damaged_files_are_refused() {
        assert!(SpModel::parse(b"").is_err());
        assert!(SpModel::parse(&[0x0a, 0x20, 0x01]).unwrap_err().to_string().contains("truncated"));
    }

    #[test]
    fn models_the_reference_refuses_are_refused() {
        let refused = |pieces: &[(u32, u8, Vec<u8>)], trainer: &[(u32, u8, Vec<u8>)]| {
            let mut fields = pieces.to_vec();
            fields.push((2, 2, message(trainer)));
            SpModel::parse(&message(&fields)).unwrap().to_tokenizer().map(|_| ()).unwrap_err().to_string()
        };
        let unk = piece("<unk>", 0.0, UNKNOWN);
        let unigram = [(3, 0, vec![1])];
        let e = refused(&[unk.clone(), piece("a", -1.0, NORMAL), piece("a", -2.0, NORMAL)], &unigram);
        assert!(e.contains("\"a\" is defined twice (ids 1 and 2)"), "{e}");
        let e = refused(&[piece("a", -1.0, NORMAL)], &unigram);
        assert!(e.contains("no unknown piece"), "{e}");
        let e = refused(&[unk.clone(), piece("<0x41>", 0.0, 6)], &unigram);
        assert!(e.contains("byte_fallback is off"), "{e}");
        let e = refused(&[unk.clone(), piece("<0x41>", 0.0, 6)], &[(3, 0, vec![1]), (35, 0, vec![1])]);
        assert!(e.contains("<0x00> is missing"), "{e}");
        let e = refused(&[unk.clone(), piece("a", f32::NAN, NORMAL)], &unigram);
        assert!(e.contains("score NaN"), "{e}");
        let e = refused(&[unk, piece("a", -1.0, NORMAL)], &[(3, 0, vec![3])]);
        assert!(e.contains("Word SentencePiece models are not supported"), "{e}");
    }
}
