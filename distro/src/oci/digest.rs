//! Content digests (`sha256:<hex>`), the names of everything in an OCI image.
use crate::hex::{hex, is_sha256, sha256_hex};
use anyhow::{Result, bail};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};
use std::fmt;
use std::io::{self, Write};

/// A validated `sha256:<64 lowercase hex>` digest.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(format!("sha256:{}", sha256_hex(bytes)))
    }

    /// Parses `sha256:<hex>`; other algorithms are refused (the whole tool is sha256-only).
    pub fn parse(s: &str) -> Result<Digest> {
        let Some(h) = s.strip_prefix("sha256:") else {
            bail!("digest {s:?} is not sha256:<hex>");
        };
        if !is_sha256(h) {
            bail!("digest {s:?} is not sha256 followed by 64 lowercase hex digits");
        }
        Ok(Digest(s.to_string()))
    }

    /// The hex part, which names the blob file in a layout (`blobs/sha256/<hex>`).
    pub fn hex(&self) -> &str {
        &self.0[7..]
    }

    /// The whole `sha256:<hex>` string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Digest::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// A writer that hashes and counts what passes through it, so a blob is verified while it is
/// stored rather than read twice.
pub struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    len: u64,
}

impl<W: Write> HashingWriter<W> {
    /// Wraps `inner`.
    pub fn new(inner: W) -> Self {
        HashingWriter { inner, hasher: Sha256::new(), len: 0 }
    }

    /// The digest and length of everything written, and the inner writer.
    pub fn finish(self) -> (Digest, u64, W) {
        (Digest(format!("sha256:{}", hex(&self.hasher.finalize()))), self.len, self.inner)
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Incremental sha256 over several inputs, for cache keys built from many parts.
#[derive(Default)]
pub struct KeyHasher(Sha256);

impl KeyHasher {
    /// A hasher whose keys are namespaced by `domain`, so keys of different kinds never collide.
    pub fn new(domain: &str) -> Self {
        let mut k = KeyHasher(Sha256::new());
        k.part(domain.as_bytes());
        k
    }
    /// Adds one length-prefixed part (length-prefixing keeps `("ab","c")` and `("a","bc")` apart).
    pub fn part(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.update((bytes.len() as u64).to_le_bytes());
        self.0.update(bytes);
        self
    }
    /// The key, as hex.
    pub fn finish(self) -> String {
        hex(&self.0.finalize())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_digest_and_parse() {
        let d = Digest::of(b"");
        assert_eq!(d.as_str(), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(Digest::parse(d.as_str()).unwrap(), d);
        assert!(Digest::parse("sha512:abcd").is_err());
        assert!(Digest::parse("sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855").is_err());
        assert!(Digest::parse("sha256:e3b0").is_err());
    }

    #[test]
    fn hashing_writer_matches_one_shot() {
        let mut w = HashingWriter::new(Vec::new());
        w.write_all(b"hello ").unwrap();
        w.write_all(b"world").unwrap();
        let (d, n, inner) = w.finish();
        assert_eq!(d, Digest::of(b"hello world"));
        assert_eq!(n, 11);
        assert_eq!(inner, b"hello world");
    }

    #[test]
    fn key_parts_are_length_prefixed() {
        let mut a = KeyHasher::new("t");
        a.part(b"ab").part(b"c");
        let mut b = KeyHasher::new("t");
        b.part(b"a").part(b"bc");
        assert_ne!(a.finish(), b.finish());
    }
}
