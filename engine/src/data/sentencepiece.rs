//! SentencePiece `.model` files, read and run without the SentencePiece library: the fields of
//! the `ModelProto` protobuf that decide how text is encoded, and an encoder that gives the ids
//! the reference library (the `sentencepiece` package, 0.2.3) gives, token for token.
//!
//! What SentencePiece does to a text, mirrored step by step (reference file in brackets):
//! - normalization (`normalizer.cc`, `Normalizer::Normalize`): the text is read one prefix at a
//!   time: a user-defined symbol is copied as it is, else the longest rule of the precompiled
//!   character map (a Darts double-array trie, e.g. `nmt_nfkc`, `nfkc_cf`; none for `identity`)
//!   gives the replacement, else one character is copied. With `remove_extra_whitespaces`, prefixes
//!   normalizing to one space are dropped at the start, leading spaces of a prefix that follows a
//!   space are dropped, and trailing spaces are dropped at the end. `add_dummy_prefix` puts a space
//!   in front (or, with `treat_whitespace_as_suffix`, at the end), and `escape_whitespaces` writes
//!   every space `▁` (U+2581);
//! - Unigram (`unigram_model.cc`, the optimized Viterbi): a best path per byte position, filled
//!   left to right from every character boundary with each piece of the vocabulary that starts
//!   there, in 32-bit floats; a candidate replaces the path already found only when it scores
//!   strictly more, so ties keep the path whose last piece starts first. Normal pieces score their
//!   log probability, user-defined pieces `(bytes - 1) × 0.1`, a character no piece of one
//!   character covers is unknown and scores the lowest normal score minus 10 (`kUnkPenalty`);
//!   `unused` pieces are skipped; once a best score passes ±100000 the scores still in use are
//!   shifted back to 0;
//! - BPE (`bpe_model.cc`): characters (user-defined symbols whole and never merged) merged pair by
//!   pair, the pair whose merged piece scores highest first, leftmost on ties; a result that is an
//!   `unused` piece is split back into the two pieces it was last merged from;
//! - the ids (`sentencepiece_processor.cc`, `PopulateSentencePieceText`): runs of unknown pieces
//!   become one unknown id, or with `byte_fallback` each unknown piece becomes its UTF-8 bytes
//!   (`<0xAB>` pieces).
//!
//! The Unigram rules follow the 0.2.3 release, whose encoder differs from the published source of
//! earlier ones (which summed scores in 64-bit floats and scored user-defined pieces from the
//! highest piece score): the two can cut a text differently where scores tie. Models are checked as
//! the library checks them when it loads one (`model_interface.cc`, `InitializePieces`); the
//! `word` and `char` model types are refused. `engine/tests/sentencepiece.rs` compares the
//! encodings with the Python package on models it trains.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};

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

/// A byte trie of pieces being built (one edge list per node).
#[derive(Default)]
struct Trie {
    edges: Vec<Vec<(u8, u32)>>,
    values: Vec<u32>,
}

impl Trie {
    fn insert(&mut self, key: &[u8], value: u32) {
        if self.edges.is_empty() {
            self.edges.push(Vec::new());
            self.values.push(NONE);
        }
        let mut node = 0usize;
        for &b in key {
            node = match self.edges[node].binary_search_by_key(&b, |e| e.0) {
                Ok(i) => self.edges[node][i].1 as usize,
                Err(i) => {
                    let next = self.edges.len() as u32;
                    self.edges[node].insert(i, (b, next));
                    self.edges.push(Vec::new());
                    self.values.push(NONE);
                    next as usize
                }
            };
        }
        self.values[node] = value;
    }

    /// The same trie with every node's edges in one array.
    fn freeze(mut self) -> FrozenTrie {
        if self.edges.is_empty() {
            self.edges.push(Vec::new());
            self.values.push(NONE);
        }
        let mut first = Vec::with_capacity(self.edges.len() + 1);
        let (mut labels, mut targets) = (Vec::new(), Vec::new());
        for edges in &self.edges {
            first.push(labels.len() as u32);
            labels.extend(edges.iter().map(|e| e.0));
            targets.extend(edges.iter().map(|e| e.1));
        }
        first.push(labels.len() as u32);
        FrozenTrie { first, labels, targets, values: self.values }
    }
}

/// A hash map with [`Fx`] hashing.
type Map<K, V> = HashMap<K, V, FxBuild>;

/// The multiply-rotate hash of Firefox and rustc (FxHash): the keys are a model's pieces and the
/// pieces of text looked up among them, short strings where SipHash's cost dominated BPE.
#[derive(Default, Clone, Copy)]
struct FxBuild;

impl BuildHasher for FxBuild {
    type Hasher = Fx;
    fn build_hasher(&self) -> Fx {
        Fx(0)
    }
}

/// The state of [`FxBuild`]'s hash.
struct Fx(u64);

impl Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(word)).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// No value at a trie node; no id.
const NONE: u32 = u32::MAX;

/// A byte trie of pieces: node `n`'s edges are `labels[first[n]..first[n + 1]]` (sorted) and
/// the nodes they lead to; `values[n]` is the id of the piece ending at `n`, or [`NONE`].
struct FrozenTrie {
    first: Vec<u32>,
    labels: Vec<u8>,
    targets: Vec<u32>,
    values: Vec<u32>,
}

impl FrozenTrie {
    /// The pieces that are prefixes of `text`, shortest first: (length in bytes, id).
    fn prefixes<'a>(&'a self, text: &'a [u8]) -> impl Iterator<Item = (usize, u32)> + 'a {
        let mut node = 0usize;
        text.iter()
            .enumerate()
            .map_while(move |(i, &b)| {
                let (lo, hi) = (*self.first.get(node)? as usize, self.first[node + 1] as usize);
                let at = self.labels[lo..hi].binary_search(&b).ok()?;
                node = self.targets[lo + at] as usize;
                Some((i + 1, self.values[node]))
            })
            .filter(|&(_, id)| id != NONE)
    }

    /// The length of the longest piece that is a prefix of `text`.
    fn longest(&self, text: &[u8]) -> Option<usize> {
        if self.labels.is_empty() {
            return None; // no pieces (models without user-defined symbols)
        }
        self.prefixes(text).last().map(|(len, _)| len)
    }
}

/// A precompiled character map (`Normalizer::DecodePrecompiledCharsMap`): the size of a Darts
/// double-array trie (u32, little-endian), the trie's 32-bit units, then the replacements, each
/// ending with a NUL byte; a key's value is the offset of its replacement.
struct CharsMap {
    units: Vec<u32>,
    replacements: String,
}

impl CharsMap {
    fn parse(blob: &[u8]) -> Result<CharsMap> {
        let size = blob.get(..4).ok_or_else(|| anyhow!("shorter than 4 bytes"))?;
        let size = u32::from_le_bytes(size.try_into().expect("4 bytes")) as usize;
        let trie = blob.get(4..4 + size).ok_or_else(|| anyhow!("its trie of {size} bytes is longer than the map"))?;
        let units: Vec<u32> =
            trie.chunks_exact(4).map(|u| u32::from_le_bytes(u.try_into().expect("4 bytes"))).collect();
        let replacements = String::from_utf8(blob[4 + size..].to_vec())
            .map_err(|_| anyhow!("its replacement strings are not UTF-8"))?;
        if units.is_empty() {
            bail!("its trie is empty");
        }
        Ok(CharsMap { units, replacements })
    }

    /// The longest rule matching a prefix of `text` (`NormalizePrefix`): its length in bytes and
    /// replacement. Darts' `commonPrefixSearch`, with reads outside the trie taken as no match.
    fn longest<'a>(&'a self, text: &[u8]) -> Result<Option<(usize, &'a str)>> {
        // Unit fields (darts.h, DoubleArrayUnit).
        let has_leaf = |u: u32| (u >> 8) & 1 == 1;
        let value = |u: u32| u & ((1 << 31) - 1);
        let label = |u: u32| u & ((1 << 31) | 0xFF);
        let offset = |u: u32| ((u >> 10) << ((u & (1 << 9)) >> 6)) as usize;
        let mut longest = None;
        let mut found = 0;
        let mut node = offset(self.units[0]);
        for (i, &c) in text.iter().enumerate() {
            node ^= c as usize;
            let Some(&unit) = self.units.get(node) else { break };
            if label(unit) != c as u32 {
                break;
            }
            node ^= offset(unit);
            if has_leaf(unit) {
                let Some(&leaf) = self.units.get(node) else { break };
                // The reference keeps the first kMaxTrieResultsSize (32) matches.
                if found < 32 {
                    longest = Some((i + 1, value(leaf) as usize));
                }
                found += 1;
            }
        }
        let Some((len, at)) = longest else { return Ok(None) };
        let rest = self.replacements.get(at..).ok_or_else(|| anyhow!("precompiled_charsmap: bad replacement {at}"))?;
        Ok(Some((len, &rest[..rest.find('\0').unwrap_or(rest.len())])))
    }
}

/// The normalizer's settings (`NormalizerSpec`, and the trainer's `treat_whitespace_as_suffix`).
struct Normalizer {
    charsmap: Option<CharsMap>,
    add_dummy_prefix: bool,
    remove_extra_whitespaces: bool,
    escape_whitespaces: bool,
    treat_whitespace_as_suffix: bool,
}

impl Normalizer {
    /// The normalized form of the next prefix of `input` and the bytes it takes
    /// (`NormalizePrefix`): a user-defined symbol as it is, else the longest character-map rule,
    /// else one character.
    fn prefix<'a>(&'a self, input: &'a str, user: &FrozenTrie) -> Result<(&'a str, usize)> {
        if let Some(len) = user.longest(input.as_bytes()) {
            return Ok((&input[..len], len));
        }
        if let Some(map) = &self.charsmap
            && let Some((len, to)) = map.longest(input.as_bytes())?
        {
            if !input.is_char_boundary(len) {
                bail!("precompiled_charsmap: a rule ends inside a character");
            }
            return Ok((to, len));
        }
        let len = input.chars().next().map_or(0, char::len_utf8);
        Ok((&input[..len], len))
    }

    /// `Normalizer::Normalize`.
    fn normalize(&self, mut input: &str, user: &FrozenTrie) -> Result<String> {
        if self.remove_extra_whitespaces {
            // Leading prefixes that normalize to one space are dropped.
            while !input.is_empty() {
                let (to, len) = self.prefix(input, user)?;
                if to != " " {
                    break;
                }
                input = &input[len..];
            }
        }
        let mut out = String::with_capacity(input.len() * 3 / 2 + 4);
        if input.is_empty() {
            return Ok(out);
        }
        let space = if self.escape_whitespaces { "\u{2581}" } else { " " };
        if self.add_dummy_prefix && !self.treat_whitespace_as_suffix {
            out.push_str(space);
        }
        let mut prev_space = self.remove_extra_whitespaces;
        while !input.is_empty() {
            let (mut to, len) = self.prefix(input, user)?;
            if prev_space {
                to = to.trim_start_matches(' ');
            }
            if !to.is_empty() {
                for piece in to.split_inclusive(' ') {
                    match piece.strip_suffix(' ') {
                        Some(text) if self.escape_whitespaces => {
                            out.push_str(text);
                            out.push('\u{2581}');
                        }
                        _ => out.push_str(piece),
                    }
                }
                prev_space = to.ends_with(' ');
            }
            input = &input[len..];
            if !self.remove_extra_whitespaces {
                prev_space = false;
            }
        }
        if self.remove_extra_whitespaces {
            while out.ends_with(space) {
                out.truncate(out.len() - space.len());
            }
        }
        if self.add_dummy_prefix && self.treat_whitespace_as_suffix {
            out.push_str(space);
        }
        Ok(out)
    }
}

/// A SentencePiece model ready to encode (see the module documentation).
pub struct SpTokenizer {
    normalizer: Normalizer,
    model_type: ModelType,
    /// Every piece's kind and score, by id.
    kinds: Vec<PieceType>,
    scores: Vec<f32>,
    /// The unknown piece and the score of an unknown character (Unigram).
    unk: u32,
    unk_score: f32,
    /// Each byte's piece, with `byte_fallback`.
    byte_ids: Option<[u32; 256]>,
    /// User-defined symbols (the normalizer's and BPE's `PrefixMatcher`).
    user: FrozenTrie,
    /// Normal, user-defined and unused pieces: those that can match text.
    vocab: FrozenTrie,
    /// The same pieces by their text (BPE's lookups of merged pairs).
    pieces: Map<String, u32>,
    /// Every piece's id by its text (`PieceToId`: control, unknown and byte pieces first).
    names: Map<String, u32>,
}

/// Unigram scores past which the best path scores are shifted back to 0 (0.2.3's encoder).
const RESCALE_AT: f32 = 100_000.0;

impl SpTokenizer {
    /// The ids of a text, as SentencePiece's `encode` gives them.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let normalized = self.normalizer.normalize(text, &self.user)?;
        let pieces = match self.model_type {
            ModelType::Unigram => self.unigram(&normalized)?,
            _ => self.bpe(&normalized),
        };
        // PopulateSentencePieceText: unknown pieces become their bytes, or one id per run.
        let mut ids = Vec::with_capacity(pieces.len());
        let mut prev_unk = false;
        for (piece, id) in pieces {
            let unk = self.kinds[id as usize] == PieceType::Unknown;
            match &self.byte_ids {
                Some(bytes) if unk => ids.extend(piece.bytes().map(|b| bytes[b as usize])),
                _ if unk && prev_unk => {}
                _ => ids.push(id),
            }
            prev_unk = unk;
        }
        Ok(ids)
    }

    /// Unigram's best segmentation of a normalized text (`Model::EncodeOptimized` as 0.2.3 runs
    /// it): the pieces and their ids.
    fn unigram<'a>(&self, text: &'a str) -> Result<Vec<(&'a str, u32)>> {
        /// The best path ending at a byte position: its last piece and score.
        #[derive(Clone, Copy)]
        struct Best {
            id: u32,
            score: f32,
            start: usize,
        }
        let bytes = text.as_bytes();
        let unset = Best { id: NONE, score: 0.0, start: usize::MAX };
        let mut best = vec![unset; bytes.len() + 1];
        best[0].start = 0;
        let mut reached = 0;
        let mut start = 0;
        while start < bytes.len() {
            let mut here = best[start].score;
            if here.is_finite() && here.abs() > RESCALE_AT {
                // Keep the scores near 0 where f32 still tells pieces apart: every path still in
                // use (from here to the farthest end reached) loses the same amount.
                for b in &mut best[start + 1..=reached] {
                    if b.start != usize::MAX {
                        b.score -= here;
                    }
                }
                best[start].score -= here;
                here = 0.0;
            }
            let char_len = text[start..].chars().next().map_or(1, char::len_utf8);
            let mut single = false;
            for (len, id) in self.vocab.prefixes(&bytes[start..]) {
                let score = match self.kinds[id as usize] {
                    PieceType::Normal => self.scores[id as usize],
                    PieceType::UserDefined => (len - 1) as f32 * 0.1,
                    _ => continue, // unused
                };
                let end = start + len;
                reached = reached.max(end);
                let candidate = score + here;
                if best[end].start == usize::MAX || candidate > best[end].score {
                    best[end] = Best { id, score: candidate, start };
                }
                single |= len == char_len;
            }
            if !single {
                let end = start + char_len;
                reached = reached.max(end);
                let candidate = self.unk_score + here;
                if best[end].start == usize::MAX || candidate > best[end].score {
                    best[end] = Best { id: self.unk, score: candidate, start };
                }
            }
            start += char_len;
        }
        let mut pieces = Vec::new();
        let mut end = bytes.len();
        while end > 0 {
            let b = best[end];
            if b.start >= end {
                bail!("internal error: no Unigram path reaches byte {end}");
            }
            pieces.push((&text[b.start..end], b.id));
            end = b.start;
        }
        pieces.reverse();
        Ok(pieces)
    }

    /// BPE's segmentation of a normalized text (`bpe::Model::SampleEncode` without dropout): the
    /// pieces and their ids.
    fn bpe<'a>(&self, text: &'a str) -> Vec<(&'a str, u32)> {
        /// A symbol: a span of the text, linked to its neighbours (`usize::MAX`: none).
        struct Symbol {
            start: usize,
            len: usize,
            prev: usize,
            next: usize,
            frozen: bool,
        }
        /// A candidate merge; the heap's greatest is the best score, then the leftmost.
        struct Pair {
            score: f32,
            left: usize,
            right: usize,
            len: usize,
        }
        impl Ord for Pair {
            fn cmp(&self, other: &Self) -> Ordering {
                (self.score.partial_cmp(&other.score).unwrap_or(Ordering::Equal)).then(other.left.cmp(&self.left))
            }
        }
        impl PartialOrd for Pair {
            fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
                Some(self.cmp(other))
            }
        }
        impl PartialEq for Pair {
            fn eq(&self, other: &Self) -> bool {
                self.cmp(other) == Ordering::Equal
            }
        }
        impl Eq for Pair {}

        let mut symbols = Vec::new();
        let mut at = 0;
        while at < text.len() {
            let user = self.user.longest(&text.as_bytes()[at..]);
            let len = user.unwrap_or_else(|| text[at..].chars().next().map_or(1, char::len_utf8));
            let prev = if symbols.is_empty() { usize::MAX } else { symbols.len() - 1 };
            let next = if at + len < text.len() { symbols.len() + 1 } else { usize::MAX };
            symbols.push(Symbol { start: at, len, prev, next, frozen: user.is_some() });
            at += len;
        }
        let mut agenda = BinaryHeap::new();
        // Unused pieces met as merges, split back into the pair they were last made from.
        let mut unmerge: HashMap<&'a str, (&'a str, &'a str)> = HashMap::new();
        let span = |s: &Symbol| &text[s.start..s.start + s.len];
        let mut add = |symbols: &[Symbol], agenda: &mut BinaryHeap<Pair>, left: usize, right: usize| {
            if left == usize::MAX || right == usize::MAX || symbols[left].frozen || symbols[right].frozen {
                return;
            }
            let (l, r) = (&symbols[left], &symbols[right]);
            let merged = &text[l.start..l.start + l.len + r.len];
            let Some(&id) = self.pieces.get(merged) else { return };
            agenda.push(Pair { score: self.scores[id as usize], left, right, len: merged.len() });
            if self.kinds[id as usize] == PieceType::Unused {
                unmerge.insert(merged, (span(l), span(r)));
            }
        };
        for i in 1..symbols.len() {
            add(&symbols, &mut agenda, i - 1, i);
        }
        while let Some(top) = agenda.pop() {
            let (l, r) = (symbols[top.left].len, symbols[top.right].len);
            if l == 0 || r == 0 || l + r != top.len {
                continue; // one of its symbols has changed since
            }
            symbols[top.left].len += r;
            let next = symbols[top.right].next;
            symbols[top.left].next = next;
            if next != usize::MAX {
                symbols[next].prev = top.left;
            }
            symbols[top.right].len = 0;
            add(&symbols, &mut agenda, symbols[top.left].prev, top.left);
            add(&symbols, &mut agenda, top.left, next);
        }
        let mut pieces = Vec::new();
        let mut i = if symbols.is_empty() { usize::MAX } else { 0 };
        while i != usize::MAX {
            self.resegment(span(&symbols[i]), &unmerge, &mut pieces);
            i = symbols[i].next;
        }
        pieces
    }

    /// A BPE piece as output: an `unused` piece split back into what it was merged from.
    fn resegment<'a>(
        &self,
        piece: &'a str,
        unmerge: &HashMap<&'a str, (&'a str, &'a str)>,
        out: &mut Vec<(&'a str, u32)>,
    ) {
        let id = self.names.get(piece).copied().unwrap_or(self.unk);
        match unmerge.get(piece) {
            Some(&(left, right)) if self.kinds[id as usize] == PieceType::Unused => {
                self.resegment(left, unmerge, out);
                self.resegment(right, unmerge, out);
            }
            _ => out.push((piece, id)),
        }
    }

    /// The id of a piece by its text, whatever its kind.
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.names.get(piece).copied()
    }

    /// Largest id plus one.
    pub fn vocab_size(&self) -> usize {
        self.kinds.len()
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

    const NORMAL: u8 = 1;
    const UNKNOWN: u8 = 2;
    const USER: u8 = 4;
    const UNUSED: u8 = 5;

    /// A model of the given type (1 Unigram, 2 BPE) with identity normalization, no dummy prefix
    /// and `<unk>` first, then `pieces`.
    fn bare(model_type: u8, pieces: &[(&str, f32, u8)]) -> SpTokenizer {
        let mut fields = vec![piece("<unk>", 0.0, UNKNOWN)];
        fields.extend(pieces.iter().map(|&(t, s, k)| piece(t, s, k)));
        fields.push((2, 2, message(&[(3, 0, vec![model_type])])));
        fields.push((3, 2, message(&[(1, 2, b"identity".to_vec()), (3, 0, vec![0])])));
        SpModel::parse(&message(&fields)).unwrap().to_tokenizer().unwrap()
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
        assert_eq!(ids(""), [] as [u32; 0]);
        assert_eq!(ids("   "), [] as [u32; 0]);
    }

    /// Each expectation below is what the `sentencepiece` package (0.2.3) gives the same model.
    #[test]
    fn unigram_scores_and_ties_are_the_reference_s() {
        // Equal totals: the path whose last piece starts first stays.
        let t = bare(1, &[("a", -1.0, NORMAL), ("b", -1.0, NORMAL), ("ab", -2.0, NORMAL)]);
        assert_eq!(t.encode("ab").unwrap(), [3]);
        // Sums are f32: -0.1 + -0.2 rounds to -0.3, a tie (in f64 "a|b" would win).
        let t = bare(1, &[("a", -0.1, NORMAL), ("b", -0.2, NORMAL), ("ab", -0.3, NORMAL)]);
        assert_eq!(t.encode("ab").unwrap(), [3]);
        // A user-defined piece scores (bytes - 1) × 0.1 whatever the other scores: "xy" 0.1.
        for (y, want) in [(0.1, vec![3]), (0.11, vec![1, 2])] {
            let t = bare(1, &[("x", 0.0, NORMAL), ("y", y, NORMAL), ("xy", 0.0, USER), ("q", 30.0, NORMAL)]);
            assert_eq!(t.encode("xy").unwrap(), want, "y = {y}");
        }
        // An unknown character scores the lowest normal score (-3) minus 10: unk + "defgh" (-14)
        // beats five pieces of -3, not when "defgh" scores -2.1.
        for (defgh, want) in [(-1.0, vec![0, 6]), (-2.1, vec![1, 2, 3, 4, 5])] {
            let p = [("cd", -3.0, NORMAL), ("e", -3.0, NORMAL), ("f", -3.0, NORMAL), ("g", -3.0, NORMAL)];
            let t = bare(1, &[p[0], p[1], p[2], p[3], ("h", -3.0, NORMAL), ("defgh", defgh, NORMAL)]);
            assert_eq!(t.encode("cdefgh").unwrap(), want, "defgh = {defgh}");
        }
        // Unused pieces are never produced.
        let t = bare(1, &[("a", -1.0, NORMAL), ("b", -1.0, NORMAL), ("ab", -0.5, UNUSED)]);
        assert_eq!(t.encode("ab").unwrap(), [1, 2]);
    }

    #[test]
    fn unigram_scores_past_100000_are_shifted_back_to_0() {
        // After "aa" the best score is -120000, where f32 steps are 1/128: without the shift
        // "bc" (-0.0025) and "b|c" (-0.002) would tie and "bc" stay; with it "b|c" wins. After
        // -80000 there is no shift and the tie keeps "bc".
        for (a, want) in [(-60000.0, vec![1, 1, 2, 3]), (-40000.0, vec![1, 1, 4])] {
            let p = [("a", a, NORMAL), ("b", -0.001, NORMAL), ("c", -0.001, NORMAL), ("bc", -0.0025, NORMAL)];
            assert_eq!(bare(1, &p).encode("aabc").unwrap(), want, "a = {a}");
        }
    }

    #[test]
    fn bpe_merges_the_best_pair_leftmost_first_and_unmerges_unused_pieces() {
        let t = bare(2, &[("a", -1.0, NORMAL), ("aa", -2.0, NORMAL)]);
        assert_eq!(t.encode("aaa").unwrap(), [2, 1]);
        // "ab" is unused: merged on the way, then split back, unless a merge goes through it.
        let p = [("a", -1.0, NORMAL), ("b", -1.0, NORMAL), ("d", -1.0, NORMAL), ("ab", -3.0, UNUSED)];
        assert_eq!(bare(2, &p).encode("abd").unwrap(), [1, 2, 3]);
        let t = bare(2, &[p[0], p[1], p[2], p[3], ("abd", -4.0, NORMAL)]);
        assert_eq!(t.encode("abd").unwrap(), [5]);
        // User-defined symbols are never merged; unknown characters fuse into one id.
        let t = bare(2, &[("a", -1.0, NORMAL), ("<s>a", -1.0, NORMAL), ("<s>", 0.0, USER)]);
        assert_eq!(t.encode("<s>a??a").unwrap(), [3, 1, 0, 1]);
    }

    #[test]
    fn the_normalizer_follows_the_flags() {
        let user = Trie::default().freeze();
        let n = |dummy, extra, escape, suffix| Normalizer {
            charsmap: None,
            add_dummy_prefix: dummy,
            remove_extra_whitespaces: extra,
            escape_whitespaces: escape,
            treat_whitespace_as_suffix: suffix,
        };
        let text = "  a  b\tc  ";
        assert_eq!(n(true, true, true, false).normalize(text, &user).unwrap(), "\u{2581}a\u{2581}b\tc");
        assert_eq!(n(true, true, true, true).normalize(text, &user).unwrap(), "a\u{2581}b\tc\u{2581}");
        assert_eq!(
            n(true, false, true, false).normalize(text, &user).unwrap(),
            "\u{2581}\u{2581}\u{2581}a\u{2581}\u{2581}b\tc\u{2581}\u{2581}"
        );
        assert_eq!(n(false, true, false, false).normalize(text, &user).unwrap(), "a b\tc");
        assert_eq!(n(true, true, true, false).normalize("   ", &user).unwrap(), "");
    }

    #[test]
    fn a_precompiled_charsmap_is_read() {
        // The nmt_nfkc map of the Unigram fixture (trained by the Python package).
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizers/spm-unigram.model");
        let m = SpModel::open(&path).unwrap();
        let t = m.to_tokenizer().unwrap();
        assert_eq!(t.normalizer.normalize("  \u{FF21}  \u{FB01}ne ", &t.user).unwrap(), "\u{2581}A\u{2581}fine");
        let broken = CharsMap::parse(&[8, 0, 0, 0, 1, 2]).map(|_| ()).unwrap_err();
        assert!(broken.to_string().contains("longer than the map"), "{broken}");
    }

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
