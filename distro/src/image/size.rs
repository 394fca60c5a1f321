//! Image size per platform, compressed (what a pull downloads: the layers' sizes) and
//! uncompressed (what it unpacks to: the layers' tar streams), and the budget the image
//! definition sets for both (`[budget]`, in MiB per platform). Every build reports them; a build
//! with `--enforce-budget` (the nightly's) refuses to publish an image over its budget.
use crate::oci::manifest::Descriptor;
use crate::oci::store::BlobStore;
use anyhow::{Context, Result};
use serde::Deserialize;
use std::path::Path;

/// `[budget]` of an image definition: the most each platform's image may weigh, in MiB.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// The sum of the compressed layers (the download).
    pub compressed_mib: Option<u64>,
    /// The sum of the uncompressed layers (the disk).
    pub uncompressed_mib: Option<u64>,
}

/// The size of one platform's image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlatformSize {
    /// `linux/amd64`.
    pub platform: String,
    /// Bytes, compressed.
    pub compressed: u64,
    /// Bytes, uncompressed.
    pub uncompressed: u64,
}

const MIB: u64 = 1 << 20;

/// The sizes of `layers` (in `store`); the uncompressed size of each layer is cached by its
/// digest under `cache_dir` (a CUDA base's layers take seconds to decompress).
pub fn measure(platform: &str, layers: &[Descriptor], store: &BlobStore, cache_dir: &Path) -> Result<PlatformSize> {
    let mut size = PlatformSize { platform: platform.to_owned(), compressed: 0, uncompressed: 0 };
    for l in layers {
        size.compressed += l.size;
        size.uncompressed += uncompressed(l, store, cache_dir)?;
    }
    Ok(size)
}

fn uncompressed(l: &Descriptor, store: &BlobStore, cache_dir: &Path) -> Result<u64> {
    let cached = cache_dir.join(l.digest.hex());
    if let Some(n) = std::fs::read_to_string(&cached).ok().and_then(|t| t.trim().parse().ok()) {
        return Ok(n);
    }
    let file = std::fs::File::open(store.path(&l.digest)).with_context(|| format!("opening layer {}", l.digest))?;
    let n = if l.media_type.ends_with("gzip") {
        std::io::copy(&mut flate2::read::GzDecoder::new(file), &mut std::io::sink())
            .with_context(|| format!("decompressing layer {}", l.digest))?
    } else {
        l.size
    };
    std::fs::create_dir_all(cache_dir)?;
    crate::fsutil::write_atomic(&cached, n.to_string().as_bytes())?;
    Ok(n)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB as f64)
}

impl PlatformSize {
    /// `linux/amd64: 3712.4 MiB compressed (budget 4608), 8830.0 MiB uncompressed (budget 10240)`.
    pub fn report(&self, budget: &Budget) -> String {
        let part = |bytes: u64, what: &str, limit: Option<u64>| match limit {
            Some(b) => format!("{} {what} (budget {b} MiB)", mib(bytes)),
            None => format!("{} {what}", mib(bytes)),
        };
        format!(
            "{}: {}, {}",
            self.platform,
            part(self.compressed, "compressed", budget.compressed_mib),
            part(self.uncompressed, "uncompressed", budget.uncompressed_mib)
        )
    }

    /// What exceeds `budget`, one line each (empty when within it).
    pub fn over(&self, budget: &Budget, def: &str) -> Vec<String> {
        let mut out = Vec::new();
        for (bytes, limit, what, key) in [
            (self.compressed, budget.compressed_mib, "compressed", "compressed_mib"),
            (self.uncompressed, budget.uncompressed_mib, "uncompressed", "uncompressed_mib"),
        ] {
            if let Some(limit) = limit.filter(|l| bytes > l * MIB) {
                out.push(format!(
                    "{}: {} {what} is over the budget of {limit} MiB ({def} budget.{key})",
                    self.platform,
                    mib(bytes)
                ));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_and_checks_the_budget() {
        let s = PlatformSize { platform: "linux/amd64".into(), compressed: 3 * MIB, uncompressed: 10 * MIB };
        let b = Budget { compressed_mib: Some(4), uncompressed_mib: Some(8) };
        assert_eq!(
            s.report(&b),
            "linux/amd64: 3.0 MiB compressed (budget 4 MiB), 10.0 MiB uncompressed (budget 8 MiB)"
        );
        assert_eq!(
            s.over(&b, "images/engine.toml"),
            [
                "linux/amd64: 10.0 MiB uncompressed is over the budget of 8 MiB (images/engine.toml budget.uncompressed_mib)"
            ]
        );
        assert!(s.over(&Budget::default(), "x").is_empty());
    }
}
