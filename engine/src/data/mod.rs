//! Training data: token sources and the loader that cuts them into samples.
//!
//! A source is a long stream of token ids. The loader cuts it into windows of `seq_len + 1`
//! tokens (inputs and next-token targets overlap by all but one token), keeps the last
//! [`VALIDATION_FRACTION`] of the windows for validation (unless `data.validation_path` names a
//! validation set of its own), and visits the training windows in a seeded random order per
//! epoch. Its position (epoch, index) is exact and resumable, and each data-parallel rank takes
//! a disjoint, interleaved slice of every epoch's order. A weighted mixture of datasets
//! (`data.mixture`) draws each sequence's source by [`mixture`]'s rule, each source keeping its
//! own order and position.
//!
//! Sources: the embedded corpus (byte tokens), synthetic tokens, and memory-mapped token shards
//! ([`shard`]) that `engine data prepare` ([`prepare`]) writes with a real tokenizer
//! ([`tokenizer`], [`sentencepiece`]).

pub mod arrow_ipc;
pub mod mixture;
pub mod prepare;
pub mod readers;
pub mod sentencepiece;
pub mod shard;
pub mod tokenizer;

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};

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

/// Opens the source a data config names (its one source; see [`open_data`] for a mixture),
/// checking it fits the vocabulary.
pub fn open(data: &DataConfig, vocab_size: usize, seed: u64) -> Result<Box<dyn TokenSource>> {
    let source: Box<dyn TokenSource> = match data.source {
        DataSource::Embedded => Box::new(Bytes(CORPUS)),
        DataSource::Synthetic => Box::new(Synthetic { vocab: vocab_size, seed }),
        DataSource::Shards => return Ok(Box::new(open_shards(&data.path, &path_label(data), vocab_size)?)),
    };
    if source.vocab_needed() > vocab_size {
        bail!(
            "data.source = \"embedded\" uses byte tokens 0..255, more than model.vocab_size = {vocab_size}; \
             raise model.vocab_size or use data.source = \"synthetic\""
        );
    }
    Ok(source)
}

/// How errors name `data.path`.
fn path_label(data: &DataConfig) -> String {
    format!("data.path = {}", data.path)
}

/// Opens the shards at `path` (named `label` in errors), checking they fit the vocabulary.
fn open_shards(path: &str, label: &str, vocab_size: usize) -> Result<shard::Shards> {
    let source = shard::Shards::open(Path::new(path)).with_context(|| label.to_owned())?;
    if source.vocab_needed() > vocab_size {
        bail!(
            "the shards in {label} were written with a tokenizer of {} tokens, more than model.vocab_size = {vocab_size}",
            source.vocab_needed()
        );
    }
    Ok(source)
}

/// What identifies each shard's tokens, with its path: the content digest its header records,
/// or, for a shard written before digests, the file itself. Empty shards hold nothing to share.
fn shard_identities(shards: &shard::Shards) -> Vec<(String, &Path)> {
    let key = |s: &shard::Shard| match s.header.has_digest() {
        true => crate::digest::hex(&s.header.digest),
        false => s.path.canonicalize().unwrap_or_else(|_| s.path.clone()).display().to_string(),
    };
    shards.shards().iter().filter(|s| !s.is_empty()).map(|s| (key(s), s.path.as_path())).collect()
}

/// Refuses a validation set that shares shards with the training data (the same directory, or
/// shards copied from it, which the content digests show): `eval_loss` would be measured on
/// samples trained on. `training` holds each training source's label and shards.
fn check_validation_apart(label: &str, validation: &shard::Shards, training: &[(&str, &shard::Shards)]) -> Result<()> {
    let validation = shard_identities(validation);
    for (source, shards) in training {
        let trained: BTreeMap<String, &Path> = shard_identities(shards).into_iter().collect();
        let shared: Vec<String> = validation
            .iter()
            .filter_map(|(key, path)| {
                let twin = trained.get(key)?;
                Some(format!("{} holds the tokens of {}", path.display(), twin.display()))
            })
            .collect();
        if shared.is_empty() {
            continue;
        }
        let shown = shared.len().min(3);
        let more = if shared.len() > shown { format!(" and {} more", shared.len() - shown) } else { String::new() };
        bail!(
            "{label} shares shards with the training data of {source}: {}{more}; eval_loss would be measured on \
             samples trained on. Prepare the validation set from other text, or leave data.validation_path empty \
             to hold out the training data's tail",
            shared[..shown].join(", ")
        );
    }
    Ok(())
}

/// One training source of a run, with its name (in `tokens_by_source` and checkpoints) and weight.
pub struct Named {
    /// The source's name: its path, or the mixture entry's `name`.
    pub name: String,
    /// Its relative share of the sequences (1 for a run's one source).
    pub weight: f64,
    /// Its tokens.
    pub source: Box<dyn TokenSource>,
}

/// The data a run reads, opened: its training sources (one, or each of `data.mixture`'s) and the
/// validation set of `data.validation_path`, if set.
pub struct Data {
    /// The training sources, in `data.mixture`'s order.
    pub sources: Vec<Named>,
    /// Samples to evaluate on instead of a held-out tail of the training data.
    pub validation: Option<Box<dyn TokenSource>>,
    /// Whether the sources are a mixture's (of one source too): drawn by [`mixture`]'s rule,
    /// each with its own position, and counted in `tokens_by_source`.
    pub mixture: bool,
}

impl Data {
    /// One source and no validation set of its own.
    pub fn single(source: Box<dyn TokenSource>) -> Data {
        Data { sources: vec![Named { name: String::new(), weight: 1.0, source }], validation: None, mixture: false }
    }
}

/// Opens everything a data config names: its source or its mixture's, and its validation set.
/// A mixture's missing or unreadable dataset is named by its entry and path.
/// A validation set that shares shards with a training source is refused, naming them.
pub fn open_data(data: &DataConfig, vocab_size: usize, seed: u64) -> Result<Data> {
    // The training sources' shards, with their label, name and weight, kept as shards until the
    // validation set is checked against them.
    let mut shards = Vec::new();
    let mut sources = Vec::new();
    if data.mixture.is_empty() {
        match data.source {
            DataSource::Shards => {
                let label = path_label(data);
                shards.push((open_shards(&data.path, &label, vocab_size)?, label, data.path.clone(), 1.0));
            }
            DataSource::Embedded | DataSource::Synthetic => {
                sources.push(Named { name: String::new(), weight: 1.0, source: open(data, vocab_size, seed)? });
            }
        }
    }
    for (i, m) in data.mixture.iter().enumerate() {
        let label = format!("data.mixture[{i}] (path = {})", m.path);
        shards.push((open_shards(&m.path, &label, vocab_size)?, label, m.name().to_owned(), m.weight));
    }
    let validation = match data.validation_path.as_str() {
        "" => None,
        path => {
            let label = format!("data.validation_path = {path}");
            let validation = open_shards(path, &label, vocab_size)?;
            let training: Vec<(&str, &shard::Shards)> = shards.iter().map(|(s, l, ..)| (l.as_str(), s)).collect();
            check_validation_apart(&label, &validation, &training)?;
            Some(Box::new(validation) as Box<dyn TokenSource>)
        }
    };
    for (source, _, name, weight) in shards {
        sources.push(Named { name, weight, source: Box::new(source) });
    }
    Ok(Data { sources, validation, mixture: !data.mixture.is_empty() })
}

/// What identifies the data a config names, for checkpoints to record and a resumed run to
/// compare ([`shard::fingerprint`]: each shard's name and header hash; a mixture's shards under
/// their source's name); none for the embedded corpus and synthetic tokens, which are fixed by
/// the engine and the seed.
pub fn fingerprint(data: &DataConfig) -> Result<Option<BTreeMap<String, String>>> {
    if !data.mixture.is_empty() {
        let mut all = BTreeMap::new();
        for m in &data.mixture {
            for (shard, header) in shard::fingerprint(Path::new(&m.path))? {
                all.insert(format!("{}/{shard}", m.name().trim_end_matches('/')), header);
            }
        }
        return Ok(Some(all));
    }
    match data.source {
        DataSource::Shards => shard::fingerprint(Path::new(&data.path)).map(Some),
        DataSource::Embedded | DataSource::Synthetic => Ok(None),
    }
}

/// Where a loader is: the epoch and the next index in that epoch's order; for a mixture, the
/// sequences drawn and each source's own position.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Position {
    /// Completed passes over the training windows (0 for a mixture).
    pub epoch: u64,
    /// Next index into this epoch's order (counting all ranks' samples); for a mixture, the
    /// sequences drawn from all sources by all ranks.
    pub index: u64,
    /// A mixture's sources, in `data.mixture`'s order (empty for one source).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourcePosition>,
}

/// Where a mixture's source is: its epoch and the next index in that epoch's order.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourcePosition {
    /// The source's name.
    pub name: String,
    /// Completed passes over its training windows.
    pub epoch: u64,
    /// Next index into its epoch's order (counting all ranks' samples).
    pub index: u64,
}

/// One source as the loader reads it: its windows and its own seeded order per epoch.
struct Stream {
    name: String,
    source: Box<dyn TokenSource>,
    train_windows: usize,
    val_windows: usize,
    /// Salt of its orders' [`rng::permutation`] stream (0 for a run's one source).
    salt: u64,
    order: Vec<u32>,
    epoch: u64,
    index: u64,
}

impl Stream {
    fn shuffle(&mut self, seed: u64) {
        self.order = rng::permutation(self.train_windows, seed, 0xda7a ^ self.epoch ^ self.salt);
    }

    /// The next window of its order (a mixture's sources each count their own draws).
    fn take(&mut self, seed: u64) -> usize {
        if self.index as usize == self.train_windows {
            (self.epoch, self.index) = (self.epoch + 1, 0);
            self.shuffle(seed);
        }
        self.index += 1;
        self.order[self.index as usize - 1] as usize
    }
}

/// A mixture's state besides its streams: the choice of source and the sequences drawn.
struct Mix {
    train: mixture::Mixture,
    /// Sequences drawn by all ranks.
    drawn: u64,
    /// The validation samples' sources and windows, chosen like training's ([`mixture`]) over
    /// each source's held-out tail, computed as far as evaluations have read.
    val: mixture::Mixture,
    val_picks: Vec<(usize, usize)>,
    val_counts: Vec<usize>,
}

/// Cuts sources into shuffled samples of `seq_len + 1` tokens.
pub struct Loader {
    streams: Vec<Stream>,
    /// For several sources: which one each sequence comes from.
    mix: Option<Mix>,
    /// The validation set of its own (`data.validation_path`) and its windows.
    validation: Option<(Box<dyn TokenSource>, usize)>,
    seq_len: usize,
    seed: u64,
    rank: usize,
    world: usize,
    window: Vec<u32>,
}

impl Loader {
    /// A loader over `source`; this rank reads samples `rank, rank + world, ...` of each epoch.
    pub fn new(source: Box<dyn TokenSource>, seq_len: usize, seed: u64, rank: usize, world: usize) -> Result<Loader> {
        Loader::open(Data::single(source), seq_len, seed, rank, world)
    }

    /// A loader over `data`'s sources. With a validation set of its own, no training window is
    /// held out; else each source's last [`VALIDATION_FRACTION`] of windows is.
    pub fn open(data: Data, seq_len: usize, seed: u64, rank: usize, world: usize) -> Result<Loader> {
        let mixed = data.mixture || data.sources.len() > 1;
        let own_validation = data.validation.is_some();
        let weights: Vec<f64> = data.sources.iter().map(|s| s.weight).collect();
        let mut streams = Vec::new();
        for (i, Named { name, source, .. }) in data.sources.into_iter().enumerate() {
            let windows = source.len().saturating_sub(1) / seq_len;
            let val_windows = match own_validation {
                true => 0,
                false => ((windows as f64 * VALIDATION_FRACTION).ceil() as usize).min(windows.saturating_sub(1)),
            };
            let train_windows = windows - val_windows;
            if !mixed && train_windows < world {
                bail!(
                    "the data holds {} tokens, {windows} samples of train.seq_len + 1 = {} tokens: too few for {world} data-parallel rank(s)",
                    source.len(),
                    seq_len + 1
                );
            }
            // A mixture's ranks share every source's draws: one sample (and one held out) will do.
            if mixed && (train_windows == 0 || (!own_validation && val_windows == 0)) {
                bail!(
                    "data.mixture[{i}] ({name}) holds {} tokens, {windows} samples of train.seq_len + 1 = {} tokens: too few for a training sample and a held-out one",
                    source.len(),
                    seq_len + 1
                );
            }
            let salt = if mixed { (i as u64 + 1) << 48 } else { 0 };
            let mut stream =
                Stream { name, source, train_windows, val_windows, salt, order: Vec::new(), epoch: 0, index: 0 };
            stream.shuffle(seed);
            streams.push(stream);
        }
        let validation = match data.validation {
            Some(v) => match v.len().saturating_sub(1) / seq_len {
                0 => bail!(
                    "data.validation_path holds {} tokens, less than one sample of train.seq_len + 1 = {} tokens",
                    v.len(),
                    seq_len + 1
                ),
                windows => Some((v, windows)),
            },
            None => None,
        };
        let mix = mixed.then(|| Mix {
            train: mixture::Mixture::new(&weights, seed, mixture::TRAIN_STREAM),
            drawn: 0,
            val: mixture::Mixture::new(&weights, seed, mixture::VALIDATION_STREAM),
            val_picks: Vec::new(),
            val_counts: vec![0; weights.len()],
        });
        Ok(Loader { streams, mix, validation, seq_len, seed, rank, world, window: vec![0; seq_len + 1] })
    }

    /// The current position.
    pub fn position(&self) -> Position {
        match &self.mix {
            None => Position { epoch: self.streams[0].epoch, index: self.streams[0].index, sources: Vec::new() },
            Some(mix) => Position {
                epoch: 0,
                index: mix.drawn,
                sources: self
                    .streams
                    .iter()
                    .map(|s| SourcePosition { name: s.name.clone(), epoch: s.epoch, index: s.index })
                    .collect(),
            },
        }
    }

    /// Moves to a saved position; one that does not fit this data (past its samples, another
    /// mixture) is refused.
    pub fn seek(&mut self, position: &Position) -> Result<()> {
        match &mut self.mix {
            None => {
                let s = &mut self.streams[0];
                if !position.sources.is_empty() {
                    bail!("its data position is a mixture's of {} sources, this run reads one", position.sources.len());
                }
                if position.index > s.train_windows as u64 {
                    bail!(
                        "its data position (sample {} of epoch {}) is past the {} training samples of the data",
                        position.index,
                        position.epoch,
                        s.train_windows
                    );
                }
                (s.epoch, s.index) = (position.epoch, position.index);
            }
            Some(mix) => {
                let names = |v: Vec<&str>| v.join(", ");
                if position.sources.iter().map(|p| &p.name).ne(self.streams.iter().map(|s| &s.name)) {
                    bail!(
                        "its data position is over the sources [{}], this run's mixture is [{}]",
                        names(position.sources.iter().map(|p| p.name.as_str()).collect()),
                        names(self.streams.iter().map(|s| s.name.as_str()).collect())
                    );
                }
                for (s, p) in self.streams.iter_mut().zip(&position.sources) {
                    if p.index > s.train_windows as u64 {
                        bail!(
                            "its data position in source {} (sample {} of epoch {}) is past its {} training samples",
                            s.name,
                            p.index,
                            p.epoch,
                            s.train_windows
                        );
                    }
                    (s.epoch, s.index) = (p.epoch, p.index);
                }
                mix.drawn = position.index;
            }
        }
        for s in &mut self.streams {
            s.shuffle(self.seed);
        }
        Ok(())
    }

    /// Number of training samples per epoch (all ranks together; all sources together).
    pub fn train_samples(&self) -> usize {
        self.streams.iter().map(|s| s.train_windows).sum()
    }

    /// Number of validation samples.
    pub fn validation_samples(&self) -> usize {
        match &self.validation {
            Some((_, windows)) => *windows,
            None => self.streams.iter().map(|s| s.val_windows).sum(),
        }
    }

    /// How many validation samples [`Loader::validation_batch`] reads before it reads one of them
    /// again (samples `0..n` are all distinct), and what they are, for messages. A mixture draws
    /// each sample's source by the weights, so one source's tail can run out before the others':
    /// its draws count up to the first that would read a sample of a spent tail again.
    pub fn distinct_validation_samples(&self) -> (usize, String) {
        if let Some((_, windows)) = &self.validation {
            return (*windows, "the validation set (data.validation_path)".into());
        }
        let percent = VALIDATION_FRACTION * 100.0;
        let Some(mix) = &self.mix else {
            return (self.streams[0].val_windows, format!("the held-out tail (the last {percent} %) of the data"));
        };
        let total: usize = self.streams.iter().map(|s| s.val_windows).sum();
        let mut counts = vec![0; self.streams.len()];
        for n in 0..total {
            let i = mix.val.source(n as u64);
            if counts[i] == self.streams[i].val_windows {
                let spent = &self.streams[i];
                return (
                    n,
                    format!(
                        "the held-out tails (the last {percent} %) of the mixture's sources, drawn by the weights until the {} of source {} are spent",
                        spent.val_windows, spent.name
                    ),
                );
            }
            counts[i] += 1;
        }
        (total, format!("the held-out tails (the last {percent} %) of the mixture's sources"))
    }

    /// Tokens in the training sources.
    pub fn source_len(&self) -> usize {
        self.streams.iter().map(|s| s.source.len()).sum()
    }

    /// For a mixture: the tokens trained on from each source, all ranks together (each sample
    /// trains `seq_len` tokens); none for one source.
    pub fn tokens_by_source(&self) -> Option<BTreeMap<String, u64>> {
        self.mix.as_ref()?;
        let tokens = |s: &Stream| (s.epoch * s.train_windows as u64 + s.index) * self.seq_len as u64;
        Some(self.streams.iter().map(|s| (s.name.clone(), tokens(s))).collect())
    }

    /// Fills `tokens` and `targets` (`batch · seq_len` each) with this rank's next samples.
    pub fn next_batch(&mut self, tokens: &mut [u32], targets: &mut [u32]) {
        for (t, y) in tokens.chunks_exact_mut(self.seq_len).zip(targets.chunks_exact_mut(self.seq_len)) {
            let (stream, window) = match &mut self.mix {
                // One source: rank r takes index r of each group of `world`, all from one epoch.
                None => {
                    let s = &mut self.streams[0];
                    let usable = (s.train_windows / self.world) * self.world;
                    if s.index as usize + self.world > usable {
                        (s.epoch, s.index) = (s.epoch + 1, 0);
                        s.shuffle(self.seed);
                    }
                    let window = s.order[s.index as usize + self.rank] as usize;
                    s.index += self.world as u64;
                    (0, window)
                }
                // A mixture: every rank draws the whole row's sequences, so that all sources'
                // positions advance alike everywhere, and keeps its own.
                Some(mix) => {
                    let mut mine = (0, 0);
                    for r in 0..self.world {
                        let i = mix.train.source(mix.drawn + r as u64);
                        let window = self.streams[i].take(self.seed);
                        if r == self.rank {
                            mine = (i, window);
                        }
                    }
                    mix.drawn += self.world as u64;
                    mine
                }
            };
            read_window(&*self.streams[stream].source, window, &mut self.window, t, y);
        }
    }

    /// Fills `tokens` and `targets` with validation sample `index` (modulo their number): from
    /// `data.validation_path` when set, else from the held-out tail (of each source, for a
    /// mixture, chosen by the weights as training's samples are).
    pub fn validation_batch(&mut self, first: usize, tokens: &mut [u32], targets: &mut [u32]) {
        for (i, (t, y)) in tokens.chunks_exact_mut(self.seq_len).zip(targets.chunks_exact_mut(self.seq_len)).enumerate()
        {
            let n = first + i;
            if let Some((source, windows)) = &self.validation {
                read_window(&**source, n % windows, &mut self.window, t, y);
                continue;
            }
            let (stream, k) = match &mut self.mix {
                None => (0, n % self.streams[0].val_windows.max(1)),
                Some(mix) => {
                    while mix.val_picks.len() <= n {
                        let i = mix.val.source(mix.val_picks.len() as u64);
                        mix.val_picks.push((i, mix.val_counts[i] % self.streams[i].val_windows));
                        mix.val_counts[i] += 1;
                    }
                    mix.val_picks[n]
                }
            };
            let s = &self.streams[stream];
            read_window(&*s.source, s.train_windows + k, &mut self.window, t, y);
        }
    }
}

/// Reads window `index` of `source` (through `scratch`, `seq_len + 1` tokens) into `tokens`
/// and the next tokens, `targets`.
fn read_window(source: &dyn TokenSource, index: usize, scratch: &mut [u32], tokens: &mut [u32], targets: &mut [u32]) {
    let seq_len = tokens.len();
    source.read(index * seq_len, scratch);
    tokens.copy_from_slice(&scratch[..seq_len]);
    targets.copy_from_slice(&scratch[1..]);
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
        b.seek(&saved).unwrap();
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
        let config =
            DataConfig { source: DataSource::Shards, path: dir.path().display().to_string(), ..Default::default() };
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
        resumed.seek(&r0.position()).unwrap();
        r0.next_batch(&mut a, &mut ya);
        resumed.next_batch(&mut b, &mut yb);
        assert_eq!(a, b);
        // The validation windows are the last ones, never trained on.
        r0.validation_batch(0, &mut a, &mut ya);
        assert!(a[0] as usize >= r0.train_samples() * 99);
        let e = open(&config, 60_000, 1).err().unwrap().to_string();
        assert!(e.contains("70000 tokens, more than model.vocab_size = 60000"), "{e}");
    }

    /// Tokens `base, base + 1, ...`: a sample's first token says which source and window it is.
    struct Counting(u32, usize);

    impl TokenSource for Counting {
        fn len(&self) -> usize {
            self.1
        }
        fn read(&self, start: usize, out: &mut [u32]) {
            for (i, o) in out.iter_mut().enumerate() {
                *o = self.0 + (start + i) as u32;
            }
        }
        fn vocab_needed(&self) -> usize {
            (self.0 as usize) + self.1
        }
    }

    const SEQ: usize = 8;

    /// Sources A (tokens from 0, 75 %) and B (tokens from 1,000,000, 25 %), and maybe a
    /// validation set (tokens from 2,000,000).
    fn mixture(validation: bool) -> Data {
        let named = |name: &str, weight, base, len| Named {
            name: name.into(),
            weight,
            source: Box::new(Counting(base, len)) as _,
        };
        let validation = validation.then(|| Box::new(Counting(2_000_000, 81)) as Box<dyn TokenSource>);
        Data { sources: vec![named("a/", 3.0, 0, 801), named("b", 1.0, 1_000_000, 401)], validation, mixture: true }
    }

    /// `steps` batches of 4 sequences on each of `world` ranks: each rank's first tokens.
    fn draw(loaders: &mut [Loader], steps: usize) -> Vec<Vec<u32>> {
        let (mut t, mut y) = (vec![0; 4 * SEQ], vec![0; 4 * SEQ]);
        let mut firsts = vec![Vec::new(); loaders.len()];
        for _ in 0..steps {
            for (l, f) in loaders.iter_mut().zip(&mut firsts) {
                l.next_batch(&mut t, &mut y);
                assert_eq!(&t[1..SEQ], &y[..SEQ - 1]);
                f.extend(t.chunks(SEQ).map(|s| s[0]));
            }
        }
        firsts
    }

    /// A mixture of 0.75/0.25 over 200 steps draws within 5 % of those shares (on one rank and
    /// on two, whose draws are disjoint and agree on every source's count); the same seed draws
    /// the same samples, and a loader moved to a saved position draws what the uninterrupted one
    /// does, through the sources' epoch ends.
    #[test]
    fn a_mixture_draws_its_shares_deterministically_and_resumes_exactly() {
        for world in [1, 2] {
            let open =
                || (0..world).map(|r| Loader::open(mixture(false), SEQ, 5, r, world).unwrap()).collect::<Vec<_>>();
            let mut whole = open();
            let firsts = draw(&mut whole, 200);
            // In the order drawn: sequence g is row g / world of rank g % world.
            let all: Vec<u32> = (0..firsts[0].len()).flat_map(|i| firsts.iter().map(move |f| f[i])).collect();
            let count_a = all.iter().filter(|&&f| f < 1_000_000).count();
            let from_a = count_a as f64 / all.len() as f64;
            assert!((from_a - 0.75).abs() <= 0.05 * 0.25, "world {world}: {from_a} of the samples from a");
            let tokens = whole[0].tokens_by_source().unwrap();
            assert!(whole.iter().all(|l| l.tokens_by_source().unwrap() == tokens), "ranks disagree on the counts");
            assert_eq!(tokens["a/"], (count_a * SEQ) as u64);
            assert_eq!(tokens["a/"] + tokens["b"], (all.len() * SEQ) as u64);
            // 100 training windows in b: the 200 steps went through several of its epochs.
            assert_eq!(whole[0].position().sources[1].epoch, (tokens["b"] / SEQ as u64 - 1) / 47);
            // Within one epoch of a source, no window twice (here: b's first 47 draws).
            let b_firsts: Vec<u32> = all.iter().copied().filter(|&f| f >= 1_000_000).take(47).collect();
            assert_eq!(b_firsts.iter().collect::<std::collections::HashSet<_>>().len(), 47);
            if world == 2 {
                let (r0, r1): (std::collections::HashSet<_>, std::collections::HashSet<_>) =
                    (firsts[0][..40].iter().collect(), firsts[1][..40].iter().collect());
                assert!(r0.is_disjoint(&r1), "ranks read the same sample");
            }
            assert_eq!(draw(&mut open(), 200), firsts, "world {world}: a second run drew other samples");

            let mut first_half = open();
            draw(&mut first_half, 100);
            let saved = first_half[0].position();
            let json = serde_json::to_string(&saved).unwrap();
            let mut resumed = open();
            for l in &mut resumed {
                l.seek(&serde_json::from_str(&json).unwrap()).unwrap();
            }
            let rest = draw(&mut resumed, 100);
            for (r, f) in rest.iter().enumerate() {
                assert_eq!(f[..], firsts[r][400..], "world {world}, rank {r}: the resumed draws differ");
            }
        }
        // Another mixture's position is refused, naming the sources.
        let mut l = Loader::open(mixture(false), SEQ, 5, 0, 1).unwrap();
        let mut other = l.position();
        other.sources[1].name = "c".into();
        let e = l.seek(&other).unwrap_err().to_string();
        assert!(e.contains("over the sources [a/, c], this run's mixture is [a/, b]"), "{e}");
        other.sources[1].name = "b".into();
        other.sources[1].index = 48;
        assert!(l.seek(&other).unwrap_err().to_string().contains("source b (sample 48 of epoch 0) is past its 47"));
    }

    /// A mixture evaluates on each source's held-out tail, in the weights' proportions; a
    /// validation set of its own replaces the tails, which are then trained on.
    #[test]
    fn validation_reads_the_tails_or_the_validation_set() {
        let mut l = Loader::open(mixture(false), SEQ, 5, 0, 1).unwrap();
        assert_eq!((l.train_samples(), l.validation_samples()), (95 + 47, 5 + 3));
        let (mut t, mut y) = (vec![0; 40 * SEQ], vec![0; 40 * SEQ]);
        l.validation_batch(0, &mut t, &mut y);
        let firsts: Vec<u32> = t.chunks(SEQ).map(|s| s[0]).collect();
        let from_a = firsts.iter().filter(|&&f| f < 1_000_000).count();
        assert!((28..=32).contains(&from_a), "{from_a} of 40 validation samples from a");
        assert!(firsts.iter().all(|&f| f >= 95 * SEQ as u32 && (f < 1_000_000 || f >= 1_000_000 + 47 * SEQ as u32)));
        let (mut t2, mut y2) = (vec![0; 40 * SEQ], vec![0; 40 * SEQ]);
        l.validation_batch(0, &mut t2, &mut y2);
        assert_eq!(t, t2, "evaluations read other samples");

        let mut own = Loader::open(mixture(true), SEQ, 5, 0, 1).unwrap();
        assert_eq!((own.train_samples(), own.validation_samples()), (100 + 50, 10));
        own.validation_batch(3, &mut t, &mut y);
        let firsts: Vec<u32> = t.chunks(SEQ).map(|s| s[0]).collect();
        assert!(firsts.iter().enumerate().all(|(i, &f)| f == 2_000_000 + ((3 + i) % 10 * SEQ) as u32), "{firsts:?}");
        assert_eq!(y[0], t[0] + 1);
        // One source with a validation set: no tail held out; as a mixture of one, it is counted.
        let one = |mixed| Data {
            sources: mixture(true).sources.into_iter().take(1).collect(),
            mixture: mixed,
            ..mixture(true)
        };
        let l = Loader::open(one(false), SEQ, 5, 0, 1).unwrap();
        assert_eq!((l.train_samples(), l.validation_samples(), l.tokens_by_source()), (100, 10, None));
        let mut l = Loader::open(one(true), SEQ, 5, 0, 1).unwrap();
        l.next_batch(&mut t, &mut y);
        assert_eq!(l.tokens_by_source(), Some([("a/".to_owned(), 40 * SEQ as u64)].into()));
        assert_eq!(l.position().sources.len(), 1);
    }

    /// The distinct validation samples: the validation set's, one source's tail, or a mixture's
    /// draws up to the first that would read a spent tail's sample again (source a's 5 samples,
    /// at 75 % of the draws, run out before b's 3): exactly where `validation_batch` first reads
    /// a sample it read before.
    #[test]
    fn distinct_validation_samples_end_where_a_sample_comes_round_again() {
        let first_repeat = |l: &mut Loader, n: usize| {
            let (mut t, mut y) = (vec![0; n * SEQ], vec![0; n * SEQ]);
            l.validation_batch(0, &mut t, &mut y);
            let firsts: Vec<u32> = t.chunks(SEQ).map(|s| s[0]).collect();
            (0..n).find(|&i| firsts[..i].contains(&firsts[i])).unwrap()
        };
        let mut mixed = Loader::open(mixture(false), SEQ, 5, 0, 1).unwrap();
        let (n, what) = mixed.distinct_validation_samples();
        assert!(n < 5 + 3 && what.contains("until the 5 of source a/ are spent"), "{n}: {what}");
        assert_eq!(first_repeat(&mut mixed, 20), n);
        let mut own = Loader::open(mixture(true), SEQ, 5, 0, 1).unwrap();
        assert_eq!(own.distinct_validation_samples(), (10, "the validation set (data.validation_path)".into()));
        assert_eq!(first_repeat(&mut own, 20), 10);
        let mut one = Loader::new(Box::new(Counting(0, 801)), SEQ, 5, 0, 1).unwrap();
        let (n, what) = one.distinct_validation_samples();
        assert_eq!((n, what.as_str()), (5, "the held-out tail (the last 5 %) of the data"));
        assert_eq!(first_repeat(&mut one, 20), 5);
    }

    /// A validation set that is the training data, or holds a copy of one of its shards, made
    /// `eval_loss` measure samples trained on, without a word; it is refused, naming the shards.
    #[test]
    fn a_validation_set_sharing_shards_with_the_training_data_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let prepared = |name: &str, shards: &[(&str, u32)]| {
            let d = dir.path().join(name);
            std::fs::create_dir(&d).unwrap();
            for &(shard, start) in shards {
                let mut w = shard::ShardWriter::create(&d.join(shard), 70_000, 0).unwrap();
                w.push_document(&(start..start + 500).collect::<Vec<_>>()).unwrap();
                w.finish().unwrap();
            }
            let names: Vec<&str> = shards.iter().map(|(n, _)| *n).collect();
            shard::write_test_manifest(&d, &names, 500 * shards.len() as u64);
            d.display().to_string()
        };
        let train = prepared("train", &[("a.tok", 0), ("b.tok", 1000)]);
        let copied = prepared("val", &[("x.tok", 5000), ("y.tok", 1000)]);
        let apart = prepared("apart", &[("x.tok", 5000)]);
        let config = |validation: &str, mixture: bool| DataConfig {
            source: DataSource::Shards,
            path: if mixture { String::new() } else { train.clone() },
            mixture: match mixture {
                true => vec![crate::config::MixtureSource { path: apart.clone(), weight: 1.0, name: "m".into() }],
                false => Vec::new(),
            },
            validation_path: validation.to_owned(),
            ..Default::default()
        };
        let refused =
            |validation: &str, mixture| open_data(&config(validation, mixture), 70_000, 1).err().unwrap().to_string();
        let e = refused(&train, false);
        let shared =
            format!("{train}/a.tok holds the tokens of {train}/a.tok, {train}/b.tok holds the tokens of {train}/b.tok");
        assert!(e.starts_with(&format!("data.validation_path = {train} shares shards with the training data of data.path = {train}: {shared}; eval_loss would be measured on samples trained on.")), "{e}");
        let e = refused(&copied, false);
        assert!(
            e.contains(&format!("of data.path = {train}: {copied}/y.tok holds the tokens of {train}/b.tok;")),
            "{e}"
        );
        let e = refused(&apart, true);
        assert!(e.contains(&format!("of data.mixture[0] (path = {apart}): {apart}/x.tok holds")), "{e}");
        let data = open_data(&config(&apart, false), 70_000, 1).unwrap();
        assert_eq!((data.sources.len(), data.validation.unwrap().len()), (1, 500));
    }

    #[test]
    fn byte_tokens_need_a_vocabulary_of_256() {
        let err = open(&DataConfig::default(), 100, 0).err().unwrap().to_string();
        assert!(err.contains("model.vocab_size = 100"), "{err}");
    }
}
