//! The fast local tier of checkpoints (`train.local_checkpoint_every`): each rank's part of the
//! training state in node-local storage (`/dev/shm` by default), copied to one peer rank, so
//! that a restart reads memory instead of shared storage and loses fewer steps, as MaxText's
//! emergency checkpointing and PyTorch's in-cluster checkpoints do.
//!
//! ```text
//! LOCAL_DIR/                      train.local_checkpoint_dir, or /dev/shm/engine-local-UID-HASH
//!   rank-00001/step-000120/       rank 1's own part: a sealed sharded checkpoint of one shard
//!   copy-of-rank-00000/step-000120/  the copy of rank 0's part that rank 1 keeps as its peer
//! ```
//!
//! The tier is this user's alone ([`claim`]): its directory is created 0700 (the default one
//! with a name that holds the user's ID), its directories are 0700 and its files 0600, and a
//! directory that is a symbolic link, that another user owns or that others can write is
//! refused, so that no one else reads the weights or plants a part that `--resume=auto` would
//! train on. Each part records the run that saved it ([`State::run`]), and a run completed
//! removes its parts ([`LocalTier::remove`]): `/dev/shm` is memory.
//!
//! Rank r's peer is rank (r + local_world) mod world, on the next node when there is one (the
//! next rank on a single node), so losing one node loses no part. A save
//! ([`super::local_saver`], in the background) writes the rank's own part with the persistent
//! tier's writer and seal ([`sharded::write_part`], [`sharded::commit`]) on a thread, sends its
//! files to the peer over the job's collectives (`send_recv`, in pieces through a fixed staging
//! buffer) from the step loop once every rank's part is sealed, and writes the part it receives
//! into its copy directory on a thread again, byte for byte the sender's, seal included. Each
//! directory keeps the newest [`KEEP`] steps: a rank killed in the middle of a save still shares
//! the previous step with every other rank.
//!
//! On `--resume=auto` ([`LocalTier::restore`]) each rank reports the steps its directories
//! list, for itself and for the rank whose copy it keeps; every rank then takes the newest step
//! that all can restore, from its own copy or its peer's, when it is at least as new as the
//! persistent tier's newest. Only then is anything verified (the seal and every file's SHA-256),
//! once, by the rank that serves it: a damaged copy is skipped, with a line saying so, and the
//! ranks agree again. A rank without its own copy receives the peer's, writes it as its own and
//! loads it like any checkpoint. Parts that another run saved (sharing the directory), or that
//! do not hold what this mesh's ranks need (another mesh of the same size: FSDP 2 then data 2)
//! are left out before the ranks agree, with a line saying so.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};

use super::Trainer;
use crate::backend::{Backend, BufKind, View};
use crate::checkpoint::sharded::{self, DeviceState};
use crate::checkpoint::{self, Checkpoint, Extras, Progress, STATE_FILE, State};
use crate::config::Config;
use crate::fsutil;

/// Steps each directory of the tier keeps: the newest two, so that a save cut short on some
/// rank leaves the previous step on all.
pub const KEEP: usize = 2;

/// f32 words one `send_recv` of a transfer moves (4 MiB), the size of each staging buffer.
const PIECE: usize = 1 << 20;

/// A rank's side of the local tier.
#[derive(Clone)]
pub struct LocalTier {
    /// This run's directory of the tier on this node.
    root: PathBuf,
    /// The run's identity, which each part records ([`State::run`]): the digest of its run
    /// directory's canonical path as the lead sees it ([`run_id`]).
    run: String,
    /// The run directory, for messages.
    run_dir: PathBuf,
    every: u64,
    rank: usize,
    world: usize,
    /// The rank that keeps this rank's copy.
    peer: usize,
    /// The rank whose copy this rank keeps.
    source: usize,
    /// Outgoing and incoming staging buffers of the transfers (none on one device).
    staging: Option<(View, View)>,
    config: Arc<Config>,
    /// Files every checkpoint carries (the Hugging Face model's), as the persistent tier's.
    pub extras: Arc<Extras>,
}

impl LocalTier {
    /// The local tier of `trainer`'s run in `run_dir` (none when `train.local_checkpoint_every`
    /// is 0), on a node of `local_world` ranks. Refuses a directory whose file system has not
    /// the room for [`KEEP`] steps of this node's parts and their copies, and one that is not
    /// this user's alone ([`claim`]). Every rank calls it at the same point.
    pub fn open<B: Backend>(trainer: &mut Trainer<B>, run_dir: &Path, local_world: usize) -> Result<Option<LocalTier>> {
        if trainer.config.train.local_checkpoint_every == 0 {
            return Ok(None);
        }
        // The lead's identity of the run, on every rank (a node may mount the run directory
        // elsewhere).
        let id = trainer.parallel.gather_from_world(&mut trainer.backend, run_id(run_dir))[0];
        let t = &trainer.config.train;
        let root = root_of(&t.local_checkpoint_dir, run_dir);
        let created = claim(&root, t.local_checkpoint_dir.is_empty())?;
        let (rank, world) = (trainer.parallel.rank, trainer.devices());
        let local_world = local_world.clamp(1, world);
        let (peer, source) = peers(rank, world, local_world);
        // Every rank keeps its own part and its source's copy; about as large as its own.
        let part = 4 * (3 * trainer.parallel.master_params().len + trainer.plan.fp8.map_or(0, |f| f.states.len)) as u64;
        let copies = if world > 1 { 2 } else { 1 };
        // In host memory at once: the snapshot, and while the copies are exchanged the part
        // packed for the peer and the copy received.
        let buffers = if world > 1 { 3 } else { 1 };
        let room = Room { files: KEEP as u64 * copies * part, buffers: buffers * part, ranks: local_world };
        let memory = if t.memory_check { crate::host::memory_limit() } else { None };
        if let Err(e) = room.check(&root, memory) {
            if created {
                let _ = fs::remove_dir(&root);
            }
            return Err(e);
        }
        let tier = LocalTier {
            root,
            run: format!("{id:012x}"),
            run_dir: run_dir.to_path_buf(),
            every: t.local_checkpoint_every as u64,
            rank,
            world,
            peer,
            source,
            staging: (world > 1).then(|| {
                let be = &mut trainer.backend;
                (be.alloc(BufKind::Activations, PIECE), be.alloc(BufKind::Activations, PIECE))
            }),
            config: Arc::new(trainer.config.clone()),
            extras: Arc::new(Extras::default()),
        };
        for dir in [tier.own_dir(), tier.copy_dir()] {
            private_dir(&dir)?;
            checkpoint::remove_temporaries(&dir)?;
        }
        Ok(Some(tier))
    }

    /// The directory of this rank's own parts.
    fn own_dir(&self) -> PathBuf {
        self.root.join(format!("rank-{:05}", self.rank))
    }

    /// The directory of the copies this rank keeps of its source's parts.
    fn copy_dir(&self) -> PathBuf {
        self.root.join(format!("copy-of-rank-{:05}", self.source))
    }

    /// Whether the step just completed is one the tier saves.
    pub fn due(&self, step: u64) -> bool {
        step.is_multiple_of(self.every)
    }

    /// Writes and seals this rank's part of `progress`'s step from `state` in its own directory
    /// (replacing what an earlier attempt left there), prunes that directory to [`KEEP`] steps
    /// and packs the part's files for the peer (none on one device). Runs on the local saver's
    /// writer thread ([`super::local_saver`]); touches no device and no collective.
    pub(super) fn write_part(&self, progress: Progress, state: &DeviceState) -> Result<Option<Words>> {
        let dir = self.own_dir().join(checkpoint::dir_name(progress.step));
        let progress = Progress { run: Some(self.run.clone()), ..progress };
        self.write_own(&dir, |tmp| {
            let known = sharded::write_part(tmp, self.rank, self.world, state)?;
            sharded::commit(tmp, &dir, &self.config, progress, self.world, &self.extras, &known)
        })?;
        checkpoint::prune(&self.own_dir(), KEEP, 0)?;
        if self.world == 1 {
            return Ok(None);
        }
        Ok(Some(Words::of(&pack(&dir)?)))
    }

    /// Sends this rank's packed part to its peer and receives its source's, over the job's
    /// collectives: only the step loop's thread calls it, every rank at the same boundary.
    pub(super) fn swap_parts<B: Backend>(&self, trainer: &mut Trainer<B>, packed: &Words) -> Result<Words> {
        let got = self.exchange(trainer, Some((packed, self.peer)), Some(self.source))?;
        got.context("no part received from the source rank")
    }

    /// Writes the source's part of `step`, as [`LocalTier::swap_parts`] received it, as this
    /// rank's copy of it, and prunes the copies to [`KEEP`] steps (the local saver's thread).
    pub(super) fn keep_copy(&self, step: u64, got: Words) -> Result<()> {
        unpack(&got.into_bytes(), &self.copy_dir().join(checkpoint::dir_name(step)))?;
        checkpoint::prune(&self.copy_dir(), KEEP, 0)
    }

    /// Writes `dir` (replacing what an earlier attempt left there) with `write`, which fills a
    /// temporary sibling and renames it to `dir`.
    fn write_own(&self, dir: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
        let name = dir.file_name().context("a step directory")?.to_string_lossy().into_owned();
        let tmp = dir.with_file_name(format!(".tmp-{name}"));
        for old in [dir, tmp.as_path()] {
            if old.exists() {
                std::fs::remove_dir_all(old).with_context(|| format!("cannot remove {}", old.display()))?;
            }
        }
        private_builder().create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        write(&tmp).map_err(|e| {
            let _ = std::fs::remove_dir_all(&tmp);
            e.context(format!("cannot write the local checkpoint {}", dir.display()))
        })?;
        // The writers give their files the ordinary mode; in the tier they are this user's alone.
        make_private(dir)
    }

    /// Sends `send`'s bytes to its rank (when given) and receives from rank `recv` (when
    /// given), in pieces of [`PIECE`] words: first the byte counts, then the bytes.
    fn exchange<B: Backend>(
        &self,
        trainer: &mut Trainer<B>,
        send: Option<(&Words, usize)>,
        recv: Option<usize>,
    ) -> Result<Option<Words>> {
        let (out, inn) = self.staging.expect("staging buffers on more than one device");
        let (be, par) = (&mut trainer.backend, &mut trainer.parallel);
        let words = send.map(|(w, to)| (&w.words, to));
        let to = |v: View| words.as_ref().map(|(_, to)| (v, *to)).into_iter().collect::<Vec<_>>();
        let from = |v: View| recv.map(|from| (v, from)).into_iter().collect::<Vec<_>>();
        let receive = recv.is_some();
        // The byte count as two 32-bit halves, carried as bit patterns.
        let bytes = send.map_or(0, |(w, _)| w.bytes as u64);
        be.upload(out.at(0, 2), &[f32::from_bits(bytes as u32), f32::from_bits((bytes >> 32) as u32)]);
        par.send_recv(be, &to(out.at(0, 2)), &from(inn.at(0, 2)));
        let mut header = [0f32; 2];
        if receive {
            be.download(inn.at(0, 2), &mut header);
        }
        let incoming = (header[0].to_bits() as u64 | (header[1].to_bits() as u64) << 32) as usize;
        let (send_len, recv_len) = (words.as_ref().map_or(0, |(w, _)| w.len()), incoming.div_ceil(4));
        let mut got = vec![0f32; recv_len];
        let (mut sent, mut received) = (0, 0);
        while sent < send_len || received < recv_len {
            let (s, r) = ((send_len - sent).min(PIECE), (recv_len - received).min(PIECE));
            let sends = match &words {
                Some((w, _)) if s > 0 => {
                    be.upload(out.at(0, s), &w[sent..sent + s]);
                    to(out.at(0, s))
                }
                _ => Vec::new(),
            };
            let recvs = if r > 0 { from(inn.at(0, r)) } else { Vec::new() };
            par.send_recv(be, &sends, &recvs);
            if r > 0 {
                be.download(inn.at(0, r), &mut got[received..received + r]);
            }
            (sent, received) = (sent + s, received + r);
        }
        Ok(receive.then_some(Words { words: got, bytes: incoming }))
    }

    /// `--resume=auto` with the local tier: the newest step every rank can restore from its own
    /// copy or its peer's, if at least as new as `persistent` (the persistent tier's newest
    /// step); this rank's part of it in its own directory (received from the peer when its own
    /// copy is missing or damaged), verified. None otherwise. The lead says which tier in one
    /// line. Every rank calls it at the same point.
    ///
    /// Each file is hashed once: the ranks agree on the newest step from what their directories
    /// list, then each verifies only what it serves of that step (its own part, and its
    /// source's copy when the source lacks its own) and keeps the verified checkpoint to load.
    /// When any rank finds its part damaged, it drops that step from its list, with a line
    /// saying so, and all agree again on what is left.
    pub fn restore<B: Backend>(
        &mut self,
        trainer: &mut Trainer<B>,
        persistent: Option<u64>,
        lead: bool,
    ) -> Result<Option<Checkpoint>> {
        let d = self.root.display();
        // What every rank holds on this mesh: the digest of its chunk list, which its part's
        // `shard-*.json` is when saved on a mesh that holds the same.
        let chunks = sharded::chunks_json(&trainer.parallel.chunks());
        let layouts = trainer.parallel.gather_many_from_world(&mut trainer.backend, digest48(&digest_of(&chunks)));
        // Parts of another run or another mesh are left out before the ranks agree.
        let mut skipped = [0u64; 2];
        let mut own = self.usable(&self.own_dir(), self.rank, &layouts, &mut skipped);
        let mut copies = match self.world {
            1 => Vec::new(),
            _ => self.usable(&self.copy_dir(), self.source, &layouts, &mut skipped),
        };
        let all_skipped = trainer.parallel.gather_many_from_world(&mut trainer.backend, skipped);
        let [runs, meshes] = [0, 1].map(|i| all_skipped.iter().map(|s| s[i]).sum::<u64>());
        if lead && runs + meshes > 0 {
            let mut why = Vec::new();
            if runs > 0 {
                why.push(format!(
                    "{runs} saved by another run (not this one, in {})",
                    canonical(&self.run_dir).display()
                ));
            }
            if meshes > 0 {
                why.push(format!("{meshes} saved on another mesh (they do not hold what this mesh's ranks need)"));
            }
            crate::say!("local tier ({d}): parts skipped: {}", why.join("; "));
        }
        // Own parts verified so far, by step: loaded as they are, not read again.
        let mut verified: BTreeMap<u64, Checkpoint> = BTreeMap::new();
        loop {
            let report = |steps: &[u64]| std::array::from_fn::<u64, KEEP, _>(|i| steps.get(i).copied().unwrap_or(0));
            let all_own = trainer.parallel.gather_many_from_world(&mut trainer.backend, report(&own));
            let all_copies = trainer.parallel.gather_many_from_world(&mut trainer.backend, report(&copies));
            let choice = choose(&all_own, &all_copies, (self.peer + self.world - self.rank) % self.world);
            let step = match choice {
                Some(step) if persistent.is_none_or(|p| step >= p) => step,
                _ => {
                    if lead {
                        let found = match choice {
                            Some(s) => format!("its newest step that every rank can restore is {s}"),
                            None => "no step there can be restored by every rank".to_owned(),
                        };
                        let then = match persistent {
                            Some(p) => format!("resuming from the persistent tier (step {p})"),
                            None => "the persistent tier holds none either".to_owned(),
                        };
                        crate::say!("local tier ({d}): {found}; {then}");
                    }
                    return Ok(None);
                }
            };
            let has = |steps: &[u64; KEEP]| steps.contains(&step);
            // What this rank serves of `step`, verified once.
            let mut damaged = false;
            if has(&all_own[self.rank]) && !verified.contains_key(&step) {
                match self.verify(&self.own_dir(), step) {
                    Some(ck) => _ = verified.insert(step, ck),
                    None => {
                        own.retain(|&s| s != step);
                        damaged = true;
                    }
                }
            }
            let serves_copy = self.world > 1 && !has(&all_own[self.source]);
            if serves_copy && self.verify(&self.copy_dir(), step).is_none() {
                copies.retain(|&s| s != step);
                damaged = true;
            }
            if trainer.parallel.sum_over_world(&mut trainer.backend, damaged as u8 as f32) > 0.0 {
                continue;
            }
            let name = checkpoint::dir_name(step);
            let mine = self.own_dir().join(&name);
            let lacking = !has(&all_own[self.rank]);
            if self.world > 1 {
                // The copy this rank keeps goes back to its owner if the owner lacks its own.
                let send = match serves_copy {
                    false => None,
                    true => Some((Words::of(&pack(&self.copy_dir().join(&name))?), self.source)),
                };
                let send = send.as_ref().map(|(w, to)| (w, *to));
                if let Some(got) = self.exchange(trainer, send, lacking.then_some(self.peer))? {
                    unpack(&got.into_bytes(), &mine)?;
                }
            }
            let ck = match verified.remove(&step) {
                Some(ck) => ck,
                // The peer's copy, received: this rank's first read of these files.
                None => checkpoint::resume_point(&self.own_dir(), Some(&mine), &trainer.config, self.world)?,
            };
            if lead {
                let from_peers: Vec<usize> = (0..self.world).filter(|&r| !has(&all_own[r])).collect();
                let how = match from_peers.as_slice() {
                    [] => "every rank from its own copy".to_owned(),
                    ranks => format!("ranks {ranks:?} from their peers' copies, the others from their own"),
                };
                let newer = persistent.map_or("none".to_owned(), |p| format!("step {p}"));
                crate::say!(
                    "resuming after step {step} from the local tier ({d}; {how}); the persistent tier's newest is {newer}"
                );
            }
            return Ok(Some(ck));
        }
    }

    /// `dir`'s checkpoint of `step`, if this rank can restore it: complete, sealed, every file
    /// matching its hash, of this run's configuration on this mesh. One that is not says so in
    /// one line.
    fn verify(&self, dir: &Path, step: u64) -> Option<Checkpoint> {
        let path = dir.join(checkpoint::dir_name(step));
        match checkpoint::resume_point(dir, Some(&path), &self.config, self.world) {
            Ok(ck) if ck.state.shards == Some(self.world) => Some(ck),
            Ok(_) => {
                crate::say!("local tier: {} was saved on another mesh; skipped", path.display());
                None
            }
            Err(e) => {
                crate::say!("local tier: rank {}: {e:#}; skipped", self.rank);
                None
            }
        }
    }

    /// The steps `dir` holds (newest first) whose part rank `owner` can load on this mesh: saved
    /// by this run, on a mesh where `owner` held what it holds now (`layouts`: every rank's
    /// [`digest48`] of its chunk list). Counts the others in `skipped` (another run, another
    /// mesh). Only `state.json` is read; a part that cannot be read is kept, for the full check
    /// ([`LocalTier::verify`]) to say what is wrong with it.
    fn usable(&self, dir: &Path, owner: usize, layouts: &[[u64; 2]], skipped: &mut [u64; 2]) -> Vec<u64> {
        let shard = format!("{}.json", sharded::shard_name(owner, self.world));
        let mut steps = listed(dir);
        steps.retain(|&step| {
            let Some(state) = state_of(&dir.join(checkpoint::dir_name(step))) else { return true };
            if state.run.as_deref() != Some(self.run.as_str()) {
                skipped[0] += 1;
                return false;
            }
            let holds = |f: &checkpoint::FileSum| digest48(&f.sha256) == layouts[owner];
            let same_mesh = state.shards == Some(self.world) && state.files.get(&shard).is_some_and(holds);
            if !same_mesh {
                skipped[1] += 1;
            }
            same_mesh
        });
        steps
    }

    /// At the end of a completed run, on every rank at the same point: removes this run's parts
    /// from the rank's directories of the tier, then those directories and the tier's own once
    /// empty (the persistent tier holds the run's end, and `/dev/shm` is memory). What is left
    /// (another run's parts) stays. Returns the end of the lead's closing line.
    pub fn remove<B: Backend>(&self, trainer: &mut Trainer<B>) -> String {
        let mut failed = false;
        for dir in [self.own_dir(), self.copy_dir()] {
            for (_, path) in checkpoint::list(&dir).unwrap_or_default() {
                if state_of(&path).is_some_and(|s| s.run.as_deref() == Some(self.run.as_str()))
                    && let Err(e) = fs::remove_dir_all(&path)
                {
                    crate::say!("local tier: rank {}: cannot remove {}: {e}", self.rank, path.display());
                    failed = true;
                }
            }
            let _ = fs::remove_dir(&dir);
        }
        // Every rank's directories are gone before the tier's own is removed (by the first rank
        // of each node to get here).
        let failures = trainer.parallel.sum_over_world(&mut trainer.backend, failed as u8 as f32);
        let _ = fs::remove_dir(&self.root);
        let d = self.root.display();
        if failures > 0.0 {
            format!("; the local tier {d} is not removed: {} ranks could not remove their parts", failures as u64)
        } else if fs::symlink_metadata(&self.root).is_ok() {
            format!("; this run's parts removed from the local tier {d} (it holds others)")
        } else {
            format!("; local tier {d} removed")
        }
    }

    /// Removes this rank's local copies of steps after `step` (a run that continues from
    /// `step`, or starts at 0, replaces them).
    pub fn discard_after(&self, step: u64) -> Result<()> {
        for dir in [self.own_dir(), self.copy_dir()] {
            for (s, path) in checkpoint::list(&dir)?.into_iter().filter(|(s, _)| *s > step) {
                std::fs::remove_dir_all(&path)
                    .with_context(|| format!("cannot remove the local checkpoint of step {s}, {}", path.display()))?;
            }
        }
        Ok(())
    }
}

/// The steps `dir` holds, newest first, as their directories name them: nothing is read or
/// verified yet ([`LocalTier::restore`] verifies the one chosen).
fn listed(dir: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = checkpoint::list(dir).unwrap_or_default().into_iter().map(|(s, _)| s).collect();
    steps.reverse();
    steps
}

/// The tier's directory of a run: `train.local_checkpoint_dir` as given, or
/// `/dev/shm/engine-local-UID-HASH`, of this user (its effective ID) and keyed by the run
/// directory's canonical path.
pub fn root_of(configured: &str, run_dir: &Path) -> PathBuf {
    if !configured.is_empty() {
        return PathBuf::from(configured);
    }
    let hash = crate::digest::sha256_hex(canonical(run_dir).as_os_str().as_encoded_bytes());
    // SAFETY: geteuid cannot fail and touches no memory.
    let uid = unsafe { libc::geteuid() };
    PathBuf::from(format!("/dev/shm/engine-local-{uid}-{}", &hash[..16]))
}

/// A run's identity in the tier: 48 bits of the digest of its run directory's canonical path.
fn run_id(run_dir: &Path) -> u64 {
    digest48(&crate::digest::sha256_hex(canonical(run_dir).as_os_str().as_encoded_bytes()))[0]
}

/// The SHA-256 of `text`, in hex.
fn digest_of(text: &str) -> String {
    crate::digest::sha256_hex(text.as_bytes())
}

/// The first 96 bits of a hex digest as two 48-bit numbers (what the collectives gather
/// exactly); zeros where it is not hex.
fn digest48(hex: &str) -> [u64; 2] {
    let part = |r: std::ops::Range<usize>| hex.get(r).and_then(|h| u64::from_str_radix(h, 16).ok()).unwrap_or(0);
    [part(0..12), part(12..24)]
}

/// The `state.json` of the part in `dir`, as written (the full check verifies its seal).
fn state_of(dir: &Path) -> Option<State> {
    let text = fsutil::read_bounded(&dir.join(STATE_FILE), 64 << 20, "a checkpoint's state").ok()?;
    serde_json::from_str(&text).ok()
}

/// Makes `root` the tier's directory, this user's alone, or refuses it in one line: creates it
/// 0700 when it does not exist (its parents too for `train.local_checkpoint_dir`); refuses a
/// symbolic link (never followed: another user could point it at a directory of theirs), a
/// directory another user owns (they could read the weights, or plant a part that
/// `--resume=auto` trains on) and one others can write. The `default` directory in `/dev/shm`
/// is made 0700 if it is not. Returns whether it created the directory.
fn claim(root: &Path, default: bool) -> Result<bool> {
    let r = root.display();
    let what = if default { "the local tier's directory" } else { "train.local_checkpoint_dir" };
    let fix = "remove it, or set train.local_checkpoint_dir to a directory of your own";
    let mut created = false;
    let meta = match fs::symlink_metadata(root) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = root.parent().filter(|p| !p.as_os_str().is_empty());
            if let Some(parent) = parent.filter(|_| !default) {
                fs::create_dir_all(parent)
                    .map_err(|e| anyhow!("{what}: cannot create {}: {e}; set another directory", parent.display()))?;
            }
            match fs::DirBuilder::new().mode(0o700).create(root) {
                Ok(()) => created = true,
                // Another rank of this node, or another process, got there first: checked below.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => bail!("{what}: cannot create {r}: {e}; set train.local_checkpoint_dir to another directory"),
            }
            fs::symlink_metadata(root).map_err(|e| anyhow!("{what}: cannot read {r}: {e}"))?
        }
        Err(e) => bail!("{what}: cannot read {r}: {e}"),
    };
    // SAFETY: geteuid cannot fail and touches no memory.
    let me = unsafe { libc::geteuid() };
    if meta.file_type().is_symlink() {
        let to = fs::read_link(root).map(|t| t.display().to_string()).unwrap_or_default();
        bail!("{what}: {r} is a symbolic link (to {to}), which the local tier never follows; {fix}");
    }
    if !meta.is_dir() {
        bail!("{what}: {r} is not a directory; {fix}");
    }
    if meta.uid() != me {
        bail!(
            "{what}: {r} belongs to another user (uid {}; this process runs as uid {me}), who could read the checkpoints there or plant one that --resume=auto trains on; {fix}",
            meta.uid()
        );
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        bail!(
            "{what}: {r} can be written by other users (mode {mode:04o}), who could plant a checkpoint there that --resume=auto trains on; {fix}"
        );
    }
    if default && mode != 0o700 {
        fs::set_permissions(root, fs::Permissions::from_mode(0o700))
            .map_err(|e| anyhow!("{what}: cannot make {r} 0700: {e}"))?;
    }
    Ok(created)
}

/// Creates directories 0700.
fn private_builder() -> fs::DirBuilder {
    let mut builder = fs::DirBuilder::new();
    builder.recursive(true).mode(0o700);
    builder
}

/// Creates `dir` (a rank's directory in the tier) 0700, or makes an existing one and what it
/// holds this user's alone ([`make_private`]); refuses a symbolic link or another user's.
fn private_dir(dir: &Path) -> Result<()> {
    let d = dir.display();
    private_builder().create(dir).map_err(|e| anyhow!("train.local_checkpoint_dir: cannot create {d}: {e}"))?;
    let meta = fs::symlink_metadata(dir).map_err(|e| anyhow!("train.local_checkpoint_dir: cannot read {d}: {e}"))?;
    // SAFETY: geteuid cannot fail and touches no memory.
    if meta.file_type().is_symlink() || !meta.is_dir() || meta.uid() != unsafe { libc::geteuid() } {
        bail!(
            "train.local_checkpoint_dir: {d} is not a directory of this user's own (a symbolic link, a file, or another user's); remove it"
        );
    }
    make_private(dir)
}

/// Makes `path` and everything under it this user's alone: directories 0700, files 0600.
/// Symbolic links are neither followed nor changed.
fn make_private(path: &Path) -> Result<()> {
    let meta = fs::symlink_metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    let mode = if meta.is_dir() { 0o700 } else { 0o600 };
    if meta.mode() & 0o7777 != mode {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .with_context(|| format!("cannot make {} this user's alone", path.display()))?;
    }
    if meta.is_dir() {
        for entry in fs::read_dir(path).with_context(|| format!("cannot list {}", path.display()))? {
            make_private(&entry?.path())?;
        }
    }
    Ok(())
}

/// `path` with its longest existing ancestor resolved (links, `..`) and the rest appended, so
/// that a run directory not yet created keys the tier as it will once it exists.
fn canonical(path: &Path) -> PathBuf {
    if let Ok(c) = std::fs::canonicalize(path) {
        return c;
    }
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => {
            canonical(if parent.as_os_str().is_empty() { Path::new(".") } else { parent }).join(name)
        }
        _ => std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()),
    }
}

/// Rank `rank`'s peer (which keeps its copy) and source (whose copy it keeps), among `world`
/// ranks of `local_world` a node: the same local rank on the next node, or the next rank on
/// one node.
fn peers(rank: usize, world: usize, local_world: usize) -> (usize, usize) {
    let shift = if world > local_world { local_world } else { 1 } % world;
    ((rank + shift) % world, (rank + world - shift) % world)
}

/// The newest step every rank can restore: rank r from its own copies (`own[r]`) or from
/// those its peer, rank (r + shift) mod world, keeps of it (`copies[peer]`). Steps are 0 where
/// none.
fn choose(own: &[[u64; KEEP]], copies: &[[u64; KEEP]], shift: usize) -> Option<u64> {
    let world = own.len();
    let mut candidates: Vec<u64> = own.iter().chain(copies).flatten().copied().filter(|&s| s > 0).collect();
    candidates.sort_unstable_by(|a, b| b.cmp(a));
    candidates.dedup();
    candidates
        .into_iter()
        .find(|s| (0..world).all(|r| own[r].contains(s) || (world > 1 && copies[(r + shift) % world].contains(s))))
}

/// What the local tier of one node needs: each rank's files (its parts and its copies of
/// [`KEEP`] steps) and its host buffers, for `ranks` ranks.
struct Room {
    files: u64,
    buffers: u64,
    ranks: usize,
}

impl Room {
    /// Refuses a tier directory whose file system has not the room for the files, counting
    /// what this run's copies already hold there (which the new ones replace), and a node whose
    /// `memory` (the bytes this process can have, and where the figure comes from) cannot hold
    /// the host buffers, and the files too where the directory is a tmpfs (`/dev/shm`).
    fn check(&self, root: &Path, memory: Option<(u64, String)>) -> Result<()> {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let ranks = self.ranks as u64;
        let mut at = root.to_path_buf();
        while !at.exists() {
            at = at.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("/"));
        }
        let (free, in_memory) = crate::host::file_system(&at)
            .with_context(|| format!("train.local_checkpoint_dir: cannot stat {}", at.display()))?;
        let held = bytes_under(root);
        let files = self.files * ranks;
        let what = "free memory or disk there, set another directory, or set train.local_checkpoint_every = 0";
        if free + held < files {
            bail!(
                "train.local_checkpoint_dir = {}: the local tier needs {:.3} GiB on this node ({KEEP} steps x (own part + the peer's copy) x {ranks} ranks = {:.3} GiB each), its file system has {:.3} GiB free (+ {:.3} GiB this run's copies hold); {what}",
                root.display(),
                gib(files),
                gib(self.files),
                gib(free),
                gib(held)
            );
        }
        let Some((limit, source)) = memory else { return Ok(()) };
        let on_tmpfs = if in_memory { files.saturating_sub(held) } else { 0 };
        let need = self.buffers * ranks + on_tmpfs;
        if need > limit {
            let tmpfs = if in_memory {
                format!(" + its new files on this tmpfs {:.3} GiB", gib(on_tmpfs))
            } else {
                String::new()
            };
            bail!(
                "train.local_checkpoint_dir = {}: the local tier needs {:.3} GiB of host memory on this node (its host buffers, {:.3} GiB a rank x {ranks} ranks{tmpfs}), this process can have {:.3} GiB ({source}); {what} (train.memory_check=false skips this check)",
                root.display(),
                gib(need),
                gib(self.buffers),
                gib(limit)
            );
        }
        Ok(())
    }
}

/// The bytes of the files under `dir` (0 when it does not exist).
fn bytes_under(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(|e| e.ok())
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

/// A sealed checkpoint directory's files (those its `state.json` lists, then `state.json`)
/// as one buffer: for each, its name's length (u32), the name, its length (u64), its bytes.
fn pack(dir: &Path) -> Result<Vec<u8>> {
    let text = std::fs::read(dir.join(STATE_FILE)).with_context(|| format!("cannot read {}", dir.display()))?;
    let state: State = serde_json::from_slice(&text).map_err(|e| anyhow!("{}: {STATE_FILE}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for name in state.files.keys().map(String::as_str).chain([STATE_FILE]) {
        let bytes =
            std::fs::read(dir.join(name)).with_context(|| format!("cannot read {}", dir.join(name).display()))?;
        out.extend((name.len() as u32).to_le_bytes());
        out.extend(name.as_bytes());
        out.extend((bytes.len() as u64).to_le_bytes());
        out.extend(bytes);
    }
    Ok(out)
}

/// Writes what [`pack`] packed as the directory `dir` (through a temporary sibling, renamed
/// when complete); names must be plain relative paths.
fn unpack(packed: &[u8], dir: &Path) -> Result<()> {
    let tmp = dir.with_file_name(format!(".tmp-{}", dir.file_name().context("a directory")?.to_string_lossy()));
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_dir_all(dir);
    private_builder().create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut at = 0usize;
    let take = |at: &mut usize, n: usize| take_from(packed, at, n, dir);
    while at < packed.len() {
        let len = u32::from_le_bytes(take(&mut at, 4)?.try_into()?) as usize;
        let name = String::from_utf8(take(&mut at, len)?.to_vec())?;
        if !fsutil::is_plain_relative(&name) {
            bail!("the local checkpoint received for {} names the file `{name}`, not a plain name", dir.display());
        }
        let len = u64::from_le_bytes(take(&mut at, 8)?.try_into()?) as usize;
        let path = tmp.join(&name);
        if let Some(parent) = path.parent() {
            private_builder().create(parent)?;
        }
        let write = |bytes: &[u8]| -> std::io::Result<()> {
            use std::os::unix::fs::OpenOptionsExt;
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)?;
            std::io::Write::write_all(&mut file, bytes)?;
            file.sync_all()
        };
        write(take(&mut at, len)?).with_context(|| format!("cannot write {}", path.display()))?;
    }
    // Flushed before the rename, and the rename flushed, as every checkpoint is: a copy under
    // a `step-*` name is complete after a crash of the node's kernel too (`/dev/shm` aside).
    fsutil::sync_dir(&tmp)?;
    std::fs::rename(&tmp, dir).with_context(|| format!("cannot rename {} to {}", tmp.display(), dir.display()))?;
    fsutil::sync_dir(dir.parent().unwrap_or(Path::new(".")))?;
    Ok(())
}

/// The `n` bytes of `packed` from `at`, moving `at` past them (`dir`: the copy, for the error).
fn take_from<'a>(packed: &'a [u8], at: &mut usize, n: usize, dir: &Path) -> Result<&'a [u8]> {
    let part = (packed.get(*at..at.saturating_add(n)))
        .ok_or_else(|| anyhow!("the local checkpoint received for {} is truncated", dir.display()))?;
    *at += n;
    Ok(part)
}

/// Packed files as the f32 words the collectives carry (their bit patterns, the last padded
/// with zeros), and their length in bytes. The local saver converts on its threads, so that
/// the step loop only moves the words.
pub(super) struct Words {
    words: Vec<f32>,
    bytes: usize,
}

impl Words {
    fn of(bytes: &[u8]) -> Words {
        let words = bytes
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                f32::from_bits(u32::from_le_bytes(w))
            })
            .collect();
        Words { words, bytes: bytes.len() }
    }

    fn into_bytes(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 * self.words.len());
        for w in &self.words {
            out.extend_from_slice(&w.to_bits().to_le_bytes());
        }
        out.truncate(self.bytes);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_on_the_next_node_or_the_next_rank() {
        // Two nodes of two: 0 -> 2, 1 -> 3, 2 -> 0, 3 -> 1.
        assert_eq!((0..4).map(|r| peers(r, 4, 2)).collect::<Vec<_>>(), [(2, 2), (3, 3), (0, 0), (1, 1)]);
        // One node of three: the next rank.
        assert_eq!((0..3).map(|r| peers(r, 3, 3)).collect::<Vec<_>>(), [(1, 2), (2, 0), (0, 1)]);
        assert_eq!(peers(0, 1, 1), (0, 0));
    }

    #[test]
    fn the_newest_step_every_rank_can_restore_is_chosen() {
        // Rank 0 lost its own copies; rank 1 keeps rank 0's copies of 6 and 4.
        let own = [[0, 0], [6, 4]];
        let copies = [[6, 4], [6, 4]];
        assert_eq!(choose(&own, &copies, 1), Some(6));
        // Rank 1's copy of rank 0's step 6 is gone too: 4 is the newest all can restore.
        assert_eq!(choose(&own, &[[6, 4], [4, 0]], 1), Some(4));
        // Both copies of rank 0 gone.
        assert_eq!(choose(&own, &[[6, 4], [0, 0]], 1), None);
        // A save cut short: rank 0 wrote 8, rank 1 did not.
        assert_eq!(choose(&[[8, 6], [6, 4]], &[[6, 4], [6, 4]], 1), Some(6));
        assert_eq!(choose(&[[2, 0]], &[[0, 0]], 0), Some(2));
    }

    /// Two virtual devices (FSDP 2: each holds half the state) save step 1 and exchange copies
    /// over the mailboxes; rank 0's own copy is deleted; both restore step 1, rank 0 from the
    /// copy rank 1 sends back, and hold exactly the state they saved.
    #[test]
    fn virtual_devices_restore_a_lost_part_from_the_peers_copy() {
        let tmp = tempfile::tempdir().unwrap();
        let local = tmp.path().join("tier");
        let dir = format!("train.local_checkpoint_dir={}", local.display());
        let c = crate::train::session::tests::config(&[
            "mesh.ici_data=1",
            "mesh.ici_fsdp=2",
            "train.local_checkpoint_every=1",
            &dir,
        ]);
        let run = tmp.path().join("run");
        let states = crate::train::devices::run(&c, 2, |rank, t| {
            let mut tier = LocalTier::open(t, &run, 2)?.expect("the tier is on");
            let mut saver = super::super::local_saver::LocalSaver::new(tier.clone());
            t.train_step(0.0);
            saver.after_step(t, 1)?;
            saver.finish(t)?;
            let saved = t.part_state(DeviceState::default());
            t.train_step(0.0);
            if rank == 0 {
                std::fs::remove_dir_all(local.join("rank-00000"))?;
            }
            let ck = tier.restore(t, None, rank == 0)?.expect("a step every rank can restore");
            t.resume_from(&ck)?;
            Ok((ck.state.step, saved, t.part_state(DeviceState::default())))
        })
        .unwrap();
        for (rank, (step, saved, now)) in states.into_iter().enumerate() {
            assert_eq!(step, 1, "rank {rank}");
            assert!(!saved.chunks.is_empty() && saved == now, "rank {rank}: the restored state is the saved one");
        }
        assert!(local.join("rank-00000/step-000001/state.json").is_file(), "rank 0 keeps the copy as its own");
    }

    /// Saves step 1 of a fresh trainer on `config` (`devices` virtual devices) into the tier of
    /// the run in `run`; returns what each rank saved.
    fn save_step_1(config: &Config, devices: usize, run: &Path) -> Vec<DeviceState> {
        crate::train::devices::run(config, devices, |_, t| {
            let tier = LocalTier::open(t, run, devices)?.expect("the tier is on");
            let mut saver = super::super::local_saver::LocalSaver::new(tier);
            t.train_step(0.0);
            saver.after_step(t, 1)?;
            saver.finish(t)?;
            Ok(t.part_state(DeviceState::default()))
        })
        .unwrap()
    }

    /// Whether the tier of the run in `run` on `config` gives every rank a step to restore
    /// (none of the persistent tier), and then whether every rank loads it.
    fn restores(config: &Config, devices: usize, run: &Path) -> Vec<Option<Result<(), String>>> {
        crate::train::devices::run(config, devices, |rank, t| {
            let mut tier = LocalTier::open(t, run, devices)?.expect("the tier is on");
            let ck = tier.restore(t, None, rank == 0)?;
            Ok(ck.map(|ck| t.resume_from(&ck).map_err(|e| format!("{e:#}"))))
        })
        .unwrap()
    }

    fn tier_config(dir: &Path, extra: &[&str]) -> Config {
        let dir = format!("train.local_checkpoint_dir={}", dir.display());
        crate::train::session::tests::config(&[&["train.local_checkpoint_every=1", &dir][..], extra].concat())
    }

    /// Every directory of the tier is 0700 and every file 0600 (its own parts, the copies it
    /// receives, the tier's directory itself): no other user reads the weights.
    #[test]
    fn the_tiers_files_are_this_users_alone() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let local = tmp.path().join("tier");
        let c = tier_config(&local, &["mesh.ici_data=1", "mesh.ici_fsdp=2"]);
        save_step_1(&c, 2, &tmp.path().join("run"));
        fn walk(path: &Path, seen: &mut Vec<(PathBuf, u32, bool)>) {
            let meta = fs::symlink_metadata(path).unwrap();
            seen.push((path.to_path_buf(), meta.permissions().mode() & 0o7777, meta.is_dir()));
            if meta.is_dir() {
                for e in fs::read_dir(path).unwrap() {
                    walk(&e.unwrap().path(), seen);
                }
            }
        }
        let mut seen = Vec::new();
        walk(&local, &mut seen);
        assert!(seen.iter().any(|(p, _, _)| p.ends_with("copy-of-rank-00001/step-000001/state.json")), "{seen:?}");
        assert!(seen.iter().any(|(p, _, _)| p.ends_with("rank-00000/step-000001/config.toml")), "{seen:?}");
        for (path, mode, dir) in &seen {
            assert_eq!(*mode, if *dir { 0o700 } else { 0o600 }, "{}: {mode:o}", path.display());
        }
    }

    /// A part saved on another mesh of the same size does not hold what this mesh's ranks
    /// need: FSDP 2 then data 2, FSDP 2 then tensor 2, EP 2 then data 2. The tier is skipped
    /// (the run resumes from the persistent tier), where loading it failed the run.
    #[test]
    fn parts_of_another_mesh_of_the_same_size_are_skipped() {
        let mixtral = |dir: &Path, extra: &[&str]| {
            let dir = format!("train.local_checkpoint_dir={}", dir.display());
            let base = [&crate::train::session::tests::SMALL[..], &["train.local_checkpoint_every=1", &dir]].concat();
            let sets = crate::config::recipe::Override::from_list(&[&base[..], extra].concat().join(" "), "test");
            crate::config::recipe::resolve("tiny-mixtral", &sets).unwrap().config
        };
        type Make = fn(&Path, &[&str]) -> Config;
        let llama: Make = tier_config;
        let cases: [(&str, Make, [&str; 3], [&str; 3]); 3] = [
            ("FSDP 2 -> data 2", llama, ["mesh.ici_data=1", "mesh.ici_fsdp=2", ""], ["mesh.ici_data=2", "", ""]),
            (
                "FSDP 2 -> tensor 2",
                llama,
                ["mesh.ici_data=1", "mesh.ici_fsdp=2", ""],
                ["mesh.ici_data=1", "mesh.ici_fsdp=1", "mesh.ici_tensor=2"],
            ),
            ("EP 2 -> data 2", mixtral, ["mesh.ici_data=2", "mesh.ici_expert=2", ""], ["mesh.ici_data=2", "", ""]),
        ];
        for (name, make, from, to) in cases {
            let tmp = tempfile::tempdir().unwrap();
            let (local, run) = (tmp.path().join("tier"), tmp.path().join("run"));
            let sets = |s: [&'static str; 3]| s.into_iter().filter(|s| !s.is_empty()).collect::<Vec<_>>();
            save_step_1(&make(&local, &sets(from)), 2, &run);
            // On the same mesh, the tier restores.
            let same = restores(&make(&local, &sets(from)), 2, &run);
            assert!(same.iter().all(|r| r == &Some(Ok(()))), "{name}: on the same mesh: {same:?}");
            let other = restores(&make(&local, &sets(to)), 2, &run);
            assert!(other.iter().all(Option::is_none), "{name}: {other:?}");
        }
    }

    /// Two runs sharing `train.local_checkpoint_dir`: the second one does not restore the
    /// first's parts; the first still does. A completed run removes its parts and the tier.
    #[test]
    fn parts_of_another_run_are_skipped_and_a_completed_run_removes_its_own() {
        let tmp = tempfile::tempdir().unwrap();
        let local = tmp.path().join("tier");
        let c = tier_config(&local, &["mesh.ici_data=1", "mesh.ici_fsdp=2"]);
        let (first, second) = (tmp.path().join("first"), tmp.path().join("second"));
        save_step_1(&c, 2, &first);
        let other = restores(&c, 2, &second);
        assert!(other.iter().all(Option::is_none), "{other:?}");
        let own = restores(&c, 2, &first);
        assert!(own.iter().all(|r| r == &Some(Ok(()))), "{own:?}");
        let state = state_of(&local.join("rank-00001/step-000001")).unwrap();
        let expected = format!("{:012x}", run_id(&first));
        assert_eq!(state.run.as_deref(), Some(expected.as_str()));
        // Another run's parts stay when a run completes; then its own go, and the tier with them.
        fs::create_dir_all(local.join("rank-00007/step-000003")).unwrap();
        let lines = crate::train::devices::run(&c, 2, |_, t| {
            let tier = LocalTier::open(t, &first, 2)?.expect("the tier is on");
            Ok(tier.remove(t))
        })
        .unwrap();
        assert!(
            lines[0].contains("this run's parts removed from the local tier") && lines[0].contains("(it holds others)")
        );
        assert!(!local.join("rank-00000").exists() && !local.join("copy-of-rank-00001").exists());
        fs::remove_dir_all(local.join("rank-00007")).unwrap();
        let lines = crate::train::devices::run(&c, 2, |_, t| {
            let tier = LocalTier::open(t, &first, 2)?.expect("the tier is on");
            Ok(tier.remove(t))
        })
        .unwrap();
        assert_eq!(lines[0], format!("; local tier {} removed", local.display()));
        assert!(!local.exists());
    }

    /// The default directory is in `/dev/shm`, named for the user and the run; it is created
    /// 0700. One that is a symbolic link (to a directory another user reads), another user's,
    /// or one others can write is refused in one line, and nothing is written through it.
    #[test]
    fn the_tiers_directory_is_this_users_alone_or_refused() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let me = unsafe { libc::geteuid() };
        let run = tmp.path().join("run");
        let default = root_of("", &run);
        assert!(default.to_string_lossy().starts_with(&format!("/dev/shm/engine-local-{me}-")), "{default:?}");
        let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;

        // Through the tier as a run opens it: the default directory planted as a link (to a
        // directory another user reads) is refused and nothing is created where it points.
        let target = tmp.path().join("elsewhere");
        fs::create_dir(&target).unwrap();
        if Path::new("/dev/shm").is_dir() {
            let _ = fs::remove_file(&default);
            std::os::unix::fs::symlink(&target, &default).unwrap();
            let c = crate::train::session::tests::config(&["train.local_checkpoint_every=1"]);
            let e = crate::train::devices::run(&c, 1, |_, t| LocalTier::open(t, &run, 1).map(|_| ()));
            let _ = fs::remove_file(&default);
            let e = format!("{:#}", e.unwrap_err());
            assert!(e.contains("is a symbolic link"), "{e}");
            assert_eq!(fs::read_dir(&target).unwrap().count(), 0, "written through the link");
        }

        let fresh = tmp.path().join("fresh");
        assert!(claim(&fresh, true).unwrap());
        assert_eq!(mode(&fresh), 0o700);
        assert!(!claim(&fresh, true).unwrap(), "this user's own, again");
        fs::set_permissions(&fresh, fs::Permissions::from_mode(0o755)).unwrap();
        claim(&fresh, true).unwrap();
        assert_eq!(mode(&fresh), 0o700, "the default directory is made 0700");
        let nested = tmp.path().join("a/b/tier");
        assert!(claim(&nested, false).unwrap());
        assert_eq!(mode(&nested), 0o700);

        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = claim(&link, true).unwrap_err().to_string();
        assert!(e.contains(&format!("{} is a symbolic link (to {})", link.display(), target.display())), "{e}");
        assert!(e.contains("never follows") && !e.contains('\n'), "{e}");

        let open = tmp.path().join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
        let e = claim(&open, false).unwrap_err().to_string();
        assert!(e.contains("can be written by other users (mode 0777)"), "{e}");
        let file = tmp.path().join("file");
        fs::write(&file, b"").unwrap();
        assert!(claim(&file, false).unwrap_err().to_string().contains("is not a directory"));

        if me != 0 {
            return eprintln!("SKIPPED: another user's directory (needs root to make one)");
        }
        let theirs = tmp.path().join("theirs");
        fs::create_dir(&theirs).unwrap();
        for m in [0o700, 0o777] {
            fs::set_permissions(&theirs, fs::Permissions::from_mode(m)).unwrap();
            std::os::unix::fs::chown(&theirs, Some(12345), Some(12345)).unwrap();
            let e = claim(&theirs, true).unwrap_err().to_string();
            assert!(e.contains("belongs to another user (uid 12345; this process runs as uid 0)"), "{e}");
        }
    }

    #[test]
    fn a_tier_without_room_is_refused_with_the_arithmetic() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("tier");
        let room = |files, buffers| Room { files, buffers, ranks: 2 };
        room(1 << 20, 1 << 20).check(&root, None).unwrap();
        let e = room(1 << 60, 0).check(&root, None).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("train.local_checkpoint_dir = {}: the local tier needs", root.display()))
                && e.contains("x 2 ranks = 1073741824.000 GiB each")
                && e.contains("set train.local_checkpoint_every = 0"),
            "{e}"
        );
        // The host buffers against the memory the process can have.
        let memory = Some((3 << 30, "available RAM (MemAvailable)".to_owned()));
        room(1 << 20, 1 << 30).check(&root, memory.clone()).unwrap();
        let e = room(1 << 20, 2 << 30).check(&root, memory.clone()).unwrap_err().to_string();
        assert!(
            e.contains("needs 4.000 GiB of host memory on this node (its host buffers, 2.000 GiB a rank x 2 ranks)")
                && e.contains("this process can have 3.000 GiB (available RAM (MemAvailable))"),
            "{e}"
        );
    }

    /// On a tmpfs the files take memory too: what this run already holds there is replaced, so
    /// only the rest counts.
    #[test]
    fn a_tier_on_a_tmpfs_counts_its_files_as_memory() {
        if !Path::new("/dev/shm").is_dir() {
            return eprintln!("skipped: no /dev/shm");
        }
        let tmp = tempfile::Builder::new().prefix("engine-room-").tempdir_in("/dev/shm").unwrap();
        let root = tmp.path().join("tier");
        std::fs::create_dir_all(root.join("rank-00000")).unwrap();
        std::fs::write(root.join("rank-00000/part"), vec![0u8; 1 << 20]).unwrap();
        let memory = Some(((8 << 20) - 1, "available RAM (MemAvailable)".to_owned()));
        // 2 ranks x (2 MiB of buffers + 3 MiB of files) - 1 MiB held = 9 MiB.
        let room = Room { files: 3 << 20, buffers: 2 << 20, ranks: 2 };
        let e = room.check(&root, memory).unwrap_err().to_string();
        assert!(e.contains("x 2 ranks + its new files on this tmpfs 0.005 GiB)"), "{e}");
        room.check(&root, Some((9 << 20, String::new()))).unwrap();
    }

    #[test]
    fn packed_files_unpack_byte_for_byte_and_bad_names_are_refused() {
        use crate::checkpoint::testing::{small, snapshot};
        let tmp = tempfile::tempdir().unwrap();
        let config = small();
        let (layout, snap) = snapshot(&config, 4);
        let from = checkpoint::write(&tmp.path().join("a"), &config, &layout, &snap, &Extras::default(), None).unwrap();
        let packed = pack(&from).unwrap();
        let back = Words::of(&packed).into_bytes();
        assert_eq!(back, packed);
        let to = tmp.path().join("b/step-000004");
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        unpack(&back, &to).unwrap();
        let ck = Checkpoint::open(&to).unwrap();
        assert_eq!(ck.snapshot(&layout).unwrap(), snap);
        let e = unpack(&packed[..packed.len() - 3], &tmp.path().join("c")).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        let mut evil = Vec::new();
        evil.extend(5u32.to_le_bytes());
        evil.extend(b"../x1");
        evil.extend(0u64.to_le_bytes());
        let e = unpack(&evil, &tmp.path().join("d")).unwrap_err().to_string();
        assert!(e.contains("not a plain name"), "{e}");
    }
}
