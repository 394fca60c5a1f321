//! A content-addressed blob store (`<root>/blobs/sha256/<hex>`, the OCI layout's own shape).
//!
//! Blobs land through a temporary file and are renamed into place only after their digest
//! checked out, so a name in the store always matches its content.
use super::digest::{Digest, HashingWriter};
use crate::fsutil::{commit_temp, temp_beside, write_atomic};
use anyhow::{Context, Result, bail};
use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// The largest manifest, index or config read. The distribution spec has registries accept
/// manifests of at least 4 MiB and lets them refuse larger ones; a descriptor that declares
/// more is refused before anything is read, whatever the blob behind it (a link to
/// `/dev/zero` under a descriptor of 4,000,000,000 bytes was read into memory whole).
pub const MAX_DOCUMENT_BYTES: u64 = 4 << 20;

/// Refuses a manifest, index or config descriptor larger than [`MAX_DOCUMENT_BYTES`].
pub fn check_document_size(d: &Digest, size: u64) -> Result<()> {
    if size > MAX_DOCUMENT_BYTES {
        return Err(crate::error::bad_input(format!(
            "blob {d}: its descriptor declares {size} bytes, more than the {MAX_DOCUMENT_BYTES} bytes (4 MiB) a manifest, index or config may have; refusing it unread"
        )));
    }
    Ok(())
}

/// A blob store rooted at a directory.
#[derive(Clone, Debug)]
pub struct BlobStore {
    root: PathBuf,
}

impl BlobStore {
    /// A store under `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> BlobStore {
        BlobStore { root: root.into() }
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where blob `d` lives (whether or not it is there).
    pub fn path(&self, d: &Digest) -> PathBuf {
        self.root.join("blobs/sha256").join(d.hex())
    }

    /// Whether blob `d` is present.
    pub fn has(&self, d: &Digest) -> bool {
        self.path(d).is_file()
    }

    /// Size of blob `d`, if present.
    pub fn size(&self, d: &Digest) -> Option<u64> {
        fs::metadata(self.path(d)).ok().map(|m| m.len())
    }

    /// Stores `bytes`, returning their digest (a no-op when already present).
    pub fn put(&self, bytes: &[u8]) -> Result<Digest> {
        let d = Digest::of(bytes);
        if !self.has(&d) {
            write_atomic(&self.path(&d), bytes)?;
        }
        Ok(d)
    }

    /// Streams `reader` into the store, refusing it unless it hashes to `expected` (and has
    /// `expected_size`, when given). Returns the number of bytes read.
    pub fn put_verified(
        &self,
        reader: &mut dyn Read,
        expected: &Digest,
        expected_size: Option<u64>,
        what: &str,
    ) -> Result<u64> {
        let path = self.path(expected);
        fs::create_dir_all(path.parent().expect("blob path has a parent"))?;
        let tmp = temp_beside(&path);
        let result = (|| -> Result<u64> {
            let f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
            let mut w = HashingWriter::new(BufWriter::with_capacity(1 << 20, f));
            // A blob longer than its descriptor says is refused once one byte too many came: a
            // registry cannot make us read (and store) without end.
            let limit = expected_size.map_or(u64::MAX, |size| size.saturating_add(1));
            std::io::copy(&mut reader.take(limit), &mut w).with_context(|| format!("downloading {what}"))?;
            let (got, len, mut inner) = w.finish();
            inner.flush()?;
            if let Some(size) = expected_size.filter(|&size| len > size) {
                bail!("{what}: more than the descriptor's {size} bytes; stopped reading and refusing it");
            }
            if &got != expected {
                bail!("{what}: content does not match its digest {expected} (got {got}, {len} bytes); refusing it");
            }
            if let Some(size) = expected_size
                && size != len
            {
                bail!("{what}: size {len} does not match the descriptor's {size}; refusing it");
            }
            commit_temp(&tmp, &path)?;
            Ok(len)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// Reads the manifest, index or config `d`, which its descriptor says is `size` bytes: a
    /// size above [`MAX_DOCUMENT_BYTES`] is refused unread, and at most `size + 1` bytes are
    /// read, so a blob that is larger (a file grown, a link to a device) is refused as corrupt
    /// at once instead of being read whole; then its digest is checked.
    pub fn read_document(&self, d: &Digest, size: u64) -> Result<Vec<u8>> {
        check_document_size(d, size)?;
        let file = fs::File::open(self.path(d)).with_context(|| format!("reading blob {d}"))?;
        let mut bytes = Vec::with_capacity(size.min(1 << 24) as usize);
        file.take(size.saturating_add(1)).read_to_end(&mut bytes).with_context(|| format!("reading blob {d}"))?;
        if bytes.len() as u64 != size {
            return Err(crate::error::bad_input(format!(
                "blob {d} in {} is corrupt: {} bytes where its descriptor says {size}",
                self.root.display(),
                if bytes.len() as u64 > size { format!("more than {size}") } else { bytes.len().to_string() }
            )));
        }
        if &Digest::of(&bytes) != d {
            return Err(crate::error::bad_input(format!(
                "blob {d} in {} is corrupt (its content has another digest)",
                self.root.display()
            )));
        }
        Ok(bytes)
    }

    /// Reads blob `d` whole, checking its digest (for small blobs: manifests, configs).
    pub fn read(&self, d: &Digest) -> Result<Vec<u8>> {
        let bytes = fs::read(self.path(d)).with_context(|| format!("reading blob {d}"))?;
        if &Digest::of(&bytes) != d {
            bail!("blob {d} in {} is corrupt (its content has another digest)", self.root.display());
        }
        Ok(bytes)
    }

    /// Puts blob `d` from `other` into this store: a hard link when both are on one file system,
    /// a copy otherwise.
    pub fn link_from(&self, other: &BlobStore, d: &Digest) -> Result<()> {
        if self.has(d) {
            return Ok(());
        }
        let src = other.path(d);
        let dst = self.path(d);
        fs::create_dir_all(dst.parent().expect("blob path has a parent"))?;
        let tmp = temp_beside(&dst);
        if fs::hard_link(&src, &tmp).is_err() {
            fs::copy(&src, &tmp).with_context(|| format!("copying {} to {}", src.display(), tmp.display()))?;
        }
        commit_temp(&tmp, &dst)
    }

    /// Every digest in the store.
    pub fn list(&self) -> Result<Vec<Digest>> {
        let dir = self.root.join("blobs/sha256");
        let mut out = Vec::new();
        let Ok(rd) = fs::read_dir(&dir) else {
            return Ok(out);
        };
        for e in rd {
            let name = e?.file_name().to_string_lossy().into_owned();
            if let Ok(d) = Digest::parse(&format!("sha256:{name}")) {
                out.push(d);
            }
        }
        out.sort();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verified_puts_refuse_tampered_content() {
        let dir = tempfile::tempdir().unwrap();
        let s = BlobStore::new(dir.path());
        let d = Digest::of(b"good");
        assert!(s.put_verified(&mut &b"evil"[..], &d, None, "blob x").is_err());
        assert!(!s.has(&d));
        assert!(s.put_verified(&mut &b"good"[..], &d, Some(5), "blob x").is_err(), "size checked");
        // An endless blob behind a 3-byte descriptor: reading stops at the fourth byte.
        let e = s.put_verified(&mut std::io::repeat(b'x'), &d, Some(3), "blob x").unwrap_err().to_string();
        assert!(e.contains("more than the descriptor's 3 bytes; stopped reading"), "{e}");
        assert_eq!(s.put_verified(&mut &b"good"[..], &d, Some(4), "blob x").unwrap(), 4);
        assert_eq!(s.read(&d).unwrap(), b"good");
        // Nothing but the blob is left in the directory.
        assert_eq!(s.list().unwrap(), vec![d.clone()]);
        assert_eq!(fs::read_dir(dir.path().join("blobs/sha256")).unwrap().count(), 1);
        // A corrupted file is noticed on read.
        fs::write(s.path(&d), b"bad!").unwrap();
        assert!(s.read(&d).is_err());
    }

    /// A descriptor of 4,000,000,000 bytes on a blob linked to /dev/zero was read whole (3.9 GB
    /// of memory) before the blob was called corrupt; now the size is refused unread.
    #[test]
    fn documents_are_read_no_further_than_their_descriptor_and_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let s = BlobStore::new(dir.path());
        let d = s.put(b"{}").unwrap();
        fs::remove_file(s.path(&d)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", s.path(&d)).unwrap();
        let e = s.read_document(&d, 4_000_000_000).unwrap_err();
        assert!(crate::error::is_bad_input(&e), "{e}");
        assert!(e.to_string().contains("declares 4000000000 bytes, more than the 4194304 bytes (4 MiB)"), "{e}");
        let e = s.read_document(&d, MAX_DOCUMENT_BYTES).unwrap_err().to_string();
        assert!(e.contains("is corrupt: more than 4194304 bytes where its descriptor says 4194304"), "{e}");
    }

    #[test]
    fn link_between_stores() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let (sa, sb) = (BlobStore::new(a.path()), BlobStore::new(b.path()));
        let d = sa.put(b"x").unwrap();
        sb.link_from(&sa, &d).unwrap();
        assert_eq!(sb.read(&d).unwrap(), b"x");
    }
}
