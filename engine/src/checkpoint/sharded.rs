//! Sharded checkpoints: each device of a parallel run saves what it holds, and any mesh (one
//! device included) loads what it needs, whatever mesh saved it.
//!
//! ```text
//! step-000120/
//!   shard-00000-of-00004.safetensors  the device's flat buffers: params, exp_avg, exp_avg_sq
//!   shard-00000-of-00004.json         its chunks: [global, local, len] triples
//!   ...                               (one pair per saving device)
//!   config.toml, state.json           as in a single-device checkpoint; state.json says `shards`
//! ```
//!
//! A device's buffers are its tensor-parallel slice, or its FSDP pieces of it; a chunk says
//! that `len` elements from `local` in the device's buffers are elements `global..` of the
//! single-device layout (Hugging Face order). Loading is the same for every mesh: the loader
//! lists the chunks it needs in its own layout and copies each from whichever saved chunks
//! cover it (resharding); a gap is an error. Devices that hold a copy of another's buffers
//! (data-parallel replicas) do not save. A single-device checkpoint reads the same way, its
//! tensors standing for one chunk each.
//!
//! Saving is collective: every device writes its pair into the same temporary directory, the
//! devices wait for each other, then rank 0 hashes the files, writes `config.toml` and
//! `state.json` and renames the directory, as for a single-device checkpoint.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use super::{Checkpoint, Extras, FileSum, MODEL_FILE, OPTIMIZER_FILE, Progress, seal};
use crate::config::Config;
use crate::digest::sha256_file;
use crate::model::Layout;
use crate::tensors::{self, FloatType, Mapped};

/// `len` elements from `local` in a device's flat buffers are elements from `global` of the
/// single-device layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// First element in the single-device layout.
    pub global: usize,
    /// First element in the device's buffers.
    pub local: usize,
    /// Elements.
    pub len: usize,
}

/// Which of a checkpoint's three buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The parameters the optimizer updates (f32 master weights).
    Params,
    /// AdamW's first moment.
    ExpAvg,
    /// AdamW's second moment.
    ExpAvgSq,
}

impl Part {
    fn name(self) -> &'static str {
        match self {
            Part::Params => "params",
            Part::ExpAvg => "exp_avg",
            Part::ExpAvgSq => "exp_avg_sq",
        }
    }
}

/// The base name of device `rank`'s files among `shards`.
pub fn shard_name(rank: usize, shards: usize) -> String {
    format!("shard-{rank:05}-of-{shards:05}")
}

/// One device's training state on the host, as a sharded checkpoint saves it: its flat buffers
/// (the parameters the optimizer updates and both AdamW moments, in [`Part`] order) and where
/// their elements are in the single-device layout.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceState {
    /// Parameters, first moments, second moments.
    pub bufs: [Vec<f32>; 3],
    /// Where the buffers' elements are in the single-device layout.
    pub chunks: Vec<Chunk>,
    /// The FP8 operands' scaling states (`Plan::fp8`), saved as the tensor [`FP8_SCALING`];
    /// empty without FP8 products.
    pub fp8: Vec<f32>,
}

/// The tensor of a device's shard holding its FP8 scaling states (the delayed recipe's scales
/// and amax histories), when it has FP8 products.
pub const FP8_SCALING: &str = "fp8_scaling";

impl DeviceState {
    /// Whether the device holds state of its own to save (data-parallel replicas hold none).
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

/// The text of a device's chunk list (`shard-*.json`): `[global, local, len]` triples. Two
/// devices that hold the same elements in the same places write the same text.
pub fn chunks_json(chunks: &[Chunk]) -> String {
    let triples: Vec<[usize; 3]> = chunks.iter().map(|c| [c.global, c.local, c.len]).collect();
    serde_json::to_string(&triples).expect("integers serialize")
}

/// Writes one device's files into the (temporary) checkpoint directory `dir`: the chunk list,
/// then the buffers. Returns their sizes and hashes, computed on the way, so that sealing need
/// not read them back.
pub fn write_part(dir: &Path, rank: usize, shards: usize, state: &DeviceState) -> Result<BTreeMap<String, FileSum>> {
    let name = shard_name(rank, shards);
    let json = chunks_json(&state.chunks);
    crate::fsutil::write_atomic(&dir.join(format!("{name}.json")), json.as_bytes())?;
    let parts = [Part::Params, Part::ExpAvg, Part::ExpAvgSq];
    let mut tensors: Vec<(String, &[f32], Vec<usize>)> =
        parts.iter().zip(&state.bufs).map(|(p, b)| (p.name().to_owned(), b.as_slice(), vec![b.len()])).collect();
    if !state.fp8.is_empty() {
        tensors.push((FP8_SCALING.to_owned(), &state.fp8, vec![state.fp8.len()]));
    }
    let data = dir.join(format!("{name}.safetensors"));
    let sha256 = tensors::write(&data, &tensors, FloatType::F32)?;
    Ok(BTreeMap::from([
        (
            format!("{name}.json"),
            FileSum { bytes: json.len() as u64, sha256: crate::digest::sha256_hex(json.as_bytes()) },
        ),
        (format!("{name}.safetensors"), FileSum { bytes: fs::metadata(&data)?.len(), sha256 }),
    ]))
}

/// Completes a sharded checkpoint whose parts are all in `tmp`: hashes the parts (those in
/// `known`, hashed when they were written, are not read again), writes the configuration and
/// `state.json`, flushes and renames `tmp` to `dir`.
pub fn commit(
    tmp: &Path,
    dir: &Path,
    config: &Config,
    progress: Progress,
    shards: usize,
    extras: &Extras,
    known: &BTreeMap<String, FileSum>,
) -> Result<()> {
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(tmp)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with("shard-") {
            let path = tmp.join(&name);
            let sum = match known.get(&name) {
                Some(sum) => sum.clone(),
                None => FileSum { bytes: fs::metadata(&path)?.len(), sha256: sha256_file(&path)? },
            };
            files.insert(name, sum);
        }
    }
    seal(tmp, config, progress, Some(shards), files, extras)?;
    if dir.exists() {
        bail!("{} already exists", dir.display());
    }
    fs::rename(tmp, dir)?;
    crate::fsutil::sync_dir(dir.parent().unwrap_or(Path::new(".")))?;
    Ok(())
}

/// A saved chunk, and in which file and tensor it is.
struct Saved {
    chunk: Chunk,
    file: usize,
    tensor: String,
}

impl Checkpoint {
    /// Fills `out` (a device's buffer) with `part` of this checkpoint, chunk by chunk; every
    /// element of `out` a chunk names must be in the checkpoint.
    pub fn read_chunks(&self, part: Part, chunks: &[Chunk], out: &mut [f32]) -> Result<()> {
        let d = self.dir.display();
        let (files, saved) = self.saved_chunks(part)?;
        let mut missing = 0usize;
        for need in chunks {
            let end = need.global + need.len;
            // Saved chunks are sorted by start and may repeat elements (replicated tensors):
            // `next` is the first element not copied yet.
            let mut next = need.global;
            let first = saved.partition_point(|s| s.chunk.global + s.chunk.len <= need.global);
            for s in saved[first..].iter().take_while(|s| s.chunk.global < end) {
                let (lo, hi) = (next.max(s.chunk.global), end.min(s.chunk.global + s.chunk.len));
                if lo >= hi {
                    continue;
                }
                missing += lo - next;
                let file = &files[s.file];
                let st = file.tensors();
                let view =
                    st.tensor(&s.tensor).map_err(|_| anyhow!("checkpoint {d}: tensor {} is missing", s.tensor))?;
                let data = view.data();
                let from = s.chunk.local + (lo - s.chunk.global);
                if (from + hi - lo) * 4 > data.len() {
                    bail!("checkpoint {d}: {} is shorter than its chunks say", file.path.display());
                }
                let dst = &mut out[need.local + (lo - need.global)..need.local + (hi - need.global)];
                for (o, b) in dst.iter_mut().zip(data[from * 4..].chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
                next = hi;
            }
            missing += end - next;
        }
        if missing > 0 {
            bail!("checkpoint {d} does not hold {missing} of the {} elements this mesh needs", part.name());
        }
        self.ensure_finite(part, chunks, out)
    }

    /// Refuses values that are not finite: a model that diverged must not be resumed, exported
    /// or evaluated as if it were one. Names the first tensor that holds one.
    pub(crate) fn ensure_finite(&self, part: Part, chunks: &[Chunk], out: &[f32]) -> Result<()> {
        let mut bad = chunks.iter().flat_map(|c| {
            out[c.local..c.local + c.len].iter().enumerate().filter(|(_, x)| !x.is_finite()).map(|(i, _)| c.global + i)
        });
        let Some(first) = bad.next() else { return Ok(()) };
        let count = 1 + bad.count();
        let layout = Layout::new(&self.config.model);
        let tensor = layout.tensors.iter().find(|t| first < t.offset + t.len()).map_or("?", |t| t.name.as_str());
        bail!(
            "checkpoint {} holds {count} non-finite {} values (NaN or infinite; the first in {tensor}): the run had diverged; use an earlier checkpoint",
            self.dir.display(),
            part.name()
        )
    }

    /// The FP8 scaling states device `rank` saved ([`FP8_SCALING`]), if it saved a shard with
    /// them.
    pub fn fp8_scaling(&self, rank: usize) -> Result<Option<Vec<f32>>> {
        let Some(shards) = self.state.shards else { return Ok(None) };
        let name = format!("{}.safetensors", shard_name(rank, shards));
        if !self.state.files.contains_key(&name) {
            return Ok(None);
        }
        let file = Mapped::open(&self.dir.join(&name))?;
        let st = file.tensors();
        let Ok(view) = st.tensor(FP8_SCALING) else { return Ok(None) };
        let mut values = vec![0f32; view.shape().iter().product()];
        tensors::read_f32(FP8_SCALING, &view, &mut values)
            .with_context(|| format!("checkpoint {}: {name}", self.dir.display()))?;
        // The parameters' check ([`Checkpoint::ensure_finite`]): a NaN scale would pass for a
        // divergence of the next step.
        let mut bad = values.iter().enumerate().filter(|(_, x)| !x.is_finite()).map(|(i, _)| i);
        if let Some(first) = bad.next() {
            bail!(
                "checkpoint {} holds {} non-finite FP8 scaling values (NaN or infinite; the first at {first} of {FP8_SCALING} in {name}): the run had diverged or the file was altered; use an earlier checkpoint",
                self.dir.display(),
                1 + bad.count()
            );
        }
        Ok(Some(values))
    }

    /// Every saved chunk of `part`, sorted by global position, with the files they are in
    /// (mapped file, tensor name).
    fn saved_chunks(&self, part: Part) -> Result<(Vec<Mapped>, Vec<Saved>)> {
        let mut files = Vec::new();
        let mut saved = Vec::new();
        match self.state.shards {
            None => {
                // One chunk per tensor, named as in a single-device checkpoint.
                let (path, prefix) = match part {
                    Part::Params => (self.dir.join(MODEL_FILE), ""),
                    Part::ExpAvg => (self.dir.join(OPTIMIZER_FILE), "exp_avg."),
                    Part::ExpAvgSq => (self.dir.join(OPTIMIZER_FILE), "exp_avg_sq."),
                };
                if part != Part::Params && !self.state.files.contains_key(OPTIMIZER_FILE) {
                    bail!(
                        "checkpoint {} has no optimizer state (an imported model?): it can start a run, not resume one",
                        self.dir.display()
                    );
                }
                let file = Mapped::open(&path)?;
                for t in &Layout::new(&self.config.model).tensors {
                    let tensor = format!("{prefix}{}", t.name);
                    let st = file.tensors();
                    let view =
                        st.tensor(&tensor).map_err(|_| anyhow!("{}: tensor {tensor} is missing", path.display()))?;
                    if tensors::float_type(&tensor, &view)? != FloatType::F32 || view.shape() != t.shape.as_slice() {
                        bail!("{}: tensor {tensor} is not f32 of shape {:?}", path.display(), t.shape);
                    }
                    saved.push(Saved { chunk: Chunk { global: t.offset, local: 0, len: t.len() }, file: 0, tensor });
                }
                files.push(file);
            }
            Some(shards) => {
                for entry in self.state.files.keys().filter(|n| n.starts_with("shard-") && n.ends_with(".json")) {
                    let stem = entry.trim_end_matches(".json");
                    if !self.state.files.contains_key(&format!("{stem}.safetensors")) {
                        bail!(
                            "checkpoint {} is damaged: state.json lists {entry} but not {stem}.safetensors",
                            self.dir.display()
                        );
                    }
                    let triples: Vec<[usize; 3]> = serde_json::from_slice(&fs::read(self.dir.join(entry))?)
                        .map_err(|e| anyhow!("checkpoint {}: {entry}: {e}", self.dir.display()))?;
                    let file = Mapped::open(&self.dir.join(format!("{stem}.safetensors")))?;
                    for [global, local, len] in triples {
                        let chunk = Chunk { global, local, len };
                        saved.push(Saved { chunk, file: files.len(), tensor: part.name().to_owned() });
                    }
                    files.push(file);
                }
                if files.is_empty() {
                    bail!("checkpoint {}: state.json lists none of its {shards} shards", self.dir.display());
                }
            }
        }
        saved.sort_by_key(|s| s.chunk.global);
        Ok((files, saved))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::recipe::resolve;

    /// FP8 scaling states are loaded under the check the parameters get: a NaN in them (a file
    /// edited or damaged, then re-sealed) would otherwise pass for a divergence of the next step.
    #[test]
    fn non_finite_fp8_scaling_states_are_refused_naming_the_tensor() {
        let config = resolve("tiny-llama2", &[]).unwrap().config;
        let root = tempfile::tempdir().unwrap();
        let progress = Progress { step: 1, position: Default::default(), data_tokens: 0, run: None };
        let state = |fp8: Vec<f32>| DeviceState {
            bufs: [vec![1.0; 4], vec![0.0; 4], vec![0.0; 4]],
            chunks: vec![Chunk { global: 0, local: 0, len: 4 }],
            fp8,
        };
        let save = |name: &str, fp8: Vec<f32>| {
            let (tmp, dir) = (root.path().join(format!("{name}.tmp")), root.path().join(name));
            fs::create_dir(&tmp).unwrap();
            let known = write_part(&tmp, 0, 1, &state(fp8)).unwrap();
            commit(&tmp, &dir, &config, progress.clone(), 1, &Extras::default(), &known).unwrap();
            Checkpoint::open(&dir).unwrap()
        };
        let good = save("good", vec![1.0, 0.5, 2.0]);
        assert_eq!(good.fp8_scaling(0).unwrap(), Some(vec![1.0, 0.5, 2.0]));
        let bad = save("bad", vec![1.0, f32::NAN, 2.0, f32::INFINITY]);
        let e = format!("{:#}", bad.fp8_scaling(0).unwrap_err());
        let want = "holds 2 non-finite FP8 scaling values (NaN or infinite; the first at 1 of fp8_scaling in shard-00000-of-00001.safetensors)";
        assert!(e.contains(want), "{e}");
    }
}
