//! Unigram (`unigram_model.cc`, the optimized Viterbi of the 0.2.3 release): the best
//! segmentation of a normalized text, scored in 32-bit floats as the reference scores it.

use anyhow::{Result, bail};

use super::SpTokenizer;
use super::lookup::NONE;
use super::model::PieceType;

/// Unigram scores past which the best path scores are shifted back to 0 (0.2.3's encoder).
const RESCALE_AT: f32 = 100_000.0;

impl SpTokenizer {
    /// Unigram's best segmentation of a normalized text (`Model::EncodeOptimized` as 0.2.3 runs
    /// it): the pieces and their ids.
    pub(super) fn unigram<'a>(&self, text: &'a str) -> Result<Vec<(&'a str, u32)>> {
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
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;

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
}
