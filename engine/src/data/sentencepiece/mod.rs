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
//!
//! One file per job: `model.rs` reads a `.model` file and checks it as the library does when it
//! loads one; `normalizer.rs`, `unigram.rs` and `bpe.rs` are the steps above; this file holds the
//! encoder and its last step, the ids; `lookup.rs` the tries and the hash map that find pieces.

mod bpe;
mod lookup;
mod model;
mod normalizer;
#[cfg(test)]
mod testing;
mod unigram;

pub use model::{ModelType, Piece, PieceType, SpModel};

use anyhow::Result;
use lookup::{FrozenTrie, Map};
use normalizer::Normalizer;

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

    /// The id of a piece by its text, whatever its kind.
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.names.get(piece).copied()
    }

    /// Largest id plus one.
    pub fn vocab_size(&self) -> usize {
        self.kinds.len()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

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
}
