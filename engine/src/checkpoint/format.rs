//! The checkpoint format: what a step's directory holds (`state.json`, its seal and checksums,
//! the whole-file tensors, the configuration), written under a temporary name and renamed, and
//! read back verified.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use super::housekeeping::{dir_name, remove_stale_temporaries_of};
use super::sharded;
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
    /// its data is in `shard-*` files ([`super::sharded`]) instead of the two safetensors files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<usize>,
    /// For a part of the local tier ([`crate::train::local_tier`]): the run that saved it, so
    /// that a run sharing the tier's directory never resumes another's part. Absent in the
    /// persistent tier's checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
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
    // Not into another user's directory (`import-hf --out`); the temporary is removed if it is
    // there (a link planted there goes, never followed) and made new (`mkdir` follows no link).
    fsutil::check_dir_owner(parent)?;
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

fn write_into(
    dir: &Path,
    config: &Config,
    layout: &Layout,
    snap: &Snapshot,
    extras: &Extras,
    pause: Option<u64>,
) -> Result<()> {
    let mut files = BTreeMap::new();
    let mut add = |name: &str, sha256: Option<String>| -> Result<()> {
        files.insert(name.to_owned(), file_sum(&dir.join(name), sha256)?);
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
        crate::say!("{PAUSE_HOOK}: the save of step {} stops after {MODEL_FILE}", snap.step);
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
    let progress =
        Progress { step: snap.step, position: snap.position.clone(), data_tokens: snap.data_tokens, run: None };
    seal(dir, config, progress, None, files, extras)
}

/// The size and SHA-256 of a file written into a checkpoint: the hash the writer computed on the
/// way, or read back now.
fn file_sum(path: &Path, sha256: Option<String>) -> Result<FileSum> {
    let bytes = fs::metadata(path)?.len();
    let sha256 = match sha256 {
        Some(h) => h,
        None => sha256_file(path)?,
    };
    Ok(FileSum { bytes, sha256 })
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
    /// The run saving it, for a part of the local tier ([`State::run`]); none elsewhere.
    pub run: Option<String>,
}

/// Completes a checkpoint directory whose data files are written and listed in `files`: the
/// configuration, the extra files, then `state.json` last, everything flushed. `shards` is the
/// number of devices that saved a sharded checkpoint.
pub(super) fn seal(
    dir: &Path,
    config: &Config,
    progress: Progress,
    shards: Option<usize>,
    mut files: BTreeMap<String, FileSum>,
    extras: &Extras,
) -> Result<()> {
    let mut add = |name: &str| -> Result<()> {
        files.insert(name.to_owned(), file_sum(&dir.join(name), None)?);
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
        run: progress.run,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::testing::{small, snapshot};

    #[test]
    fn a_checkpoint_reads_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let config = small();
        let (layout, snap) = snapshot(&config, 12);
        let extras =
            Extras { files: vec![("hf/config.json".into(), b"{}".to_vec())], hf_dtype: Some("bfloat16".into()) };
        let path = write(dir.path(), &config, &layout, &snap, &extras, None).unwrap();
        assert_eq!(path, dir.path().join("step-000012"));
        let ck = Checkpoint::open(&path).unwrap();
        assert_eq!(ck.config, config);
        assert_eq!(
            (ck.state.step, ck.state.seed, ck.state.hf_dtype.as_deref()),
            (12, config.train.seed, Some("bfloat16"))
        );
        assert_eq!(ck.snapshot(&layout).unwrap(), snap);
        assert_eq!(ck.hf_files().unwrap(), extras.files);
        // No temporary directory is left behind.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn damage_is_detected_and_named() {
        let config = small();
        let (layout, snap) = snapshot(&config, 3);
        type Damage = fn(&Path);
        let cases: [(&str, Damage); 4] = [
            ("model.safetensors is", |d| {
                let p = d.join(MODEL_FILE);
                let b = fs::read(&p).unwrap();
                fs::write(&p, &b[..b.len() / 2]).unwrap();
            }),
            ("optimizer.safetensors does not match its SHA-256", |d| {
                let p = d.join(OPTIMIZER_FILE);
                let mut b = fs::read(&p).unwrap();
                let n = b.len() - 5;
                b[n] ^= 1;
                fs::write(&p, b).unwrap();
            }),
            ("config.toml is missing", |d| fs::remove_file(d.join(CONFIG_FILE)).unwrap()),
            ("state.json is not a valid checkpoint state", |d| fs::write(d.join(STATE_FILE), "{\"step\":").unwrap()),
        ];
        for (expected, damage) in cases {
            let dir = tempfile::tempdir().unwrap();
            let path = write(dir.path(), &config, &layout, &snap, &Extras::default(), None).unwrap();
            damage(&path);
            let e = format!("{:#}", Checkpoint::open(&path).unwrap_err());
            assert!(e.contains("is damaged") && e.contains(expected), "{expected}: {e}");
        }
    }

    #[test]
    fn names_that_leave_the_checkpoint_are_refused_under_a_valid_seal() {
        let config = small();
        let (layout, snap) = snapshot(&config, 2);
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("secret");
        fs::write(&secret, b"not the checkpoint's").unwrap();
        let sum = FileSum { bytes: 20, sha256: sha256_hex(b"not the checkpoint's") };
        type Tamper = fn(&Path, &Path) -> String;
        let cases: [(Tamper, &str); 4] = [
            (|_, secret| format!("hf/{}", secret.display()), "which is not a name inside the checkpoint directory"),
            (|_, secret| format!("../{}", secret.file_name().unwrap().to_str().unwrap()), "not a name inside"),
            (
                |d, secret| {
                    std::os::unix::fs::symlink(secret, d.join("hf/tokenizer.json")).unwrap();
                    "hf/tokenizer.json".into()
                },
                "leads outside",
            ),
            (
                |d, secret| {
                    fs::create_dir_all(d.join("hf/sub")).unwrap();
                    fs::copy(secret, d.join("hf/sub/x")).unwrap();
                    "hf/sub/x".into()
                },
                "the hf/ files are plain names directly under hf/",
            ),
        ];
        for (tamper, expected) in cases {
            let dir = tempfile::tempdir().unwrap();
            let extras = Extras { files: vec![("hf/config.json".into(), b"{}".to_vec())], hf_dtype: None };
            let path = write(dir.path(), &config, &layout, &snap, &extras, None).unwrap();
            let mut state = Checkpoint::open(&path).unwrap().state;
            state.files.insert(tamper(&path, &secret), sum.clone());
            fs::write(path.join(STATE_FILE), state.sealed_text().unwrap()).unwrap();
            let e = Checkpoint::open(&path).and_then(|ck| ck.hf_files().map(|_| ())).unwrap_err();
            assert!(format!("{e:#}").contains(expected), "{expected}: {e:#}");
        }
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 1);
    }
}
