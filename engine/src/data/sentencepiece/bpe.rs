//! BPE (`bpe_model.cc`): characters merged pair by pair, the best-scoring merge first, and
//! `unused` pieces split back into what they were merged from.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::SpTokenizer;
use super::model::PieceType;

impl SpTokenizer {
    /// BPE's segmentation of a normalized text (`bpe::Model::SampleEncode` without dropout): the
    /// pieces and their ids.
    pub(super) fn bpe<'a>(&self, text: &'a str) -> Vec<(&'a str, u32)> {
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
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;

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
}
