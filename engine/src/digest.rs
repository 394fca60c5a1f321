//! SHA-256 digests in lower-case hex: the checksums of checkpoint files, prepared data and
//! tokenizers, and the cache keys of compiled kernels.

use std::fs::File;
use std::path::Path;

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};

/// The SHA-256 of a file, in hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut hasher = Sha256::new();
    let mut file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    std::io::copy(&mut file, &mut hasher).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(hex(&hasher.finalize()))
}

/// The SHA-256 of `bytes`, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lower-case hexadecimal.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_match_the_published_test_vector() {
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(sha256_hex(b"abc"), abc);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("abc");
        std::fs::write(&path, b"abc").unwrap();
        assert_eq!(sha256_file(&path).unwrap(), abc);
        assert_eq!(hex(&[0, 0xab, 0x10]), "00ab10");
    }
}
