//! Checkpoints: one directory per saved step, written so that a crash never leaves one that
//! looks complete but is not (docs/checkpoints.md).
//!
//! ```text
//! RUN_DIR/checkpoints/step-000120/
//!   shard-*-of-N.safetensors, .json  each saving device's flat buffers and chunks ([`sharded`])
//!   config.toml                      the resolved configuration
//!   hf/...                           files of the Hugging Face model this one started from (optional)
//!   state.json                       step, data position, seed, config hash, SHA-256 of every other file
//! ```
//!
//! Training saves the sharded format on every mesh, one device included
//! (`train/checkpointer.rs`); the whole-file format (`model.safetensors` under Hugging
//! Face names, `optimizer.safetensors` with the moments), which single devices saved before, is
//! still read, and [`write`] still writes it for `import-hf`. A save writes everything into a
//! `.tmp-*` sibling, flushes every file, writes `state.json` last, flushes the directory and
//! renames it to `step-000120`: a directory under a `step-*` name is complete. Loading verifies
//! every file's size and SHA-256 against `state.json` and refuses a damaged checkpoint, naming
//! the file.
//!
//! The engine's randomness is counter-based ([`crate::rng`]): initialisation and data order are
//! pure functions of the seed, so the seed and the loader's position are the whole random state.

pub mod sharded;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::data::Position;
use crate::digest::{sha256_file, sha256_hex};
use crate::fsutil::{self, write_atomic};
use crate::model::Layout;
use crate::tensors::{self, FloatType, Mapped};

/// `state.json`'s `format`.
pub const FORMAT: &str = "engine-checkpoint";
/// The layout version this engine writes and reads.
pub const VERSION: u32 = 1;
/// The parameters of a whole-file checkpoint (the format single devices saved before every run
/// saved the sharded one; still read, and written by `import-hf`).
pub const MODEL_FILE: &str = "model.safetensors";
/// The optimizer moments.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The resolved configuration.
pub const CONFIG_FILE: &str = "config.toml";
/// The training state and checksums; written last.
pub const STATE_FILE: &str = "state.json";
/// Environment variable of the crash test: the save of this step stops after its first file
/// (and prints a line saying so), so that a test can kill the process in the middle of a save.
pub const PAUSE_HOOK: &str = "ENGINE_TEST_PAUSE_SAVE";

/// Size and SHA-256 of one file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    /// Length in bytes.
    pub bytes: u64,
    /// SHA-256, lower-case hex.
    pub sha256: String,
}

/// `state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// Always [`FORMAT`].
    pub format: String,
    /// Layout version ([`VERSION`]).
    pub version: u32,
    /// Optimizer steps completed.
    pub step: u64,
    /// Where the loader continues.
    pub data_position: Position,
    /// Tokens in the training data when saved (a resumed run must read the same data).
    pub data_tokens: u64,
    /// For a run on shards, each shard of its data: file name → SHA-256 of its header, which
    /// holds its token count and the digest of its tokens ([`crate::data::fingerprint`]). A
    /// resumed run whose shards differ is refused. Absent for the embedded corpus and synthetic
    /// tokens, and in checkpoints of earlier engines (which resume comparing the token count
    /// alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_shards: Option<BTreeMap<String, String>>,
    /// The seed: with the data position, all of the engine's random state.
    pub seed: u64,
    /// SHA-256 of `config.toml`.
    pub config_sha256: String,
    /// Every other file of the checkpoint (relative path → size and hash).
    pub files: BTreeMap<String, FileSum>,
    /// The engine that wrote it.
    pub engine_version: String,
    /// The dtype of the Hugging Face weights the model was imported from, kept for export.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf_dtype: Option<String>,
    /// For a sharded checkpoint (saved by a parallel run), the number of devices that saved it:
    /// its data is in `shard-*` files ([`sharded`]) instead of the two safetensors files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<usize>,
    /// SHA-256 of the rest of this file in canonical form (compact JSON, keys sorted): an edited
    /// `state.json` (a step, a data position changed by hand) is refused. Absent in checkpoints
    /// of earlier engines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal: Option<String>,
}

impl State {
    /// The text of `state.json`: the state, sealed with the hash of its canonical form.
    pub fn sealed_text(&self) -> Result<String> {
        let mut state = self.clone();
        state.seal = Some(state.seal_of()?);
        Ok(serde_json::to_string_pretty(&state)?)
    }

    /// The SHA-256 of the state without its seal, as compact JSON with every object's keys
    /// sorted: a form any JSON tool can reproduce.
    fn seal_of(&self) -> Result<String> {
        let mut value = serde_json::to_value(self)?;
        if let Some(map) = value.as_object_mut() {
            map.remove("seal");
        }
        value.sort_all_objects();
        Ok(sha256_hex(serde_json::to_string(&value)?.as_bytes()))
    }

    /// Whether the seal matches the rest of the state (a state without a seal passes).
    fn seal_holds(&self) -> bool {
        self.seal.as_ref().is_none_or(|seal| self.seal_of().is_ok_and(|s| s == *seal))
    }
}

/// Everything a checkpoint holds, on the host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Optimizer steps completed.
    pub step: u64,
    /// The loader's position.
    pub position: Position,
    /// Tokens in the training data.
    pub data_tokens: u64,
    /// Parameters in layout order.
    pub params: Vec<f32>,
    /// AdamW first and second moments in layout order; none for an imported model.
    pub moments: Option<(Vec<f32>, Vec<f32>)>,
}

/// What to write besides the snapshot.
#[derive(Debug, Clone, Default)]
pub struct Extras {
    /// Files copied into the checkpoint as they are (relative path, contents): the Hugging Face
    /// model's config and tokenizer, for export.
    pub files: Vec<(String, Vec<u8>)>,
    /// See [`State::hf_dtype`].
    pub hf_dtype: Option<String>,
}

/// The name of the directory of step `step`.
pub fn dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// Writes a checkpoint of `snap` as `parent/step-NNNNNN` (see the module doc). `pause` is the
/// crash test's hook: the step whose save stops after its first file.
pub fn write(
    parent: &Path,
    config: &Config,
    layout: &Layout,
    snap: &Snapshot,
    extras: &Extras,
    pause: Option<u64>,
) -> Result<PathBuf> {
    fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let dir = parent.join(dir_name(snap.step));
    write_dir(&dir, config, layout, snap, extras, pause)?;
    Ok(dir)
}

/// Writes a checkpoint directory at `dir` (which must not exist): into a temporary sibling,
/// flushed, then renamed.
pub fn write_dir(
    dir: &Path,
    config: &Config,
    layout: &Layout,
    snap: &Snapshot,
    extras: &Extras,
    pause: Option<u64>,
) -> Result<()> {
    if dir.exists() {
        bail!("{} already exists", dir.display());
    }
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = dir.file_name().context("checkpoint path has no name")?.to_string_lossy();
    let tmp = parent.join(format!(".tmp-{name}-{}", std::process::id()));
    remove_stale_temporaries_of(parent, &name)?;
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let result = write_into(&tmp, config, layout, snap, extras, pause).and_then(|()| {
        fs::rename(&tmp, dir)?;
        fsutil::sync_dir(parent)?;
        Ok(())
    });
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e.context(format!("cannot write checkpoint {}", dir.display())));
    }
    Ok(())
}

/// Removes `parent/.tmp-NAME-PID` directories that [`write_dir`] left when killed: those of
/// processes that no longer run (an import into `NAME` running now keeps its own).
fn remove_stale_temporaries_of(parent: &Path, name: &str) -> Result<()> {
    let Ok(entries) = fs::read_dir(parent) else { return Ok(()) };
    let prefix = format!(".tmp-{name}-");
    for entry in entries.filter_map(|e| e.ok()) {
        let file_name = entry.file_name();
        let Some(pid) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)).and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if !fsutil::process_alive(pid) {
            let path = entry.path();
            let removed = if path.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
            removed.with_context(|| format!("cannot remove {}, left by a killed process", entry.path().display()))?;
        }
    }
    Ok(())
}

fn write_into(
    dir: &Path,
    config: &Config,
    layout: &Layout,
    snap: &Snapshot,
    extras: &Extras,
    pause: Option<u64>,
) -> Result<()> {
    let mut files = BTreeMap::new();
    // Records a file written, with its hash when the writer computed it on the way.
    let mut add = |name: &str, sha256: Option<String>| -> Result<()> {
        let path = dir.join(name);
        let bytes = fs::metadata(&path)?.len();
        let sha256 = match sha256 {
            Some(h) => h,
            None => sha256_file(&path)?,
        };
        files.insert(name.to_owned(), FileSum { bytes, sha256 });
        Ok(())
    };
    let tensors: Vec<(String, &[f32], Vec<usize>)> = layout
        .tensors
        .iter()
        .map(|t| (t.name.clone(), &snap.params[t.offset..t.offset + t.len()], t.shape.clone()))
        .collect();
    let sha = tensors::write(&dir.join(MODEL_FILE), &tensors, FloatType::F32)?;
    add(MODEL_FILE, Some(sha))?;
    if pause == Some(snap.step) {
        eprintln!("{PAUSE_HOOK}: the save of step {} stops after {MODEL_FILE}", snap.step);
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
    if let Some((m, v)) = &snap.moments {
        let mut moments = Vec::with_capacity(2 * layout.tensors.len());
        for (prefix, buf) in [("exp_avg", m), ("exp_avg_sq", v)] {
            for t in &layout.tensors {
                moments.push((format!("{prefix}.{}", t.name), &buf[t.offset..t.offset + t.len()], t.shape.clone()));
            }
        }
        let sha = tensors::write(&dir.join(OPTIMIZER_FILE), &moments, FloatType::F32)?;
        add(OPTIMIZER_FILE, Some(sha))?;
    }
    let progress = Progress { step: snap.step, position: snap.position.clone(), data_tokens: snap.data_tokens };
    seal(dir, config, progress, None, files, extras)
}

/// What a checkpoint records of the run besides its tensors and configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Optimizer steps completed.
    pub step: u64,
    /// Where the loader continues.
    pub position: Position,
    /// Tokens in the training data (a resumed run must read the same data).
    pub data_tokens: u64,
}

/// Completes a checkpoint directory whose data files are written and listed in `files`: the
/// configuration, the extra files, then `state.json` last, everything flushed. `shards` is the
/// number of devices that saved a sharded checkpoint.
fn seal(
    dir: &Path,
    config: &Config,
    progress: Progress,
    shards: Option<usize>,
    mut files: BTreeMap<String, FileSum>,
    extras: &Extras,
) -> Result<()> {
    let mut add = |name: &str| -> Result<()> {
        let path = dir.join(name);
        files.insert(name.to_owned(), FileSum { bytes: fs::metadata(&path)?.len(), sha256: sha256_file(&path)? });
        Ok(())
    };
    let config_text = toml::to_string(config)?;
    write_atomic(&dir.join(CONFIG_FILE), config_text.as_bytes())?;
    add(CONFIG_FILE)?;
    for (name, bytes) in &extras.files {
        let path = dir.join(name);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        write_atomic(&path, bytes)?;
        add(name)?;
    }
    let state = State {
        format: FORMAT.into(),
        version: VERSION,
        step: progress.step,
        data_position: progress.position,
        data_tokens: progress.data_tokens,
        // Read from the shards' headers (a few bytes each). Data that cannot be read now (moved
        // away mid-run) leaves the record out rather than fail the save.
        data_shards: crate::data::fingerprint(&config.data).ok().flatten(),
        seed: config.train.seed,
        config_sha256: sha256_hex(config_text.as_bytes()),
        files,
        engine_version: env!("CARGO_PKG_VERSION").into(),
        hf_dtype: extras.hf_dtype.clone(),
        shards,
        seal: None,
    };
    write_atomic(&dir.join(STATE_FILE), state.sealed_text()?.as_bytes())?;
    for sub in extras.files.iter().filter_map(|(n, _)| Path::new(n).parent()).filter(|p| !p.as_os_str().is_empty()) {
        fsutil::sync_dir(&dir.join(sub))?;
    }
    fsutil::sync_dir(dir)?;
    Ok(())
}

/// A verified checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Its directory.
    pub dir: PathBuf,
    /// Its `state.json`.
    pub state: State,
    /// Its configuration.
    pub config: Config,
}

impl Checkpoint {
    /// Opens a checkpoint directory and verifies every file against `state.json`: a missing,
    /// truncated or altered file is an error naming it.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let d = dir.display();
        let state_path = dir.join(STATE_FILE);
        let text = fs::read(&state_path).map_err(|e| {
            if dir.exists() {
                anyhow!("checkpoint {d} is incomplete: cannot read {STATE_FILE}: {e}")
            } else {
                anyhow!("checkpoint {d} does not exist")
            }
        })?;
        let state: State = serde_json::from_slice(&text)
            .map_err(|e| anyhow!("checkpoint {d} is damaged: {STATE_FILE} is not a valid checkpoint state ({e})"))?;
        if state.format != FORMAT || state.version != VERSION {
            bail!(
                "checkpoint {d}: format {} version {}, this engine reads {FORMAT} version {VERSION}",
                state.format,
                state.version
            );
        }
        if !state.seal_holds() {
            bail!("checkpoint {d} is damaged: {STATE_FILE} does not match its seal (edited by hand or corrupted)");
        }
        let named = dir.file_name().and_then(|n| n.to_str()?.strip_prefix("step-")?.parse::<u64>().ok());
        if let Some(named) = named.filter(|&n| n != state.step) {
            bail!(
                "checkpoint {d}: {STATE_FILE} says step {}, the directory is named for step {named} (moved or edited?)",
                state.step
            );
        }
        // Names become paths here and in export (`hf/` files): each must be a file inside the
        // directory, whatever state.json says (its seal is a checksum anyone can recompute).
        let root = fs::canonicalize(dir).with_context(|| format!("cannot read checkpoint {d}"))?;
        for (name, sum) in &state.files {
            if !fsutil::is_plain_relative(name) {
                bail!(
                    "checkpoint {d}: {STATE_FILE} lists the file `{name}`, which is not a name inside the checkpoint directory (absolute, empty, or with `.` or `..`); refused"
                );
            }
            let path = dir.join(name);
            let bytes =
                fs::metadata(&path).map_err(|e| anyhow!("checkpoint {d} is damaged: {name} is missing ({e})"))?.len();
            fsutil::regular_file_under(&path, &root).map_err(|e| anyhow!("checkpoint {d}: {e}; refused"))?;
            if bytes != sum.bytes {
                bail!("checkpoint {d} is damaged: {name} is {bytes} bytes, {} when saved (truncated?)", sum.bytes);
            }
            if sha256_file(&path)? != sum.sha256 {
                bail!("checkpoint {d} is damaged: {name} does not match its SHA-256 in {STATE_FILE} (corrupted)");
            }
        }
        if (state.shards.is_none() && !state.files.contains_key(MODEL_FILE)) || !state.files.contains_key(CONFIG_FILE) {
            bail!("checkpoint {d} is damaged: {STATE_FILE} lists no {MODEL_FILE} or {CONFIG_FILE}");
        }
        if state.files[CONFIG_FILE].sha256 != state.config_sha256 {
            bail!("checkpoint {d} is damaged: {STATE_FILE} names two different hashes of {CONFIG_FILE}");
        }
        let config_text = fs::read_to_string(dir.join(CONFIG_FILE))?;
        let config: Config =
            toml::from_str(&config_text).map_err(|e| anyhow!("checkpoint {d}: {CONFIG_FILE}: {}", e.message()))?;
        config.validate().map_err(|e| anyhow!("checkpoint {d}: {CONFIG_FILE}: {e}"))?;
        Ok(Checkpoint { dir: dir.to_path_buf(), state, config })
    }

    /// The parameters, in the layout of `layout` (which must be the checkpoint's model's).
    pub fn params(&self, layout: &Layout) -> Result<Vec<f32>> {
        if self.state.shards.is_some() {
            return self.read_whole(sharded::Part::Params, layout);
        }
        let params = read_tensors(&self.dir.join(MODEL_FILE), layout, "")?;
        self.ensure_finite(
            sharded::Part::Params,
            &[sharded::Chunk { global: 0, local: 0, len: params.len() }],
            &params,
        )?;
        Ok(params)
    }

    /// `part` of a sharded checkpoint in single-device layout order.
    fn read_whole(&self, part: sharded::Part, layout: &Layout) -> Result<Vec<f32>> {
        let mut out = vec![0f32; layout.len];
        self.read_chunks(part, &[sharded::Chunk { global: 0, local: 0, len: layout.len }], &mut out)?;
        Ok(out)
    }

    /// The AdamW moments, if the checkpoint has them.
    pub fn moments(&self, layout: &Layout) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        if self.state.shards.is_some() {
            let (m, v) = (sharded::Part::ExpAvg, sharded::Part::ExpAvgSq);
            return Ok(Some((self.read_whole(m, layout)?, self.read_whole(v, layout)?)));
        }
        if !self.state.files.contains_key(OPTIMIZER_FILE) {
            return Ok(None);
        }
        let path = self.dir.join(OPTIMIZER_FILE);
        Ok(Some((read_tensors(&path, layout, "exp_avg.")?, read_tensors(&path, layout, "exp_avg_sq.")?)))
    }

    /// Files under `hf/` (the Hugging Face model's config and tokenizer), for export: each a
    /// plain name directly under `hf/`.
    pub fn hf_files(&self) -> Result<Vec<(String, Vec<u8>)>> {
        (self.state.files.keys())
            .filter(|n| n.starts_with("hf/"))
            .map(|n| {
                if n["hf/".len()..].contains('/') || !fsutil::is_plain_relative(n) {
                    bail!(
                        "checkpoint {}: {STATE_FILE} lists {n}, but the hf/ files are plain names directly under hf/",
                        self.dir.display()
                    );
                }
                Ok((n.clone(), fs::read(self.dir.join(n))?))
            })
            .collect()
    }

    /// The full snapshot (parameters, moments, position) for resuming training.
    pub fn snapshot(&self, layout: &Layout) -> Result<Snapshot> {
        Ok(Snapshot {
            step: self.state.step,
            position: self.state.data_position.clone(),
            data_tokens: self.state.data_tokens,
            params: self.params(layout)?,
            moments: self.moments(layout)?,
        })
    }
}

/// Reads every tensor of `layout`, named `prefix + name`, from a safetensors file into one flat
/// buffer; a missing or misshapen tensor is an error naming it.
fn read_tensors(path: &Path, layout: &Layout, prefix: &str) -> Result<Vec<f32>> {
    let file = Mapped::open(path)?;
    let st = file.tensors();
    let mut out = vec![0f32; layout.len];
    for t in &layout.tensors {
        let name = format!("{prefix}{}", t.name);
        let view = st.tensor(&name).map_err(|_| anyhow!("{}: tensor {name} is missing", path.display()))?;
        if view.shape() != t.shape.as_slice() {
            bail!("{}: tensor {name} has shape {:?}, the model needs {:?}", path.display(), view.shape(), t.shape);
        }
        tensors::read_f32(&name, &view, &mut out[t.offset..t.offset + t.len()])?;
    }
    Ok(out)
}

/// The complete checkpoints under `parent` (directories named `step-N`), oldest first.
/// Temporary directories of saves that did not finish are not listed.
pub fn list(parent: &Path) -> Result<Vec<(u64, PathBuf)>> {
    if !parent.exists() {
        return Ok(Vec::new());
    }
    let mut out: Vec<(u64, PathBuf)> = fs::read_dir(parent)
        .with_context(|| format!("cannot list {}", parent.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("step-")?.parse().ok()?;
            e.path().is_dir().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Removes what interrupted saves left under `parent` (`.tmp-*` directories); returns them.
pub fn remove_temporaries(parent: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    if !parent.exists() {
        return Ok(removed);
    }
    for e in fs::read_dir(parent)?.filter_map(|e| e.ok()) {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            fs::remove_dir_all(e.path()).with_context(|| format!("cannot remove {}", e.path().display()))?;
            removed.push(e.path());
        }
    }
    Ok(removed)
}

/// Renames the complete checkpoints newer than `step` to `superseded-step-N` (a run resumed
/// from `step` replaces what followed it; they are kept for the user to inspect or remove, but
/// no longer count as checkpoints). Returns their new paths.
pub fn set_aside_after(parent: &Path, step: u64) -> Result<Vec<PathBuf>> {
    let mut moved = Vec::new();
    for (s, dir) in list(parent)?.into_iter().filter(|(s, _)| *s > step) {
        let to = parent.join(format!("superseded-{}-{}", dir_name(s), std::process::id()));
        fs::rename(&dir, &to).with_context(|| format!("cannot move {} aside", dir.display()))?;
        moved.push(to);
    }
    if !moved.is_empty() {
        fsutil::sync_dir(parent)?;
    }
    Ok(moved)
}

/// Removes the oldest complete checkpoints beyond the newest `keep_last` (0 keeps all), except
/// the steps that are multiples of `keep_every` (0: none), which are kept for good. Each is
/// renamed away first, so a half-removed directory never looks like a checkpoint.
pub fn prune(parent: &Path, keep_last: usize, keep_every: usize) -> Result<()> {
    let all = list(parent)?;
    if keep_last == 0 || all.len() <= keep_last {
        return Ok(());
    }
    let permanent = |step: u64| keep_every > 0 && step.is_multiple_of(keep_every as u64);
    let doomed: Vec<_> = all[..all.len() - keep_last].iter().filter(|(step, _)| !permanent(*step)).collect();
    for (step, dir) in &doomed {
        let away = parent.join(format!(".tmp-removing-{}", dir_name(*step)));
        fs::rename(dir, &away).with_context(|| format!("cannot remove {}", dir.display()))?;
        fs::remove_dir_all(&away).with_context(|| format!("cannot remove {}", away.display()))?;
    }
    if !doomed.is_empty() {
        fsutil::sync_dir(parent)?;
    }
    Ok(())
}

/// The newest complete checkpoint under `parent`, verified. A damaged newest checkpoint is an
/// error (naming the file and the previous checkpoint), never skipped silently.
pub fn latest(parent: &Path) -> Result<Option<Checkpoint>> {
    let all = list(parent)?;
    let Some((_, newest)) = all.last() else { return Ok(None) };
    Checkpoint::open(newest).map(Some).map_err(|e| match all.len() {
        1 => e,
        n => e.context(format!(
            "the previous checkpoint is {}; resume from it with --resume {} after checking the damage",
            all[n - 2].1.display(),
            all[n - 2].1.display()
        )),
    })
}

/// Configuration keys that may change between a run and its resumption: they do not change
/// what the next step computes (`train.steps` moves the end of the run and, with a cosine
/// schedule whose `decay_steps` is 0, the schedule too; `data.path` may move, the data may not).
/// The `mesh.*` keys may change too: checkpoints hold the whole, unsharded state, and the data
/// position counts the samples of all ranks; so may the pipeline's micro-batches, schedule and layer split,
/// which cut the same global batch differently (a pipeline run resumes on one device).
pub const RESUMABLE_KEYS: [&str; 19] = [
    "description",
    "extends",
    "train.steps",
    "train.peak_tflops",
    "train.perf_warmup_steps",
    "train.profile_step",
    "train.checkpoint_every",
    "train.checkpoint_every_minutes",
    "train.keep_last",
    "train.keep_every_n_steps",
    "train.memory_check",
    "train.eval_every",
    "train.eval_steps",
    "train.pipeline_microbatches",
    "train.pipeline_schedule",
    "train.pipeline_virtual_stages",
    "train.pipeline_layers",
    "train.pipeline_split",
    "data.path",
];

/// The keys whose values differ between a checkpoint's configuration and the current one, other
/// than [`RESUMABLE_KEYS`] and `mesh.*`, as `key (checkpoint A, now B)`.
pub fn incompatible_keys(saved: &Config, now: &Config) -> Vec<String> {
    fn flatten(prefix: &str, v: &toml::Value, out: &mut BTreeMap<String, String>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    flatten(&key, v, out);
                }
            }
            other => {
                out.insert(prefix.to_owned(), other.to_string());
            }
        }
    }
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    flatten("", &toml::Value::try_from(saved).expect("configs serialize"), &mut a);
    flatten("", &toml::Value::try_from(now).expect("configs serialize"), &mut b);
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| !RESUMABLE_KEYS.contains(&k.as_str()) && !k.starts_with("mesh.") && a.get(*k) != b.get(*k))
        .map(|k| {
            let show = |m: &BTreeMap<String, String>| m.get(k).cloned().unwrap_or_else(|| "unset".into());
            format!("{k} (checkpoint {}, now {})", show(&a), show(&b))
        })
        .collect()
}

/// The checkpoint a run on `devices` devices resumes from: `explicit` if given, else the newest
/// complete one under `parent`; verified, and refused (naming the keys) if `config` differs in
/// what matters. The global batch (`train.batch_size` × devices) must stay the same: on another
/// device count, `train.batch_size` changes with it, and a run that would train another global
/// batch is refused, whether `batch_size` or the device count changed, with the `batch_size`
/// that keeps it.
pub fn resume_point(parent: &Path, explicit: Option<&Path>, config: &Config, devices: usize) -> Result<Checkpoint> {
    let ck = match explicit {
        Some(dir) => Checkpoint::open(dir)?,
        None => latest(parent)?
            .ok_or_else(|| anyhow!("--resume: no complete checkpoint in {} to resume from", parent.display()))?,
    };
    // First, since nothing else about it matters: a model without optimizer state (an
    // import-hf output) starts runs, it does not continue one.
    if ck.state.shards.is_none() && !ck.state.files.contains_key(OPTIMIZER_FILE) {
        bail!(
            "cannot resume from {}: it has no optimizer state (an import-hf output?), so it can start a run, not resume one; start from the Hugging Face model with --init-from-hf DIR instead of --resume",
            ck.dir.display()
        );
    }
    let saved_on = ck.state.shards.unwrap_or(1);
    let (saved, now) = (ck.config.train.batch_size * saved_on, config.train.batch_size * devices);
    let mut differ = incompatible_keys(&ck.config, config);
    differ.retain(|k| !k.starts_with("train.batch_size "));
    if (saved.0 - now.0).abs() > 1e-9 * saved.0.max(now.0) {
        // A batch size that would keep the global batch on this many devices.
        let keep = crate::config::BatchSize(saved.0 / devices as f64);
        let on = |n: usize| if n == 1 { "1 device".to_owned() } else { format!("{n} devices") };
        differ.push(format!(
            "the global batch (checkpoint train.batch_size {} x {} = {saved} sequences, now {} x {} = {now}: the curve would change; --set train.batch_size={keep} keeps it)",
            ck.config.train.batch_size,
            on(saved_on),
            config.train.batch_size,
            on(devices),
        ));
    }
    if !differ.is_empty() {
        bail!(
            "cannot resume from {}: the configuration differs in {}; resume with the checkpoint's settings (its config.toml) or start a new run",
            ck.dir.display(),
            differ.join(", ")
        );
    }
    check_data(&ck, config)?;
    Ok(ck)
}

/// A checkpoint saved on shards resumes only on the same shards: each one named as then, with
/// the header it had (its token count and content digest). A shard edited in place with its
/// header kept is refused when it is opened ([`crate::data::shard`]). Checkpoints that recorded
/// no shards (earlier engines) resume as before, on the token count alone.
fn check_data(ck: &Checkpoint, config: &Config) -> Result<()> {
    let Some(saved) = &ck.state.data_shards else { return Ok(()) };
    let now = crate::data::fingerprint(&config.data)?.unwrap_or_default();
    let d = ck.dir.display();
    let path = match config.data.mixture.is_empty() {
        true => format!("data.path = {}", config.data.path),
        false => "data.mixture".to_owned(),
    };
    let advice = "resume on the data the run trained on, or start a new run in another --run-dir";
    for (name, header) in saved {
        match now.get(name) {
            None => bail!(
                "cannot resume from {d}: shard {name}, part of the data it was saved with, is not in {path}; {advice}"
            ),
            Some(h) if h != header => bail!(
                "cannot resume from {d}: shard {name} in {path} changed since the checkpoint was saved (its header and content digest differ); {advice}"
            ),
            Some(_) => {}
        }
    }
    if let Some(extra) = now.keys().find(|n| !saved.contains_key(*n)) {
        bail!(
            "cannot resume from {d}: shard {extra} in {path} was not part of the data the checkpoint was saved with; {advice}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests;
