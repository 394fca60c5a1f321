//! Token shards: the binary files `engine data prepare` writes and the loader memory-maps.
//!
//! A shard is a 64-byte header followed by the tokens, all little-endian (docs/data.md):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `LLMDTOKS` |
//! | 8 | 4 | format version (1) |
//! | 12 | 4 | bytes per token: 2 (u16) or 4 (u32) |
//! | 16 | 8 | number of tokens |
//! | 24 | 8 | number of documents (each closed by the end-of-sequence token) |
//! | 32 | 4 | vocabulary size of the tokenizer (every token is below it) |
//! | 36 | 4 | the end-of-sequence token |
//! | 40 | 24 | the content digest of the tokens ([`content_digest`]); zero in shards of earlier engines |
//!
//! The file is exactly `64 + tokens · bytes per token` long, so a truncated shard is refused, and
//! its tokens must match the content digest, so one edited in place is refused too.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use memmap2::Mmap;
use sha2::{Digest, Sha256};

use super::TokenSource;
use crate::digest::sha256_hex;
use crate::fsutil;

/// The first eight bytes of every shard.
pub const MAGIC: &[u8; 8] = b"LLMDTOKS";
/// The format version this engine writes and reads.
pub const VERSION: u32 = 1;
/// Bytes before the first token.
pub const HEADER_LEN: usize = 64;
/// File name extension of shards.
pub const EXTENSION: &str = "tok";
/// The token bytes are hashed in pieces of this size, so that a reader hashes them in parallel.
pub const PIECE_BYTES: usize = 4 << 20;
/// Bytes of the content digest kept in the header.
pub const DIGEST_LEN: usize = 24;

/// The content digest of a shard's token bytes: the SHA-256 of the SHA-256s of its
/// [`PIECE_BYTES`] pieces (the last one shorter), cut to its first [`DIGEST_LEN`] bytes (192
/// bits). Hashing by pieces lets a reader check a shard on all cores while it checks its tokens.
pub fn content_digest(tokens: &[u8]) -> [u8; DIGEST_LEN] {
    let mut d = PieceHasher::default();
    d.update(tokens);
    d.finish()
}

/// [`content_digest`] of bytes given in any number of parts.
#[derive(Default)]
struct PieceHasher {
    outer: Sha256,
    piece: Sha256,
    in_piece: usize,
}

impl PieceHasher {
    fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let n = (PIECE_BYTES - self.in_piece).min(bytes.len());
            self.piece.update(&bytes[..n]);
            self.in_piece += n;
            bytes = &bytes[n..];
            if self.in_piece == PIECE_BYTES {
                self.outer.update(std::mem::take(&mut self.piece).finalize());
                self.in_piece = 0;
            }
        }
    }

    fn finish(mut self) -> [u8; DIGEST_LEN] {
        if self.in_piece > 0 {
            self.outer.update(self.piece.finalize());
        }
        digest_of(self.outer)
    }
}

/// The first [`DIGEST_LEN`] bytes of a finished SHA-256.
fn digest_of(outer: Sha256) -> [u8; DIGEST_LEN] {
    outer.finalize()[..DIGEST_LEN].try_into().expect("a SHA-256 is longer")
}

/// What a shard's header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Bytes per token: 2 or 4.
    pub token_bytes: u32,
    /// Number of tokens.
    pub tokens: u64,
    /// Number of documents.
    pub documents: u64,
    /// Vocabulary size of the tokenizer that wrote the shard.
    pub vocab_size: u32,
    /// The end-of-sequence token closing every document.
    pub eos: u32,
    /// [`content_digest`] of the tokens; all zero in shards written before it was recorded,
    /// which are read unchecked.
    pub digest: [u8; DIGEST_LEN],
}

impl Header {
    /// The header's 64 bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.token_bytes.to_le_bytes());
        b[16..24].copy_from_slice(&self.tokens.to_le_bytes());
        b[24..32].copy_from_slice(&self.documents.to_le_bytes());
        b[32..36].copy_from_slice(&self.vocab_size.to_le_bytes());
        b[36..40].copy_from_slice(&self.eos.to_le_bytes());
        b[40..64].copy_from_slice(&self.digest);
        b
    }

    /// Whether the header records a content digest.
    pub fn has_digest(&self) -> bool {
        self.digest != [0; DIGEST_LEN]
    }

    /// Parses and checks a header; `len` is the file's length, `path` names it in errors.
    pub fn parse(bytes: &[u8], len: u64, path: &Path) -> Result<Header> {
        let p = path.display();
        if bytes.len() < HEADER_LEN || &bytes[0..8] != MAGIC {
            bail!("{p} is not a token shard (no `LLMDTOKS` header); shards are written by `engine data prepare`");
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != VERSION {
            bail!("{p}: shard format version {version}, this engine reads version {VERSION}");
        }
        let h = Header {
            token_bytes: u32_at(12),
            tokens: u64_at(16),
            documents: u64_at(24),
            vocab_size: u32_at(32),
            eos: u32_at(36),
            digest: bytes[40..64].try_into().expect("24 bytes"),
        };
        if h.token_bytes != 2 && h.token_bytes != 4 {
            bail!("{p}: {} bytes per token (expected 2 or 4)", h.token_bytes);
        }
        // Checked: a header announcing 2^63 tokens of 2 bytes would otherwise wrap to a small
        // length that a file can match, and the loader would read past the map.
        let expected = h.tokens.checked_mul(h.token_bytes as u64).and_then(|n| n.checked_add(HEADER_LEN as u64));
        if expected != Some(len) {
            let Some(expected) = expected else {
                bail!(
                    "{p}: its header announces {} tokens, more than any file holds (damaged?); rewrite it with `engine data prepare`",
                    h.tokens
                );
            };
            bail!(
                "{p} is {len} bytes but its header announces {} tokens ({expected} bytes): the shard is truncated or damaged",
                h.tokens
            );
        }
        Ok(h)
    }
}

/// Bytes per token for a vocabulary: 2 when every id fits in a u16.
pub fn token_bytes_for(vocab_size: usize) -> u32 {
    if vocab_size <= 1 << 16 { 2 } else { 4 }
}

/// One memory-mapped shard.
pub struct Shard {
    /// Where it is.
    pub path: PathBuf,
    /// Its header.
    pub header: Header,
    map: Mmap,
}

impl Shard {
    /// Maps and checks a shard.
    pub fn open(path: &Path) -> Result<Shard> {
        let file = File::open(path).with_context(|| format!("cannot open shard {}", path.display()))?;
        let len = file.metadata()?.len();
        // SAFETY: the map is read-only; shards are written once under a temporary name and
        // renamed, never modified in place.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
        let header = Header::parse(&map, len, path)?;
        let shard = Shard { path: path.to_path_buf(), header, map };
        shard.check_tokens()?;
        Ok(shard)
    }

    /// Every token must be below the vocabulary the header declares (a token outside it would
    /// index past the embedding table), and the tokens must match the header's content digest
    /// (a shard edited in place, its length kept, would otherwise train, or resume a run, on
    /// other data). One pass over the shard when it is opened, in parallel by digest pieces;
    /// cheap next to training on it.
    fn check_tokens(&self) -> Result<()> {
        use rayon::prelude::*;
        let (p, vocab) = (self.path.display(), self.header.vocab_size);
        if vocab == 0 {
            bail!(
                "{p}: its header declares a vocabulary of 0 tokens (damaged?); rewrite it with `engine data prepare`"
            );
        }
        let width = self.header.token_bytes as usize;
        let bytes = &self.map[HEADER_LEN..];
        // Per digest piece: its first token outside the vocabulary (position, value), its SHA-256.
        type Piece = (Option<(usize, u32)>, [u8; 32]);
        let pieces: Vec<Piece> = bytes
            .par_chunks(PIECE_BYTES)
            .enumerate()
            .map(|(i, piece)| {
                let first_token = i * (PIECE_BYTES / width);
                let bad = piece.chunks_exact(width).enumerate().find_map(|(j, b)| {
                    let t = if width == 2 {
                        u16::from_le_bytes([b[0], b[1]]) as u32
                    } else {
                        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
                    };
                    (t >= vocab).then_some((first_token + j, t))
                });
                (bad, Sha256::digest(piece).into())
            })
            .collect();
        if let Some((offset, token)) = pieces.iter().find_map(|(bad, _)| *bad) {
            bail!(
                "{p}: token {token} at position {offset} is outside the vocabulary of {vocab} its header declares (damaged?); rewrite it with `engine data prepare`"
            );
        }
        if self.header.has_digest() {
            let mut outer = Sha256::new();
            pieces.iter().for_each(|(_, d)| outer.update(d));
            if digest_of(outer) != self.header.digest {
                bail!(
                    "{p}: its tokens do not match the content digest in its header (edited or damaged since `engine data prepare` wrote it); prepare the data again"
                );
            }
        }
        Ok(())
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.header.tokens as usize
    }

    /// Whether the shard holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies tokens `start .. start + out.len()`.
    pub fn read(&self, start: usize, out: &mut [u32]) {
        let data = &self.map[HEADER_LEN..];
        match self.header.token_bytes {
            2 => {
                let bytes = &data[start * 2..(start + out.len()) * 2];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u16::from_le_bytes([b[0], b[1]]) as u32;
                }
            }
            _ => {
                let bytes = &data[start * 4..(start + out.len()) * 4];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }

    /// All tokens (for tools and tests; the loader reads windows).
    pub fn tokens(&self) -> Vec<u32> {
        let mut out = vec![0; self.len()];
        self.read(0, &mut out);
        out
    }
}

/// The shards a path names: a shard file, or every `*.tok` file of a directory in name order.
pub fn list(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(path).with_context(|| format!("data path {}", path.display()))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .with_context(|| format!("cannot list {}", path.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == EXTENSION) && p.is_file())
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("{} holds no token shards (*.{EXTENSION}); write some with `engine data prepare`", path.display());
    }
    Ok(files)
}

/// What identifies the shards `path` names, read from their headers alone (never their tokens,
/// so it is cheap enough for every checkpoint): each shard's file name and the SHA-256 of its
/// header, which holds its token count and the content digest of its tokens.
pub fn fingerprint(path: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for file in list(path)? {
        let mut header = [0u8; HEADER_LEN];
        File::open(&file)
            .and_then(|mut f| f.read_exact(&mut header))
            .with_context(|| format!("cannot read the header of shard {}", file.display()))?;
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        out.insert(name, sha256_hex(&header));
    }
    Ok(out)
}

/// Several shards read as one stream of tokens, in order.
pub struct Shards {
    shards: Vec<Shard>,
    /// `starts[i]` is the stream position of shard i's first token; the last entry is the total.
    starts: Vec<usize>,
}

impl Shards {
    /// Opens the shards a path names (see [`list`]). A directory must be the complete output
    /// of `engine data prepare`: its `prepare.json` lists exactly its shards and their tokens.
    pub fn open(path: &Path) -> Result<Shards> {
        let files = list(path)?;
        let shards = files.iter().map(|p| Shard::open(p)).collect::<Result<Vec<_>>>()?;
        if path.is_dir() {
            check_manifest(path, &files, &shards)?;
        }
        let mut starts = vec![0];
        for s in &shards {
            starts.push(starts.last().unwrap() + s.len());
        }
        Ok(Shards { shards, starts })
    }

    /// The shards, in stream order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }
}

/// The manifest `engine data prepare` writes last into its output directory.
pub const MANIFEST: &str = "prepare.json";

/// Checks a directory's shards against its manifest: a preparation that was interrupted (shards
/// and no manifest), a shard missing, added or cut short are each reported as such.
fn check_manifest(dir: &Path, files: &[PathBuf], shards: &[Shard]) -> Result<()> {
    #[derive(serde::Deserialize)]
    struct Manifest {
        tokens: u64,
        shards: Vec<String>,
    }
    let d = dir.display();
    let path = dir.join(MANIFEST);
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "{d} holds shards but no {MANIFEST}: its `engine data prepare` did not finish (interrupted?); run it again with --out {d} (it removes what the interrupted run left)"
        ),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let manifest: Manifest =
        serde_json::from_slice(&text).with_context(|| format!("{}: not a valid manifest", path.display()))?;
    let found: Vec<String> =
        files.iter().filter_map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned())).collect();
    if let Some(missing) = manifest.shards.iter().find(|n| !found.contains(n)) {
        bail!("{d}: shard {missing}, listed in {MANIFEST}, is missing");
    }
    if let Some(extra) = found.iter().find(|n| !manifest.shards.contains(n)) {
        bail!("{d}: shard {extra} is not listed in {MANIFEST} (left by another preparation?)");
    }
    let tokens: u64 = shards.iter().map(|s| s.header.tokens).sum();
    if tokens != manifest.tokens {
        bail!("{d}: the shards hold {tokens} tokens, {MANIFEST} says {}", manifest.tokens);
    }
    Ok(())
}

/// Writes the part of a manifest that readers check, for tests that write shards by hand.
#[cfg(test)]
pub(crate) fn write_test_manifest(dir: &Path, shards: &[&str], tokens: u64) {
    let manifest = serde_json::json!({ "tokens": tokens, "shards": shards });
    std::fs::write(dir.join(MANIFEST), manifest.to_string()).unwrap();
}

impl TokenSource for Shards {
    fn len(&self) -> usize {
        *self.starts.last().expect("at least the zero start")
    }

    fn read(&self, start: usize, out: &mut [u32]) {
        let (mut pos, mut done) = (start, 0);
        while done < out.len() {
            // The shard holding `pos`: the last one starting at or before it.
            let i = self.starts.partition_point(|&s| s <= pos) - 1;
            let shard = &self.shards[i];
            let offset = pos - self.starts[i];
            let n = (shard.len() - offset).min(out.len() - done);
            shard.read(offset, &mut out[done..done + n]);
            done += n;
            pos += n;
        }
    }

    fn vocab_needed(&self) -> usize {
        self.shards.iter().map(|s| s.header.vocab_size as usize).max().unwrap_or(0)
    }
}

/// Writes one shard: under a temporary name, then flushed and renamed into place. Dropped
/// unfinished, it removes its temporary file.
pub struct ShardWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    header: Header,
    digest: PieceHasher,
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

impl ShardWriter {
    /// Starts a shard at `path` for a tokenizer with this vocabulary and end-of-sequence token.
    pub fn create(path: &Path, vocab_size: usize, eos: u32) -> Result<ShardWriter> {
        path.file_name().context("shard path has no file name")?;
        // A random name created new, never through a link planted at a predictable one.
        let (tmp, file) =
            fsutil::create_temp(path).with_context(|| format!("cannot create a shard beside {}", path.display()))?;
        let header = Header {
            token_bytes: token_bytes_for(vocab_size),
            tokens: 0,
            documents: 0,
            vocab_size: vocab_size as u32,
            eos,
            digest: [0; DIGEST_LEN],
        };
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&header.to_bytes())?;
        Ok(ShardWriter { path: path.to_path_buf(), tmp, out: Some(out), header, digest: PieceHasher::default() })
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.header.tokens
    }

    /// Appends one document's tokens (the caller has closed it with the end-of-sequence token).
    pub fn push_document(&mut self, tokens: &[u32]) -> Result<()> {
        self.push_tokens(tokens)?;
        self.end_document();
        Ok(())
    }

    /// Appends some of a document's tokens, so that a long document's are written as its parts
    /// are tokenized instead of held until it ends; [`ShardWriter::end_document`] counts it.
    pub fn push_tokens(&mut self, tokens: &[u32]) -> Result<()> {
        let mut buf = Vec::with_capacity(tokens.len() * self.header.token_bytes as usize);
        for &t in tokens {
            debug_assert!(t < self.header.vocab_size);
            match self.header.token_bytes {
                2 => buf.extend_from_slice(&(t as u16).to_le_bytes()),
                _ => buf.extend_from_slice(&t.to_le_bytes()),
            }
        }
        let out = self.out.as_mut().expect("open until finished");
        out.write_all(&buf).with_context(|| format!("cannot write {}", self.tmp.display()))?;
        self.digest.update(&buf);
        self.header.tokens += tokens.len() as u64;
        Ok(())
    }

    /// Counts the document whose tokens [`ShardWriter::push_tokens`] wrote (the last of them
    /// its end-of-sequence token).
    pub fn end_document(&mut self) {
        self.header.documents += 1;
    }

    /// Writes the final header (with the content digest), flushes the file to disk and renames
    /// it into place.
    pub fn finish(mut self) -> Result<Header> {
        let mut out = self.out.take().expect("open until finished");
        self.header.digest = std::mem::take(&mut self.digest).finish();
        let result = (|| -> Result<()> {
            out.seek(SeekFrom::Start(0))?;
            out.write_all(&self.header.to_bytes())?;
            let file = out.into_inner().map_err(|e| e.into_error())?;
            fsutil::set_default_mode(&file)?;
            file.sync_all()?;
            std::fs::rename(&self.tmp, &self.path)?;
            fsutil::sync_dir(self.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))?;
            Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&self.tmp);
        }
        result.with_context(|| format!("cannot write shard {}", self.path.display()))?;
        Ok(self.header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, vocab: usize, docs: &[&[u32]]) {
        let mut w = ShardWriter::create(path, vocab, 0).unwrap();
        for d in docs {
            w.push_document(d).unwrap();
        }
        w.finish().unwrap();
    }

    #[test]
    fn shards_read_back_as_one_stream_whatever_the_width() {
        let dir = tempfile::tempdir().unwrap();
        write(&dir.path().join("a.tok"), 1000, &[&[1, 2, 3], &[4, 0]]);
        write(&dir.path().join("b.tok"), 100_000, &[&[99_999, 5, 0]]);
        let e = Shards::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("no prepare.json"), "{e}");
        write_test_manifest(dir.path(), &["a.tok", "b.tok"], 8);
        let s = Shards::open(dir.path()).unwrap();
        assert_eq!(s.shards()[0].header.token_bytes, 2);
        assert_eq!(s.shards()[1].header.token_bytes, 4);
        assert_eq!((s.len(), s.vocab_needed()), (8, 100_000));
        let mut out = vec![0; 5];
        s.read(3, &mut out);
        assert_eq!(out, [4, 0, 99_999, 5, 0]);
        assert_eq!(s.shards()[0].header.documents, 2);
    }

    #[test]
    fn the_content_digest_is_written_checked_and_optional_for_old_shards() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tok");
        // More than one digest piece (2-byte tokens, 4 MiB pieces): 2^21 + 5 tokens.
        let doc: Vec<u32> = (0..(1u32 << 21) + 5).map(|i| i % 999).collect();
        write(&path, 1000, &[&doc]);
        let bytes = std::fs::read(&path).unwrap();
        let shard = Shard::open(&path).unwrap();
        assert!(shard.header.has_digest());
        assert_eq!(shard.header.digest, content_digest(&bytes[HEADER_LEN..]));
        assert_ne!(
            content_digest(&bytes[HEADER_LEN..HEADER_LEN + 4]),
            content_digest(&bytes[HEADER_LEN..HEADER_LEN + 6])
        );
        let before = fingerprint(&path).unwrap();

        // One token changed in place, in the second piece, still inside the vocabulary.
        let mut edited = bytes.clone();
        let at = HEADER_LEN + PIECE_BYTES + 2;
        edited[at] ^= 1;
        std::fs::write(&path, &edited).unwrap();
        let e = Shard::open(&path).err().unwrap().to_string();
        assert!(e.contains("a.tok: its tokens do not match the content digest"), "{e}");
        assert_eq!(fingerprint(&path).unwrap(), before, "the header alone does not show the edit");

        // A shard written before the digest (reserved bytes zero) is read unchecked; its
        // fingerprint differs from the one with a digest.
        edited[40..64].fill(0);
        std::fs::write(&path, &edited).unwrap();
        assert!(!Shard::open(&path).unwrap().header.has_digest());
        assert_ne!(fingerprint(&path).unwrap(), before);
    }

    #[test]
    fn truncated_and_foreign_files_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tok");
        write(&path, 1000, &[&[1, 2, 3]]);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        let e = Shard::open(&path).err().unwrap().to_string();
        assert!(e.contains("a.tok") && e.contains("truncated"), "{e}");
        std::fs::write(&path, b"hello").unwrap();
        assert!(Shard::open(&path).err().unwrap().to_string().contains("not a token shard"));
        // Found by fuzzing (fuzz/seeds/shard/overflow): 2^63 + 3 tokens of 2 bytes wrapped to 6
        // bytes, so a 70-byte file passed and the loader would read past it.
        let mut header =
            Header { token_bytes: 2, tokens: (1 << 63) + 3, documents: 1, vocab_size: 9, eos: 0, digest: [0; 24] }
                .to_bytes()
                .to_vec();
        header.extend_from_slice(&[1, 0, 2, 0, 0, 0]);
        std::fs::write(&path, &header).unwrap();
        let e = Shard::open(&path).err().unwrap().to_string();
        assert!(e.contains("announces 9223372036854775811 tokens, more than any file holds"), "{e}");
        let empty = tempfile::tempdir().unwrap();
        assert!(Shards::open(empty.path()).err().unwrap().to_string().contains("holds no token shards"));
    }
}
