//! Safetensors files: writing f32 host buffers (optionally as bf16 or f16) and reading tensors of
//! any float dtype back as f32, through the `safetensors` crate and memory maps.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo, TensorView};
use sha2::{Digest, Sha256};

/// The element type a file is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatType {
    /// 32-bit IEEE.
    F32,
    /// bfloat16 (rounded to nearest even).
    Bf16,
    /// IEEE half (rounded to nearest even).
    F16,
}

impl FloatType {
    /// The name Hugging Face configs use (`torch_dtype`): `float32`, `bfloat16`, `float16`.
    pub fn torch_name(self) -> &'static str {
        match self {
            FloatType::F32 => "float32",
            FloatType::Bf16 => "bfloat16",
            FloatType::F16 => "float16",
        }
    }

    /// Parses `f32`/`float32`, `bf16`/`bfloat16`, `f16`/`float16`.
    pub fn parse(name: &str) -> Option<FloatType> {
        match name.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => Some(FloatType::F32),
            "bf16" | "bfloat16" => Some(FloatType::Bf16),
            "f16" | "float16" | "half" => Some(FloatType::F16),
            _ => None,
        }
    }

    fn of(dtype: Dtype) -> Option<FloatType> {
        match dtype {
            Dtype::F32 => Some(FloatType::F32),
            Dtype::BF16 => Some(FloatType::Bf16),
            Dtype::F16 => Some(FloatType::F16),
            _ => None,
        }
    }
}

/// The bytes of an f32 slice as stored in a little-endian file.
fn f32_bytes(x: &[f32]) -> &[u8] {
    #[cfg(target_endian = "big")]
    compile_error!("tensor files are little-endian; this reinterpretation assumes a little-endian host");
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the length is exact.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

/// A writer that hashes everything passing through it.
struct Hashing<W: Write> {
    inner: W,
    hasher: Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `tensors` (name, f32 data, shape) to `path` in `dtype`, in the order given, with
/// `{"format": "pt"}` metadata (which transformers expects): under a temporary name, flushed,
/// then renamed. The header comes from the `safetensors` crate; the data is streamed (no copy
/// of the whole file in memory) and hashed on the way. Returns the file's SHA-256 in hex.
pub fn write(path: &Path, tensors: &[(String, &[f32], Vec<usize>)], dtype: FloatType) -> Result<String> {
    let (st_dtype, width) = match dtype {
        FloatType::F32 => (Dtype::F32, 4),
        FloatType::Bf16 => (Dtype::BF16, 2),
        FloatType::F16 => (Dtype::F16, 2),
    };
    let mut offset = 0;
    let infos = tensors
        .iter()
        .map(|(name, data, shape)| {
            assert_eq!(data.len(), shape.iter().product::<usize>(), "{name}: data and shape disagree");
            let info = TensorInfo {
                dtype: st_dtype,
                shape: shape.clone(),
                data_offsets: (offset, offset + data.len() * width),
            };
            offset += data.len() * width;
            (name.clone(), info)
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let header =
        Metadata::new(Some(metadata), infos).map_err(|e| anyhow!("cannot describe {}: {e}", path.display()))?;
    let mut header = serde_json::to_vec(&header)?;
    // The data starts 8-byte aligned, as the crate's own writer pads it.
    header.resize(header.len().next_multiple_of(8), b' ');

    // A temporary no one can plant a link at ([`crate::fsutil::create_temp`]), in a directory
    // of this user's own or root's.
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    crate::fsutil::check_dir_owner(dir)?;
    let (tmp, file) = crate::fsutil::create_temp(path).with_context(|| format!("cannot write {}", path.display()))?;
    let result = (|| -> Result<String> {
        let mut out = BufWriter::with_capacity(1 << 22, Hashing { inner: file, hasher: Sha256::new() });
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        let mut buf = Vec::new();
        for (_, data, _) in tensors {
            match dtype {
                FloatType::F32 => out.write_all(f32_bytes(data))?,
                _ => {
                    for chunk in data.chunks(1 << 16) {
                        buf.clear();
                        for &x in chunk {
                            let bits = match dtype {
                                FloatType::Bf16 => half::bf16::from_f32(x).to_bits(),
                                _ => half::f16::from_f32(x).to_bits(),
                            };
                            buf.extend_from_slice(&bits.to_le_bytes());
                        }
                        out.write_all(&buf)?;
                    }
                }
            }
        }
        let hashing = out.into_inner().map_err(|e| e.into_error())?;
        crate::fsutil::set_default_mode(&hashing.inner)?;
        hashing.inner.sync_all()?;
        std::fs::rename(&tmp, path)?;
        crate::fsutil::sync_dir(dir)?;
        Ok(crate::digest::hex(&hashing.hasher.finalize()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("cannot write {}", path.display()))
}

/// A memory-mapped safetensors file.
pub struct Mapped {
    /// Where it is.
    pub path: PathBuf,
    map: Mmap,
}

impl Mapped {
    /// Maps a file and checks its header.
    pub fn open(path: &Path) -> Result<Mapped> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: read-only map of a file the engine does not modify while reading it.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
        SafeTensors::deserialize(&map)
            .map_err(|e| anyhow!("{} is not a valid safetensors file: {e}", path.display()))?;
        Ok(Mapped { path: path.to_path_buf(), map })
    }

    /// The parsed file.
    pub fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.map).expect("checked when opened")
    }

    /// The header's free-form metadata (`__metadata__`).
    pub fn metadata(&self) -> HashMap<String, String> {
        SafeTensors::read_metadata(&self.map).ok().and_then(|(_, m)| m.metadata().clone()).unwrap_or_default()
    }
}

/// The float type of a stored tensor, or an error naming it.
pub fn float_type(name: &str, view: &TensorView<'_>) -> Result<FloatType> {
    FloatType::of(view.dtype())
        .ok_or_else(|| anyhow!("tensor {name} is {:?}; only F32, BF16 and F16 tensors can be read", view.dtype()))
}

/// Converts a stored tensor to f32 into `out` (whose length must match).
pub fn read_f32(name: &str, view: &TensorView<'_>, out: &mut [f32]) -> Result<()> {
    let data = view.data();
    let n: usize = view.shape().iter().product();
    if n != out.len() {
        bail!("tensor {name} has {n} elements, {} expected", out.len());
    }
    match float_type(name, view)? {
        FloatType::F32 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        FloatType::Bf16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        FloatType::F16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_float_type_round_trips_values_it_can_hold() {
        let dir = tempfile::tempdir().unwrap();
        let values = [1.0f32, -2.5, 0.15625, 3.0e-3, 65504.0];
        for dtype in [FloatType::F32, FloatType::Bf16, FloatType::F16] {
            let path = dir.path().join("t.safetensors");
            let rounded: Vec<f32> = match dtype {
                FloatType::F32 => values.to_vec(),
                FloatType::Bf16 => values.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect(),
                FloatType::F16 => values.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
            };
            let sha = write(&path, &[("w".into(), &rounded, vec![5])], dtype).unwrap();
            assert_eq!(sha, crate::digest::sha256_file(&path).unwrap());
            let m = Mapped::open(&path).unwrap();
            let t = m.tensors();
            let mut out = [0f32; 5];
            read_f32("w", &t.tensor("w").unwrap(), &mut out).unwrap();
            assert_eq!(out, rounded.as_slice(), "{dtype:?}");
            assert_eq!(m.metadata()["format"], "pt");
        }
    }

    /// A link planted at the temporary name this process once used (`.NAME.tmp-PID`) is not
    /// written through: the file it points to keeps its bytes.
    #[test]
    fn a_link_at_the_old_temporary_name_is_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let path = dir.path().join("t.safetensors");
        std::os::unix::fs::symlink(&victim, dir.path().join(format!(".t.safetensors.tmp-{}", std::process::id())))
            .unwrap();
        write(&path, &[("w".into(), &[1.0], vec![1])], FloatType::F32).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(&path).unwrap().is_file());
    }
}
