//! Reading a few named files out of a gzip layer (the `/opt/distro` layer `distro build` writes:
//! its SBOM and manifest lock), as a stream and with a cap on what is inflated.
//!
//! A layer is input from a registry: a few megabytes of gzip can inflate to gigabytes (zeros
//! compress about a thousandfold). The archive is read as it is inflated, nothing is held but
//! the files asked for, and at most `cap` bytes are inflated in all: a layer that inflates to
//! more, or a wanted file that declares more, is refused (bad input, exit 2) before anything of
//! that size is allocated.
use crate::error::bad_input;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// The most a `/opt/distro` layer may inflate to (its archive, all files together): 64 MiB.
/// The layer holds a manifest lock, the patches, `Cargo.lock` and an SBOM: a few megabytes.
pub const MAX_OPT_DISTRO_INFLATED: u64 = 64 << 20;

/// A reader that fails once more than `left` bytes have come through it.
struct Capped<R> {
    inner: R,
    left: u64,
    cap: u64,
}

/// The error [`Capped`] raises; [`files`] turns it into a one-line bad input.
#[derive(Debug)]
struct OverCap;

impl std::fmt::Display for OverCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("inflated layer over the cap")
    }
}

impl std::error::Error for OverCap {}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        // Ask for one byte more than is left, so that going past the cap is seen.
        let want = buf.len().min(usize::try_from(self.left.saturating_add(1)).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n as u64 > self.left {
            return Err(std::io::Error::other(OverCap));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

fn over_cap(what: &str, cap: u64) -> anyhow::Error {
    bad_input(format!(
        "{what}: inflates to more than {cap} bytes, the most distro reads of an /opt/distro layer; refusing it"
    ))
}

/// The files of the gzip layer at `layer` whose paths (without a leading `./`) are in `wanted`,
/// by path, inflating at most `cap` bytes; `what` names the layer (image, platform, digest) in the
/// error. A layer that is not a gzip tar, or stops early, gives what was read up to there.
pub fn files(layer: &Path, wanted: &[&str], cap: u64, what: &str) -> Result<BTreeMap<String, Vec<u8>>> {
    let file = std::fs::File::open(layer).with_context(|| format!("opening {}", layer.display()))?;
    let capped = Capped { inner: flate2::read::GzDecoder::new(std::io::BufReader::new(file)), left: cap, cap };
    let mut archive = tar::Archive::new(capped);
    let mut out = BTreeMap::new();
    let is_over = |e: &std::io::Error| e.get_ref().is_some_and(|i| i.is::<OverCap>());
    let entries = match archive.entries() {
        Ok(e) => e,
        Err(e) if is_over(&e) => return Err(over_cap(what, cap)),
        Err(_) => return Ok(out),
    };
    for entry in entries {
        let mut entry = match entry {
            Ok(e) => e,
            Err(e) if is_over(&e) => return Err(over_cap(what, cap)),
            Err(_) => return Ok(out),
        };
        let path = entry.path()?.to_string_lossy().trim_start_matches("./").to_owned();
        if !wanted.contains(&path.as_str()) {
            continue;
        }
        let declared = entry.header().size().unwrap_or(u64::MAX);
        if declared > cap {
            return Err(bad_input(format!(
                "{what}: its {path} declares {declared} bytes, more than the {cap} bytes distro reads of an /opt/distro layer; refusing it"
            )));
        }
        let mut bytes = Vec::with_capacity(usize::try_from(declared).unwrap_or(0));
        match entry.read_to_end(&mut bytes) {
            Ok(_) => {}
            Err(e) if is_over(&e) => return Err(over_cap(what, cap)),
            Err(e) => return Err(e).with_context(|| format!("{what}: reading {path}")),
        }
        out.insert(path, bytes);
    }
    // Entries end at the archive's end-of-archive blocks; the stream's remainder (padding, or
    // what a hostile layer hides after them) is inflated too, within the cap, so that a bomb is
    // refused wherever it sits.
    let mut rest = archive.into_inner();
    match std::io::copy(&mut rest, &mut std::io::sink()) {
        Err(e) if is_over(&e) => Err(over_cap(what, rest.cap)),
        _ => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::GzEncoder;
    use std::io::Write;

    /// A gzip tar holding `opt/distro/sbom.spdx.json` of `len` zero bytes (written as a stream:
    /// the test never holds it whole) and a small `opt/distro/manifest.lock`.
    fn layer(dir: &Path, len: u64) -> std::path::PathBuf {
        let path = dir.join("layer.tar.gz");
        let gz = GzEncoder::new(std::fs::File::create(&path).unwrap(), Compression::fast());
        let mut b = tar::Builder::new(gz);
        let mut h = tar::Header::new_gnu();
        h.set_size(4);
        h.set_mode(0o644);
        b.append_data(&mut h, "opt/distro/manifest.lock", &b"lock"[..]).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_size(len);
        h.set_mode(0o644);
        b.append_data(&mut h, "opt/distro/sbom.spdx.json", std::io::repeat(0).take(len)).unwrap();
        b.into_inner().unwrap().finish().unwrap().flush().unwrap();
        path
    }

    const WANTED: [&str; 2] = ["opt/distro/manifest.lock", "opt/distro/sbom.spdx.json"];

    #[test]
    fn a_layer_within_the_cap_gives_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let got = files(&layer(dir.path(), 1000), &WANTED, 1 << 20, "layer x").unwrap();
        assert_eq!(got["opt/distro/manifest.lock"], b"lock");
        assert_eq!(got["opt/distro/sbom.spdx.json"].len(), 1000);
    }

    #[test]
    fn a_file_that_inflates_past_the_cap_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        // 64 MiB of zeros: about 64 KiB of gzip.
        let path = layer(dir.path(), 64 << 20);
        assert!(std::fs::metadata(&path).unwrap().len() < 1 << 20);
        let e = files(&path, &WANTED, 1 << 20, "img:tag linux/amd64 layer sha256:abc").unwrap_err();
        assert!(crate::error::is_bad_input(&e), "{e:#}");
        assert_eq!(
            crate::error::one_line(&e),
            "img:tag linux/amd64 layer sha256:abc: its opt/distro/sbom.spdx.json declares 67108864 bytes, more than the 1048576 bytes distro reads of an /opt/distro layer; refusing it"
        );
    }

    #[test]
    fn a_layer_that_inflates_past_the_cap_is_refused_even_when_no_wanted_file_is_large() {
        let dir = tempfile::tempdir().unwrap();
        let path = layer(dir.path(), 8 << 20);
        // Only the small file is wanted: the large one is skipped, but still inflated, and the
        // cap counts it.
        let e = files(&path, &["opt/distro/manifest.lock"], 1 << 20, "layer y").unwrap_err();
        assert!(crate::error::is_bad_input(&e), "{e:#}");
        assert_eq!(
            crate::error::one_line(&e),
            "layer y: inflates to more than 1048576 bytes, the most distro reads of an /opt/distro layer; refusing it"
        );
    }

    #[test]
    fn what_is_not_a_gzip_tar_gives_no_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("junk");
        std::fs::write(&path, b"not gzip").unwrap();
        assert!(files(&path, &WANTED, 1 << 20, "junk").unwrap().is_empty());
    }
}
