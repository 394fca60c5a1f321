//! The flight recorder of collectives (PyTorch's NCCL flight recorder, for this engine): every
//! rank keeps its last N collective operations, and writes them down when the job breaks, so
//! that a hang says where each rank was, not only which rank did not answer.
//!
//! - **What is kept.** [`Flight`] wraps any [`Collectives`] (TCP, NCCL, virtual devices) and
//!   records each operation in a ring of `train.diagnostics.flight_recorder` slots
//!   ([`Recorder`]): its sequence number on this rank (every rank issues the job's collectives
//!   in the same order, so the same number is the same operation everywhere), its name, its
//!   group (and the mesh's name for it: `fsdp`, `tensor`, ...), its elements, its start and end
//!   times and the optimizer step. A started operation ([`Collectives::all_reduce_sum_start`])
//!   ends at the [`Collectives::wait`] that collects it. The slots are allocated once; a
//!   record is two clock reads and two uncontended locks beside an operation that moves data
//!   between processes (docs/PERF.md measures it).
//! - **When it is written.** On a watchdog timeout or a peer's departure (the TCP and NCCL
//!   watchdogs call [`on_failure`] before the rank exits with 75), and on SIGUSR2 (the rank
//!   goes on), each rank writes `RUN_DIR/flight/rank-R.json` ([`Record`]) atomically.
//! - **What it tells.** [`diagnose`] reads a directory of records and says, as of the moment the
//!   first rank gave up, which collective each rank was in, at which sequence number, which
//!   rank is behind (the first rank whose sequence is lowest), and the first sequence number at
//!   which ranks ran different operations (a rank that skipped or added one). `engine launch`
//!   prints it when a job fails, rank 0 does when no launcher does, and `engine flight RUN_DIR`
//!   prints it offline.
//!
//! **Test hook.** `ENGINE_TEST_FLIGHT_SKIP=RANK:STEP:OP` ([`SKIP_HOOK`]) makes rank `RANK` skip
//! the first operation named `OP` (`all-reduce`, `all-gather`, ...) of step `STEP`, as a code
//! path that forgot a collective: it is neither run nor recorded.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::comm::Collectives;
use crate::backend::{Backend, View};

/// The test hook's variable (see the [module documentation](self)).
pub const SKIP_HOOK: &str = "ENGINE_TEST_FLIGHT_SKIP";

/// Set by `engine launch` for its processes when it prints the diagnosis itself (it knows the
/// run directory): rank 0 then does not print it too.
pub const LAUNCHER_DIAGNOSES: &str = "ENGINE_LAUNCH_DIAGNOSES";

/// The records' folder in a run directory.
pub const DIR: &str = "flight";

/// Microseconds since the Unix epoch: the records of different hosts compare by it (their clocks
/// agree to milliseconds under NTP; the watchdog's timeouts are seconds).
pub fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// One operation in the ring, as recorded (no allocation once the ring is full: a slot's group
/// is reused).
struct Slot {
    seq: u64,
    op: &'static str,
    group: Vec<usize>,
    elements: u64,
    start_us: u64,
    /// 0 until the operation has completed.
    end_us: u64,
    step: u64,
}

/// The last `capacity` operations of a rank, and what names them.
struct Ring {
    slots: Vec<Slot>,
    capacity: usize,
    /// Operations recorded so far: the next one's sequence number.
    next: u64,
    step: u64,
    names: Vec<(Vec<usize>, String)>,
}

impl Ring {
    fn begin(&mut self, op: &'static str, group: &[usize], elements: usize) -> u64 {
        let seq = self.next;
        self.next += 1;
        if self.capacity == 0 {
            return seq;
        }
        let (step, start_us) = (self.step, now_us());
        let i = (seq % self.capacity as u64) as usize;
        if i == self.slots.len() {
            self.slots.push(Slot {
                seq,
                op,
                group: group.to_vec(),
                elements: elements as u64,
                start_us,
                end_us: 0,
                step,
            });
        } else {
            let slot = &mut self.slots[i];
            slot.group.clear();
            slot.group.extend_from_slice(group);
            (slot.seq, slot.op, slot.elements, slot.start_us, slot.end_us, slot.step) =
                (seq, op, elements as u64, start_us, 0, step);
        }
        seq
    }

    fn end(&mut self, seq: u64) {
        if self.capacity > 0 && self.next - seq <= self.capacity as u64 {
            let slot = &mut self.slots[(seq % self.capacity as u64) as usize];
            if slot.seq == seq {
                slot.end_us = now_us();
            }
        }
    }
}

/// One rank's recorder: its ring, and where its record goes.
pub struct Recorder {
    rank: usize,
    world: usize,
    ring: Mutex<Ring>,
    /// `RUN_DIR/flight`; `None` where there is no run directory to write to (virtual devices
    /// measured by `engine bench`).
    dir: Option<PathBuf>,
    started_us: u64,
}

impl Recorder {
    /// A recorder of the last `capacity` operations of `rank` of `world`, writing to `dir`.
    pub fn new(rank: usize, world: usize, capacity: usize, dir: Option<PathBuf>) -> Arc<Recorder> {
        let ring = Ring { slots: Vec::with_capacity(capacity), capacity, next: 0, step: 0, names: Vec::new() };
        Arc::new(Recorder { rank, world, ring: Mutex::new(ring), dir, started_us: now_us() })
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        // A panic elsewhere while the ring was held leaves it consistent: every update is whole.
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the ring holds, oldest first, with `reason` and the ranks it suspects.
    pub fn record(&self, reason: &str, suspects: &[usize], failed: bool) -> Record {
        let ring = self.ring();
        let mut entries: Vec<Entry> = ring
            .slots
            .iter()
            .map(|s| Entry {
                seq: s.seq,
                op: s.op.to_owned(),
                axis: ring.names.iter().find(|(g, _)| *g == s.group).map(|(_, n)| n.clone()),
                group: s.group.clone(),
                elements: s.elements,
                start_unix_us: s.start_us,
                end_unix_us: (s.end_us != 0).then_some(s.end_us),
                step: s.step,
            })
            .collect();
        entries.sort_by_key(|e| e.seq);
        Record {
            rank: self.rank,
            world: self.world,
            reason: reason.to_owned(),
            failed,
            suspects: suspects.to_vec(),
            started_unix_us: self.started_us,
            written_unix_us: now_us(),
            step: ring.step,
            operations: ring.next,
            capacity: ring.capacity,
            entries,
        }
    }

    /// Writes the record to `RUN_DIR/flight/rank-R.json` (atomically: a reader sees a whole file
    /// or none); returns its path, or `None` without a run directory.
    pub fn dump(&self, reason: &str, suspects: &[usize], failed: bool) -> Result<Option<PathBuf>> {
        let Some(dir) = &self.dir else { return Ok(None) };
        let record = self.record(reason, suspects, failed);
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let path = dir.join(format!("rank-{}.json", self.rank));
        crate::fsutil::write_atomic(&path, serde_json::to_string_pretty(&record)?.as_bytes())?;
        Ok(Some(path))
    }
}

/// The recorder of this process's rank, for the watchdogs and SIGUSR2 ([`install`]).
static PROCESS: Mutex<Option<Arc<Recorder>>> = Mutex::new(None);

/// Makes `recorder` the one this process's watchdog and SIGUSR2 write.
pub fn install(recorder: Arc<Recorder>) {
    *PROCESS.lock().unwrap_or_else(|p| p.into_inner()) = Some(recorder);
}

/// Writes this process's record (if it keeps one), saying where; `reason`, `suspects` (the
/// ranks the caller waited for, if it knows) and whether the rank `failed` (else it goes on)
/// go into the record.
pub fn dump_process(reason: &str, suspects: &[usize], failed: bool) -> Option<PathBuf> {
    let recorder = PROCESS.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
    match recorder.dump(reason, suspects, failed) {
        Ok(Some(path)) => {
            crate::say!("rank {}: flight record of its last collectives in {}", recorder.rank, path.display());
            Some(path)
        }
        Ok(None) => None,
        Err(e) => {
            crate::say!("rank {}: could not write its flight record: {e:#}", recorder.rank);
            None
        }
    }
}

/// Called by a watchdog before the rank exits: writes the record, and on rank 0, when no
/// launcher prints the diagnosis ([`LAUNCHER_DIAGNOSES`]), waits a moment for the others'
/// records (they fail within moments: this rank's peers are told it stops) and prints it.
pub fn on_failure(reason: &str, suspects: &[usize]) {
    let Some(path) = dump_process(reason, suspects, true) else { return };
    let recorder = PROCESS.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let Some(recorder) = recorder else { return };
    if recorder.rank != 0 || std::env::var_os(LAUNCHER_DIAGNOSES).is_some() {
        return;
    }
    let dir = path.parent().expect("a record's folder").to_path_buf();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline && read_records(&dir, recorder.started_us).map_or(0, |r| r.len()) < recorder.world {
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Ok(d) = diagnose_since(&dir, recorder.started_us) {
        crate::say!("{d}");
    }
}

/// A rank's record, as written to `RUN_DIR/flight/rank-R.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// The rank that wrote it.
    pub rank: usize,
    /// The job's size.
    pub world: usize,
    /// Why it was written: the watchdog's line, a peer's departure, `SIGUSR2`.
    pub reason: String,
    /// Whether the rank gave up (a watchdog), rather than being asked for its record (SIGUSR2).
    pub failed: bool,
    /// The ranks this rank was waiting for when it gave up, where it knows them.
    pub suspects: Vec<usize>,
    /// When the rank's process started recording.
    pub started_unix_us: u64,
    /// When it wrote this.
    pub written_unix_us: u64,
    /// The optimizer step in progress.
    pub step: u64,
    /// Operations recorded since the start (the ring holds the last `capacity`).
    pub operations: u64,
    /// The ring's size (`train.diagnostics.flight_recorder`).
    pub capacity: usize,
    /// The operations the ring holds, oldest first.
    pub entries: Vec<Entry>,
}

/// One collective operation of a rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Its number among the rank's operations, from 0.
    pub seq: u64,
    /// `all-reduce`, `all-reduce (max)`, `reduce-scatter`, `all-gather`, `all-reduce (started)`,
    /// `all-gather (started)`, `send/recv`.
    pub op: String,
    /// The mesh's name for its group, if it has one.
    pub axis: Option<String>,
    /// Its ranks (for `send/recv`: this rank and its peers).
    pub group: Vec<usize>,
    /// Elements of this rank's input (the sum of its messages for `send/recv`).
    pub elements: u64,
    /// When this rank called it.
    pub start_unix_us: u64,
    /// `None`: it had not completed when the record was written.
    pub end_unix_us: Option<u64>,
    /// The optimizer step it belongs to (0: before the first).
    pub step: u64,
}

impl Entry {
    /// `#57 all-reduce over the data axis (ranks [0, 1]), 1234 elements, step 3`.
    fn describe(&self) -> String {
        let over = match &self.axis {
            Some(axis) => format!("the {} axis (ranks {:?})", printable(axis), self.group),
            None => format!("ranks {:?}", self.group),
        };
        format!("#{} {} over {over}, {} elements, step {}", self.seq, printable(&self.op), self.elements, self.step)
    }

    /// What another rank must agree on for the same sequence number: the operation, the axis
    /// and the size (the group itself differs from rank to rank: each is in its own).
    fn kind(&self) -> (&str, Option<&str>, usize, u64) {
        (&self.op, self.axis.as_deref(), self.group.len(), self.elements)
    }
}

/// The largest job a record may describe (a record's `world`): beyond any machine trained on
/// (the largest are some 10^5 devices), and small enough that listing its ranks is bounded.
pub const MAX_WORLD: usize = 1 << 20;

/// The longest record read: a ring of `train.diagnostics.flight_recorder` (at most 2^16)
/// entries is a few MiB.
pub const MAX_RECORD_BYTES: u64 = 64 << 20;

/// The most bytes of records read from one folder together.
pub const MAX_RECORDS_BYTES: u64 = 1 << 30;

/// Every `rank-R.json` of `dir` written at or after `since` (an earlier attempt's are stale),
/// by rank. A file that does not parse, is longer than [`MAX_RECORD_BYTES`], or disagrees with
/// its name (its rank) or the others (the world, at most [`MAX_WORLD`]) is an error naming it.
fn read_records(dir: &Path, since: u64) -> Result<Vec<Record>> {
    let mut records: Vec<(Record, PathBuf)> = Vec::new();
    let mut total = 0u64;
    let listing = std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    for entry in listing {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let Some(named) = name.strip_prefix("rank-").and_then(|n| n.strip_suffix(".json")) else { continue };
        let text = crate::fsutil::read_bounded(&path, MAX_RECORD_BYTES, "a flight record")?;
        total += text.len() as u64;
        if total > MAX_RECORDS_BYTES {
            bail!(
                "{}: the flight records hold more than {} MiB together; not records of this engine",
                dir.display(),
                MAX_RECORDS_BYTES >> 20
            );
        }
        let record: Record = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a flight record of this engine", path.display()))?;
        let p = path.display();
        if named.parse::<usize>().ok() != Some(record.rank) {
            bail!("{p}: the record says rank {}, its name another; not a flight record of this engine", record.rank);
        }
        if record.world == 0 || record.world > MAX_WORLD {
            bail!("{p}: world = {}: a job has 1 to {MAX_WORLD} ranks", record.world);
        }
        if record.rank >= record.world {
            bail!("{p}: rank {} is beyond the job's world of {} ranks", record.rank, record.world);
        }
        if let Some((other, at)) = records.iter().find(|(r, _)| r.world != record.world) {
            bail!(
                "{p}: world = {}, but {} says {}: records of different jobs",
                record.world,
                at.display(),
                other.world
            );
        }
        if record.written_unix_us >= since {
            records.push((record, path));
        }
    }
    let mut records: Vec<Record> = records.into_iter().map(|(r, _)| r).collect();
    records.sort_by_key(|r| r.rank);
    Ok(records)
}

/// `text` with its control characters escaped (`\u{1b}`), so that a record's strings cannot
/// drive the terminal it is printed on.
fn printable(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

/// Ranks that ran the same operation at one sequence number, and the operation.
pub type Alike = (Vec<usize>, Entry);

/// The diagnosis of a directory of records ([`diagnose`]).
#[derive(Debug, Clone)]
pub struct Diagnosis {
    /// The folder read.
    pub dir: PathBuf,
    /// The job's size.
    pub world: usize,
    /// The ranks that wrote no record.
    pub missing: Vec<usize>,
    /// The rank that gave up first, and why.
    pub first: Option<(usize, String)>,
    /// Each rank's last operation started before the first gave up, and whether it had
    /// completed by then.
    pub last: Vec<(usize, Option<(Entry, bool)>)>,
    /// The rank behind: the first rank whose sequence is lowest (ties go to the ranks the first
    /// to give up was waiting for).
    pub behind: Option<usize>,
    /// The first sequence number at which ranks ran different operations: the ranks of each
    /// operation, fewest first.
    pub mismatch: Option<(u64, Vec<Alike>)>,
}

/// The records of `RUN_DIR/flight` read and compared; records older than `since` (Unix µs) are
/// left out. Fails, naming the folder, when there is none to read.
pub fn diagnose_since(dir: &Path, since: u64) -> Result<Diagnosis> {
    let records = read_records(dir, since)?;
    let Some(world) = records.iter().map(|r| r.world).max() else {
        bail!("{}: no flight records (rank-R.json) to read", dir.display());
    };
    let missing: Vec<usize> = (0..world).filter(|r| !records.iter().any(|x| x.rank == *r)).collect();
    // As of the moment the first rank gave up: what the others did after it (a stopped rank
    // woken to stop, a rank failing on in the next collective) says nothing about the hang.
    // The first failure's record (SIGUSR2's records when no rank failed).
    let failures: Vec<&Record> = records.iter().filter(|r| r.failed).collect();
    let candidates = if failures.is_empty() { records.iter().collect() } else { failures };
    let first = *candidates.iter().min_by_key(|r| (r.written_unix_us, r.rank)).expect("a record");
    let cut = first.written_unix_us;
    let before = |r: &Record| -> Vec<Entry> { r.entries.iter().filter(|e| e.start_unix_us <= cut).cloned().collect() };
    let last: Vec<(usize, Option<(Entry, bool)>)> = records
        .iter()
        .map(|r| {
            let last = before(r).pop().map(|e| {
                let done = e.end_unix_us.is_some_and(|t| t <= cut);
                (e, done)
            });
            (r.rank, last)
        })
        .collect();
    // Progress: a completed operation counts for more than the same one in flight.
    let progress = |l: &Option<(Entry, bool)>| l.as_ref().map_or(0, |(e, done)| 2 * (e.seq + 1) + *done as u64);
    let lowest = last.iter().map(|(_, l)| progress(l)).min();
    let tied: Vec<usize> = last.iter().filter(|(_, l)| Some(progress(l)) == lowest).map(|(r, _)| *r).collect();
    // The first sequence number that every record holds and not all ran alike.
    let mut mismatch = None;
    let lists: Vec<(usize, Vec<Entry>)> = records.iter().map(|r| (r.rank, before(r))).collect();
    let from = lists.iter().filter_map(|(_, l)| l.first().map(|e| e.seq)).max().unwrap_or(0);
    let to = lists.iter().filter_map(|(_, l)| l.last().map(|e| e.seq)).min().unwrap_or(0);
    for seq in from..=to {
        let mut kinds: Vec<Alike> = Vec::new();
        for (rank, list) in &lists {
            let Some(e) = list.iter().find(|e| e.seq == seq) else { continue };
            match kinds.iter_mut().find(|(_, k)| k.kind() == e.kind()) {
                Some((ranks, _)) => ranks.push(*rank),
                None => kinds.push((vec![*rank], e.clone())),
            }
        }
        if kinds.len() > 1 {
            kinds.sort_by_key(|(ranks, _)| ranks.len());
            mismatch = Some((seq, kinds));
            break;
        }
    }
    let behind = match missing.first() {
        // A rank that wrote nothing (killed, or stopped) is behind if anyone waited for it.
        Some(&m) if first.suspects.contains(&m) || tied.len() == records.len() => Some(m),
        // Among equals: a rank out of step (the fewest who ran an operation), else one the first
        // to give up waited for, else the lowest.
        _ => {
            let odd: Vec<usize> =
                mismatch.as_ref().map(|(_, k): &(u64, Vec<Alike>)| k[0].0.clone()).unwrap_or_default();
            (tied.iter().copied().find(|r| odd.contains(r)))
                .or(tied.iter().copied().find(|r| first.suspects.contains(r)))
                .or(tied.first().copied())
        }
    };
    Ok(Diagnosis {
        dir: dir.to_path_buf(),
        world,
        missing,
        first: Some((first.rank, first.reason.clone())),
        last,
        behind,
        mismatch,
    })
}

/// [`diagnose_since`] over every record of `dir`.
pub fn diagnose(dir: &Path) -> Result<Diagnosis> {
    diagnose_since(dir, 0)
}

fn ranks_list(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(usize::to_string).collect();
    format!("rank{} {}", if ranks.len() == 1 { "" } else { "s" }, names.join(", "))
}

impl std::fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "flight recorder: {} of {} ranks wrote a record in {}",
            self.world - self.missing.len(),
            self.world,
            self.dir.display()
        )?;
        if let Some((rank, why)) = &self.first {
            writeln!(f, "  rank {rank} gave up first: {}", printable(why))?;
        }
        for (rank, last) in &self.last {
            match last {
                Some((e, true)) => writeln!(f, "  rank {rank}: after {} (completed)", e.describe())?,
                Some((e, false)) => writeln!(f, "  rank {rank}: stopped in {} (not completed)", e.describe())?,
                None => writeln!(f, "  rank {rank}: no collective recorded")?,
            }
        }
        // In runs of consecutive ranks: a job of many ranks, few of which wrote, is a few lines.
        let mut i = 0;
        while i < self.missing.len() {
            let mut j = i;
            while j + 1 < self.missing.len() && self.missing[j + 1] == self.missing[j] + 1 {
                j += 1;
            }
            let ranks = match j - i {
                0 => format!("rank {}", self.missing[i]),
                _ => format!("ranks {}-{}", self.missing[i], self.missing[j]),
            };
            writeln!(f, "  {ranks}: no record (killed, or stopped before it could write one)")?;
            i = j + 1;
        }
        if let Some((seq, kinds)) = &self.mismatch {
            let runs: Vec<String> =
                kinds.iter().map(|(ranks, e)| format!("{} ran {}", ranks_list(ranks), e.describe())).collect();
            writeln!(f, "  mismatch at #{seq}: {} (a rank skipped or added a collective before it)", runs.join("; "))?;
        }
        match self.behind {
            Some(rank) => {
                let at = self.last.iter().find(|(r, _)| *r == rank).and_then(|(_, l)| l.as_ref());
                match at {
                    Some((e, done)) => write!(
                        f,
                        "diagnosis: rank {rank} is behind: {} {}",
                        if *done { "last completed" } else { "stuck in" },
                        e.describe()
                    ),
                    None if self.missing.contains(&rank) => {
                        let waited = self
                            .last
                            .iter()
                            .filter_map(|(_, l)| l.as_ref())
                            .find(|(e, done)| !done && e.group.contains(&rank));
                        match waited {
                            Some((e, _)) => write!(
                                f,
                                "diagnosis: rank {rank} is behind: the others wait for it in {}",
                                e.describe()
                            ),
                            None => write!(f, "diagnosis: rank {rank} is behind: it wrote no record"),
                        }
                    }
                    None => write!(f, "diagnosis: rank {rank} is behind: it recorded no collective"),
                }
            }
            None => write!(f, "diagnosis: no rank is behind"),
        }
    }
}

/// A rank's collectives with a flight recorder around them ([module documentation](self)).
pub struct Flight<C> {
    inner: C,
    recorder: Arc<Recorder>,
    /// Started operations not yet waited for.
    started: Vec<u64>,
    /// The test hook's operation to skip: (step, name).
    skip: Option<(u64, String)>,
    /// Time spent in blocking calls and waits ([`Collectives::blocked`]).
    blocked: Duration,
    /// Time spent on the wrapper's own work: recording, and timing for `blocked`
    /// ([`Collectives::overhead`]).
    own: Duration,
}

impl<C> Flight<C> {
    /// `inner`, recorded by `recorder`. Reads the test hook ([`SKIP_HOOK`]): bad values are
    /// refused, naming it.
    pub fn new(inner: C, recorder: Arc<Recorder>) -> Result<Flight<C>> {
        let skip = match std::env::var(SKIP_HOOK) {
            Ok(v) => {
                let parts: Vec<&str> = v.splitn(3, ':').collect();
                let parsed = match parts[..] {
                    [rank, step, op] => {
                        rank.parse::<usize>().ok().zip(step.parse::<u64>().ok()).map(|(r, s)| (r, s, op))
                    }
                    _ => None,
                };
                let Some((rank, step, op)) = parsed else { bail!("{SKIP_HOOK} = `{v}`: expected RANK:STEP:OP") };
                (rank == recorder.rank).then(|| (step, op.to_owned()))
            }
            Err(_) => None,
        };
        Ok(Flight { inner, recorder, started: Vec::new(), skip, blocked: Duration::ZERO, own: Duration::ZERO })
    }

    /// Whether the test hook skips this operation (once).
    fn skipped(&mut self, op: &str) -> bool {
        let step = self.recorder.ring().step;
        if self.skip.as_ref().is_some_and(|(s, o)| *s == step && o == op) {
            self.skip = None;
            crate::say!("rank {}: {SKIP_HOOK}: skips {op} at step {step}", self.recorder.rank);
            return true;
        }
        false
    }

    /// Runs `run` on the inner collectives as operation `op` over `group`, recorded.
    fn record(&mut self, op: &'static str, group: &[usize], elements: usize, run: impl FnOnce(&mut C)) {
        if self.skip.is_some() && self.skipped(op) {
            return;
        }
        let entered = Instant::now();
        let seq = self.recorder.ring().begin(op, group, elements);
        let t = Instant::now();
        run(&mut self.inner);
        let done = Instant::now();
        self.blocked += done - t;
        self.recorder.ring().end(seq);
        self.own += (t - entered) + done.elapsed();
    }

    /// Starts `run` as operation `op`: it ends at the next wait.
    fn start(&mut self, op: &'static str, group: &[usize], elements: usize, run: impl FnOnce(&mut C)) {
        if self.skip.is_some() && self.skipped(op) {
            return;
        }
        let entered = Instant::now();
        let seq = self.recorder.ring().begin(op, group, elements);
        self.started.push(seq);
        self.own += entered.elapsed();
        run(&mut self.inner);
    }
}

impl<B: Backend, C: Collectives<B>> Collectives<B> for Flight<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn set_step(&mut self, step: u64) {
        self.recorder.ring().step = step;
        self.inner.set_step(step);
    }

    fn name_groups(&mut self, names: Vec<(Vec<usize>, String)>) {
        self.recorder.ring().names = names.clone();
        self.inner.name_groups(names);
    }

    fn bytes_sent(&self) -> Option<u64> {
        self.inner.bytes_sent()
    }

    fn blocked(&self) -> Option<Duration> {
        Some(self.blocked)
    }

    fn overhead(&self) -> Option<Duration> {
        Some(self.own)
    }

    fn all_reduce_sum(&mut self, be: &mut B, buf: View, group: &[usize]) {
        self.record("all-reduce", group, buf.len, |c| c.all_reduce_sum(be, buf, group));
    }

    fn all_reduce_max(&mut self, be: &mut B, buf: View, group: &[usize]) {
        self.record("all-reduce (max)", group, buf.len, |c| c.all_reduce_max(be, buf, group));
    }

    fn reduce_scatter_sum(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        self.record("reduce-scatter", group, input.len, |c| c.reduce_scatter_sum(be, input, output, group));
    }

    fn all_gather(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        self.record("all-gather", group, input.len, |c| c.all_gather(be, input, output, group));
    }

    fn all_reduce_sum_start(&mut self, be: &mut B, buf: View, group: &[usize]) {
        self.start("all-reduce (started)", group, buf.len, |c| c.all_reduce_sum_start(be, buf, group));
    }

    fn all_gather_start(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        self.start("all-gather (started)", group, input.len, |c| c.all_gather_start(be, input, output, group));
    }

    fn wait(&mut self, be: &mut B) {
        let t = Instant::now();
        self.inner.wait(be);
        let done = Instant::now();
        self.blocked += done - t;
        let mut ring = self.recorder.ring();
        for seq in self.started.drain(..) {
            ring.end(seq);
        }
        self.own += done.elapsed();
    }

    fn send_recv(&mut self, be: &mut B, sends: &[(View, usize)], recvs: &[(View, usize)]) {
        let entered = Instant::now();
        let mut group = vec![self.inner.rank()];
        group.extend(sends.iter().chain(recvs).map(|&(_, r)| r));
        group.sort_unstable();
        group.dedup();
        let elements = sends.iter().chain(recvs).map(|(v, _)| v.len).sum();
        self.own += entered.elapsed();
        self.record("send/recv", &group, elements, |c| c.send_recv(be, sends, recvs));
    }

    fn all_to_all(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        self.record("all-to-all", group, input.len, |c| c.all_to_all(be, input, output, group));
    }

    // (No recorded sections: a replayed graph would run its collectives behind the recorder's
    // back, and a hang in one would leave no record.)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BufKind, cpu::Cpu};
    use crate::parallel::comm::Virtual;

    fn entry(seq: u64, op: &str, start: u64, end: Option<u64>) -> Entry {
        Entry {
            seq,
            op: op.into(),
            axis: Some("data".into()),
            group: vec![0, 1, 2],
            elements: 8,
            start_unix_us: start,
            end_unix_us: end,
            step: 1,
        }
    }

    fn write(dir: &Path, rank: usize, written: u64, suspects: &[usize], entries: Vec<Entry>) {
        let record = Record {
            rank,
            world: 3,
            reason: format!("reason {rank}"),
            failed: true,
            suspects: suspects.to_vec(),
            started_unix_us: 1,
            written_unix_us: written,
            step: 1,
            operations: entries.len() as u64,
            capacity: 16,
            entries,
        };
        std::fs::write(dir.join(format!("rank-{rank}.json")), serde_json::to_string(&record).unwrap()).unwrap();
    }

    /// The ring keeps the last N, in order, each with its group's name; started operations end
    /// at the wait.
    #[test]
    fn the_ring_keeps_the_last_operations_with_their_names() {
        let comms: Vec<_> = Virtual::devices(2)
            .into_iter()
            .enumerate()
            .map(|(rank, c)| {
                let rec = Recorder::new(rank, 2, 3, None);
                (Flight::new(c, rec.clone()).unwrap(), rec)
            })
            .collect();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|(mut comm, rec)| {
                std::thread::spawn(move || {
                    let mut be = Cpu::new();
                    let buf = be.alloc(BufKind::Grads, 4);
                    Collectives::<Cpu>::name_groups(&mut comm, vec![(vec![0, 1], "data".into())]);
                    Collectives::<Cpu>::set_step(&mut comm, 7);
                    for _ in 0..3 {
                        Collectives::<Cpu>::all_reduce_sum(&mut comm, &mut be, buf, &[0, 1]);
                    }
                    let out = be.alloc(BufKind::Grads, 8);
                    Collectives::<Cpu>::all_gather_start(&mut comm, &mut be, buf, out, &[0, 1]);
                    let in_flight = rec.record("test", &[], false);
                    Collectives::<Cpu>::wait(&mut comm, &mut be);
                    (in_flight, rec.record("test", &[], false))
                })
            })
            .collect();
        for h in handles {
            let (in_flight, done) = h.join().unwrap();
            assert_eq!(done.operations, 4);
            let seqs: Vec<u64> = done.entries.iter().map(|e| e.seq).collect();
            assert_eq!(seqs, [1, 2, 3], "the last 3 of 4");
            assert_eq!(done.entries[0].op, "all-reduce");
            assert_eq!((done.entries[0].axis.as_deref(), done.entries[0].step), (Some("data"), 7));
            assert_eq!((done.entries[2].op.as_str(), done.entries[2].elements), ("all-gather (started)", 4));
            assert!(in_flight.entries[2].end_unix_us.is_none() && done.entries[2].end_unix_us.is_some());
        }
    }

    /// A rank that never reached the collective the others wait in is behind; a rank that wrote
    /// no record but was waited for is named; what a rank did after the first gave up is left out.
    #[test]
    fn the_rank_behind_is_the_first_whose_sequence_is_lowest() {
        let dir = tempfile::tempdir().unwrap();
        // Ranks 0 and 2 wait in #5; rank 1 completed #4 and started #5 only after rank 0 gave up.
        write(dir.path(), 0, 1000, &[1], vec![entry(4, "all-gather", 10, Some(20)), entry(5, "all-reduce", 30, None)]);
        write(dir.path(), 2, 1010, &[1], vec![entry(4, "all-gather", 10, Some(20)), entry(5, "all-reduce", 31, None)]);
        write(
            dir.path(),
            1,
            2000,
            &[0],
            vec![entry(4, "all-gather", 10, Some(20)), entry(5, "all-reduce", 1500, None)],
        );
        let d = diagnose(dir.path()).unwrap();
        assert_eq!(d.behind, Some(1));
        let text = d.to_string();
        assert!(text.contains("rank 0 gave up first: reason 0"), "{text}");
        assert!(
            text.contains("diagnosis: rank 1 is behind: last completed #4 all-gather over the data axis"),
            "{text}"
        );
        assert!(d.mismatch.is_none(), "{text}");
        // Rank 1 wrote nothing: the others wait for it in #5.
        std::fs::remove_file(dir.path().join("rank-1.json")).unwrap();
        let text = diagnose(dir.path()).unwrap().to_string();
        assert!(text.contains("rank 1: no record"), "{text}");
        assert!(text.contains("diagnosis: rank 1 is behind: the others wait for it in #5 all-reduce"), "{text}");
        // Stale records (an earlier attempt's) are left out; a folder without records is an error.
        assert!(diagnose_since(dir.path(), 5000).unwrap_err().to_string().contains("no flight records"));
        std::fs::write(dir.path().join("rank-2.json"), "{").unwrap();
        assert!(diagnose(dir.path()).unwrap_err().to_string().contains("rank-2.json: not a flight record"));
    }

    /// A record is checked against its name and the others, its world is bounded, a file past
    /// the bound is refused unread, missing ranks are listed in runs, and control characters are
    /// escaped.
    #[test]
    fn records_are_checked_bounded_and_escaped() {
        let dir = tempfile::tempdir().unwrap();
        let at = |rank: usize| dir.path().join(format!("rank-{rank}.json"));
        let fails = |needle: &str| {
            let e = format!("{:#}", diagnose(dir.path()).unwrap_err());
            assert!(e.contains(needle), "{needle}: {e}");
        };
        write(dir.path(), 0, 100, &[], vec![entry(1, "all-reduce\u{1b}[2J", 10, None)]);
        let text = diagnose(dir.path()).unwrap().to_string();
        assert!(text.contains("#1 all-reduce\\u{1b}[2J over") && !text.contains('\u{1b}'), "{text}");
        assert!(text.contains("ranks 1-2: no record"), "{text}");
        let record = std::fs::read_to_string(at(0)).unwrap();
        for (world, needle) in [
            ("18446744073709551615", "world = 18446744073709551615: a job has 1 to 1048576 ranks"),
            ("0", "world = 0: a job has 1 to"),
        ] {
            std::fs::write(at(0), record.replace("\"world\":3", &format!("\"world\":{world}"))).unwrap();
            fails(needle);
        }
        std::fs::write(at(0), &record).unwrap();
        std::fs::write(at(5), record.replace("\"rank\":0", "\"rank\":5")).unwrap();
        fails("rank-5.json: rank 5 is beyond the job's world of 3 ranks");
        std::fs::write(at(5), &record).unwrap();
        fails("rank-5.json: the record says rank 0, its name another");
        std::fs::remove_file(at(5)).unwrap();
        std::fs::write(at(1), record.replace("\"rank\":0", "\"rank\":1").replace("\"world\":3", "\"world\":4"))
            .unwrap();
        fails("records of different jobs");
        std::fs::remove_file(at(1)).unwrap();
        std::fs::File::create(at(2)).unwrap().set_len(MAX_RECORD_BYTES + 1).unwrap();
        fails("rank-2.json: longer than 67108864 bytes");
    }

    /// A rank that skipped a collective runs another at the same sequence number: named by the
    /// mismatch, fewest ranks first.
    #[test]
    fn a_skipped_collective_is_a_mismatch() {
        let dir = tempfile::tempdir().unwrap();
        for rank in [0, 1] {
            write(
                dir.path(),
                rank,
                100,
                &[2],
                vec![entry(3, "all-gather", 10, Some(11)), entry(4, "all-reduce", 12, None)],
            );
        }
        write(dir.path(), 2, 100, &[0], vec![entry(3, "all-reduce", 10, None)]);
        let d = diagnose(dir.path()).unwrap();
        let (seq, kinds) = d.mismatch.clone().unwrap();
        assert_eq!((seq, kinds[0].0.clone(), kinds[1].0.clone()), (3, vec![2], vec![0, 1]));
        assert_eq!(d.behind, Some(2));
        let text = d.to_string();
        assert!(text.contains("mismatch at #3: rank 2 ran #3 all-reduce over the data axis"), "{text}");
    }
}
