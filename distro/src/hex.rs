//! Lowercase hex and SHA-256, the one way this crate writes and checks hashes: OCI digests, the
//! lock's patch and crate checksums, git object ids.
use sha2::{Digest, Sha256};

/// The SHA-256 of `bytes` as 64 lowercase hex digits (the lock's patch and crate checksums, and
/// the hex part of an OCI digest).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// True when `s` is non-empty and all lowercase hex digits (the only hex this crate accepts:
/// digests, checksums and git object ids are all written that way).
pub fn is_lower_hex(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// True when `s` is 64 lowercase hex digits (a SHA-256).
pub fn is_sha256(s: &str) -> bool {
    s.len() == 64 && is_lower_hex(s)
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_known_input() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert!(is_sha256(&sha256_hex(b"")));
        assert!(!is_sha256(&"A".repeat(64)));
        assert!(!is_lower_hex(""));
    }
}
