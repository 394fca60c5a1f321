//! How the encoder finds pieces: byte tries of the pieces that can match text (prefix search for
//! Unigram, the normalizer's and BPE's user-defined symbols) and a hash map of them by text.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// A byte trie of pieces being built (one edge list per node).
#[derive(Default)]
pub(super) struct Trie {
    edges: Vec<Vec<(u8, u32)>>,
    values: Vec<u32>,
}

impl Trie {
    pub(super) fn insert(&mut self, key: &[u8], value: u32) {
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
    pub(super) fn freeze(mut self) -> FrozenTrie {
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
pub(super) type Map<K, V> = HashMap<K, V, FxBuild>;

/// The multiply-rotate hash of Firefox and rustc (FxHash): the keys are a model's pieces and the
/// pieces of text looked up among them, short strings where SipHash's cost dominated BPE.
#[derive(Default, Clone, Copy)]
pub(super) struct FxBuild;

impl BuildHasher for FxBuild {
    type Hasher = Fx;
    fn build_hasher(&self) -> Fx {
        Fx(0)
    }
}

/// The state of [`FxBuild`]'s hash.
pub(super) struct Fx(u64);

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
pub(super) const NONE: u32 = u32::MAX;

/// A byte trie of pieces: node `n`'s edges are `labels[first[n]..first[n + 1]]` (sorted) and
/// the nodes they lead to; `values[n]` is the id of the piece ending at `n`, or [`NONE`].
pub(super) struct FrozenTrie {
    first: Vec<u32>,
    labels: Vec<u8>,
    targets: Vec<u32>,
    values: Vec<u32>,
}

impl FrozenTrie {
    /// The pieces that are prefixes of `text`, shortest first: (length in bytes, id).
    pub(super) fn prefixes<'a>(&'a self, text: &'a [u8]) -> impl Iterator<Item = (usize, u32)> + 'a {
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
    pub(super) fn longest(&self, text: &[u8]) -> Option<usize> {
        if self.labels.is_empty() {
            return None; // no pieces (models without user-defined symbols)
        }
        self.prefixes(text).last().map(|(len, _)| len)
    }
}
