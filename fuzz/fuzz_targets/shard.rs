//! The token shard reader: the header parser on the raw bytes, then the bytes as a shard file
//! opened as training opens it (header, length, every token against the vocabulary, the content
//! digest), read back whole, and fingerprinted as checkpoints do. Anything may be refused; no
//! input may panic, hang or overflow.
#![no_main]

use engine::data::shard::{Header, Shard, fingerprint};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let _ = Header::parse(data, data.len() as u64, Path::new("fuzz.tok"));
    let path = std::env::temp_dir().join(format!("fuzz-shard-{}.tok", std::process::id()));
    std::fs::write(&path, data).unwrap();
    let _ = fingerprint(&path);
    if let Ok(shard) = Shard::open(&path) {
        assert_eq!(shard.tokens().len(), shard.len());
    }
});
