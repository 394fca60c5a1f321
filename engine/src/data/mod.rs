//! Training data: token sources and the loader that cuts them into samples.
//!
//! A source is a long stream of token ids. The loader cuts it into windows of `seq_len + 1`
//! tokens (inputs and next-token targets overlap by all but one token), keeps the last
//! [`VALIDATION_FRACTION`] of the windows for validation, and visits the training windows in a
//! seeded random order per epoch. Its position (epoch, index) is exact and resumable, and each
//! data-parallel rank takes a disjoint, interleaved slice of every epoch's order.
//!
//! Sources: the embedded corpus (byte tokens), synthetic tokens, and memory-mapped token shards
//! ([`shard`]) that `engine data prepare` ([`prepare`]) writes with a real tokenizer
//! ([`tokenizer`], [`sentencepiece`]).

pub mod arrow_ipc;
pub mod prepare;
pub mod readers;
pub mod sentencepiece;
pub mod shard;
pub mod tokenizer;

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Result, bail};

use crate::config::{DataConfig, DataSource};
use crate::rng;

/// The embedded corpus: the opening of Shakespeare's plays (public domain), read as bytes.
pub const CORPUS: &[u8] = include_bytes!("../../data/shakespeare.txt");

/// Share of the windows held out for validation.
pub const VALIDATION_FRACTION: f64 = 0.05;

/// Length of the synthetic stream (tokens); long enough never to repeat a window in a test.
const SYNTHETIC_LEN: usize = 1 << 24;

/// A stream of token ids.
pub trait TokenSource: Send {
    /// Number of tokens.
    fn len(&self) -> usize;
    /// Whether the stream is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies tokens `start .. start + out.len()`.
    fn read(&self, start: usize, out: &mut [u32]);
    /// Largest token id the source can produce plus one.
    fn vocab_needed(&self) -> usize;
}

/// Bytes as tokens 0..255.
pub struct Bytes(pub &'static [u8]);

impl TokenSource for Bytes {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn read(&self, start: usize, out: &mut [u32]) {
        for (o, &b) in out.iter_mut().zip(&self.0[start..]) {
            *o = b as u32;
        }
    }
    fn vocab_needed(&self) -> usize {
        256
    }
}

/// Uniformly random tokens from a seed: token `i` is a pure function of `(seed, i)`.
pub struct Synthetic {
    /// Token ids are below this.
    pub vocab: usize,
    /// The stream's seed.
    pub seed: u64,
}

impl TokenSource for Synthetic {
    fn len(&self) -> usize {
        SYNTHETIC_LEN
    }
    fn read(&self, start: usize, out: &mut [u32]) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = (rng::bits(self.seed, 0x5eed, (start + i) as u64) % self.vocab as u64) as u32;
        }
    }
    fn vocab_needed(&self) -> usize {
        self.vocab
    }
}

/// Opens the source a data config names, checking it fits the vocabulary.
pub fn open(data: &DataConfig, vocab_size: usize, seed: u64) -> Result<Box<dyn TokenSource>> {
    let source: Box<dyn TokenSource> = match data.source {
        DataSource::Embedded => Box::new(Bytes(CORPUS)),
        DataSource::Synthetic => Box::new(Synthetic { vocab: vocab_size, seed }),
        DataSource::Shards => Box::new(shard::Shards::open(Path::new(&data.path))?),
    };
    if source.vocab_needed() > vocab_size {
        match data.source {
            DataSource::Shards => bail!(
                "the shards in data.path = {} were written with a tokenizer of {} tokens, more than model.vocab_size = {vocab_size}",
                data.path,
                source.vocab_needed()
            ),
            _ => bail!(
                "data.source = \"embedded\" uses byte tokens 0..255, more than model.vocab_size = {vocab_size}; \
                 raise model.vocab_size or use data.source = \"synthetic\""
            ),
        }
    }
    Ok(source)
}

/// What identifies the data a config names, for checkpoints to record and a resumed run to
/// compare ([`shard::fingerprint`]: each shard's name and header hash); none for the embedded
/// corpus and synthetic tokens, which are fixed by the engine and the seed.
pub fn fingerprint(data: &DataConfig) -> Result<Option<BTreeMap<String, String>>> {
    match data.source {
        DataSource::Shards => shard::fingerprint(Path::new(&data.path)).map(Some),
        DataSource::Embedded | DataSource::Synthetic => Ok(None),
    }
}

/// Where a loader is: the epoch and the next index in that epoch's order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Position {
    /// Completed passes over the training windows.
    pub epoch: u64,
    /// Next index into this epoch's order (counting all ranks' samples).
    pub index: u64,
}

/// Cuts a source into shuffled samples of `seq_len + 1` tokens.
pub struct Loader {
    source: Box<dyn TokenSource>,
    seq_len: usize,
    seed: u64,
    train_windows: usize,
    val_windows: usize,
    rank: usize,
    world: usize,
    order: Vec<u32>,
    position: Position,
    window: Vec<u32>,
}

impl Loader {
    /// A loader over `source`; this rank reads samples `rank, rank + world, ...` of each epoch.
    pub fn new(source: Box<dyn TokenSource>, seq_len: usize, seed: u64, rank: usize, world: usize) -> Result<Loader> {
        let windows = source.len().saturating_sub(1) / seq_len;
        let val_windows = ((windows as f64 * VALIDATION_FRACTION).ceil() as usize).min(windows.saturating_sub(1));
        let train_windows = windows - val_windows;
        if train_windows < world {
            bail!(
                "the data holds {} tokens, {windows} samples of train.seq_len + 1 = {} tokens: too few for {world} data-parallel rank(s)",
                source.len(),
                seq_len + 1
            );
        }
        let mut loader = Loader {
            source,
            seq_len,
            seed,
            train_windows,
            val_windows,
            rank,
            world,
            order: Vec::new(),
            position: Position::default(),
            window: vec![0; seq_len + 1],
        };
        loader.shuffle();
        Ok(loader)
    }

    fn shuffle(&mut self) {
        self.order = rng::permutation(self.train_windows, self.seed, 0xda7a ^ self.position.epoch);
    }

    /// The current position.
    pub fn position(&self) -> Position {
        self.position
    }

    /// Moves to a saved position.
    pub fn seek(&mut self, position: Position) {
        self.position = position;
        self.shuffle();
    }

    /// Number of training samples per epoch (all ranks together).
    pub fn train_samples(&self) -> usize {
        self.train_windows
    }

    /// Number of validation samples.
    pub fn validation_samples(&self) -> usize {
        self.val_windows
    }

    /// Tokens in the source.
    pub fn source_len(&self) -> usize {
        self.source.len()
    }

    /// Fills `tokens` and `targets` (`batch · seq_len` each) with this rank's next samples.
    pub fn next_batch(&mut self, tokens: &mut [u32], targets: &mut [u32]) {
        let usable = (self.train_windows / self.world) * self.world;
        for (t, y) in tokens.chunks_exact_mut(self.seq_len).zip(targets.chunks_exact_mut(self.seq_len)) {
            if self.position.index as usize + self.world > usable {
                self.position = Position { epoch: self.position.epoch + 1, index: 0 };
                self.shuffle();
            }
            let window = self.order[self.position.index as usize + self.rank] as usize;
            self.position.index += self.world as u64;
            self.read_window(window, t, y);
        }
    }

    /// Fills `tokens` and `targets` with validation sample `index` (modulo their number).
    pub fn validation_batch(&mut self, first: usize, tokens: &mut [u32], targets: &mut [u32]) {
        for (i, (t, y)) in tokens.chunks_exact_mut(self.seq_len).zip(targets.chunks_exact_mut(self.seq_len)).enumerate()
        {
            let window = self.train_windows + (first + i) % self.val_windows.max(1);
            self.read_window(window, t, y);
        }
    }

    fn read_window(&mut self, window: usize, tokens: &mut [u32], targets: &mut [u32]) {
        self.source.read(window * self.seq_len, &mut self.window);
        tokens.copy_from_slice(&self.window[..self.seq_len]);
        targets.copy_from_slice(&self.window[1..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_loader(seq: usize, rank: usize, world: usize) -> Loader {
        Loader::new(Box::new(Bytes(CORPUS)), seq, 7, rank, world).unwrap()
    }

    #[test]
    fn targets_are_the_next_tokens() {
        let mut l = bytes_loader(16, 0, 1);
        let (mut t, mut y) = (vec![0; 32], vec![0; 32]);
        l.next_batch(&mut t, &mut y);
        for s in 0..2 {
            assert_eq!(&t[s * 16 + 1..(s + 1) * 16], &y[s * 16..(s + 1) * 16 - 1]);
        }
    }

    #[test]
    fn positions_resume_exactly_and_epochs_cover_every_window_once() {
        let mut a = bytes_loader(1000, 0, 1);
        let per_epoch = a.train_samples();
        let (mut t, mut y) = (vec![0; 1000], vec![0; 1000]);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..per_epoch {
            a.next_batch(&mut t, &mut y);
            assert!(seen.insert(t.clone()), "a window repeated within an epoch");
        }
        let saved = a.position();
        a.next_batch(&mut t, &mut y);
        let mut b = bytes_loader(1000, 0, 1);
        b.seek(saved);
        let (mut t2, mut y2) = (vec![0; 1000], vec![0; 1000]);
        b.next_batch(&mut t2, &mut y2);
        assert_eq!((t, y), (t2, y2));
    }

    #[test]
    fn ranks_read_disjoint_samples() {
        let (mut r0, mut r1) = (bytes_loader(500, 0, 2), bytes_loader(500, 1, 2));
        let (mut a, mut b, mut y) = (vec![0; 500], vec![0; 500], vec![0; 500]);
        for _ in 0..20 {
            r0.next_batch(&mut a, &mut y);
            r1.next_batch(&mut b, &mut y);
            assert_ne!(a, b);
        }
    }

    #[test]
    fn shard_sources_load_like_any_other() {
        let dir = tempfile::tempdir().unwrap();
        for (name, start) in [("a.tok", 0u32), ("b.tok", 5000)] {
            let mut w = shard::ShardWriter::create(&dir.path().join(name), 70_000, 0).unwrap();
            w.push_document(&(start..start + 5000).collect::<Vec<_>>()).unwrap();
            w.finish().unwrap();
        }
        shard::write_test_manifest(dir.path(), &["a.tok", "b.tok"], 10_000);
        let config = DataConfig { source: DataSource::Shards, path: dir.path().display().to_string() };
        let open_rank = |rank| Loader::new(open(&config, 70_000, 1).unwrap(), 99, 3, rank, 2).unwrap();
        let (mut r0, mut r1) = (open_rank(0), open_rank(1));
        assert_eq!(r0.source_len(), 10_000);
        let (mut a, mut b, mut ya, mut yb) = (vec![0; 99], vec![0; 99], vec![0; 99], vec![0; 99]);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..20 {
            r0.next_batch(&mut a, &mut ya);
            r1.next_batch(&mut b, &mut yb);
            // A window of a stream counting up: consecutive tokens, targets one ahead.
            assert!(a.windows(2).all(|w| w[1] == w[0] + 1) && ya[0] == a[0] + 1);
            assert!(seen.insert(a[0]) && seen.insert(b[0]), "ranks read the same sample");
        }
        let mut resumed = open_rank(0);
        resumed.seek(r0.position());
        r0.next_batch(&mut a, &mut ya);
        resumed.next_batch(&mut b, &mut yb);
        assert_eq!(a, b);
        // The validation windows are the last ones, never trained on.
        r0.validation_batch(0, &mut a, &mut ya);
        assert!(a[0] as usize >= r0.train_samples() * 99);
        let e = open(&config, 60_000, 1).err().unwrap().to_string();
        assert!(e.contains("70000 tokens, more than model.vocab_size = 60000"), "{e}");
    }

    #[test]
    fn byte_tokens_need_a_vocabulary_of_256() {
        let err = open(&DataConfig::default(), 100, 0).err().unwrap().to_string();
        assert!(err.contains("model.vocab_size = 100"), "{err}");
    }
}
