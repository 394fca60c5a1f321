//! Models written by hand for the tests: protobuf messages built field by field.

use super::{SpModel, SpTokenizer};

/// Encodes a protobuf message by hand: (field, wire type, payload).
pub(super) fn message(fields: &[(u32, u8, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    let varint = |out: &mut Vec<u8>, mut v: u64| {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    };
    for (n, wire, payload) in fields {
        varint(&mut out, ((*n as u64) << 3) | *wire as u64);
        match wire {
            2 => {
                varint(&mut out, payload.len() as u64);
                out.extend_from_slice(payload);
            }
            _ => out.extend_from_slice(payload),
        }
    }
    out
}

pub(super) fn piece(text: &str, score: f32, kind: u8) -> (u32, u8, Vec<u8>) {
    (1, 2, message(&[(1, 2, text.as_bytes().to_vec()), (2, 5, score.to_le_bytes().to_vec()), (3, 0, vec![kind])]))
}

pub(super) const NORMAL: u8 = 1;
pub(super) const UNKNOWN: u8 = 2;
pub(super) const USER: u8 = 4;
pub(super) const UNUSED: u8 = 5;

/// A model of the given type (1 Unigram, 2 BPE) with identity normalization, no dummy prefix
/// and `<unk>` first, then `pieces`.
pub(super) fn bare(model_type: u8, pieces: &[(&str, f32, u8)]) -> SpTokenizer {
    let mut fields = vec![piece("<unk>", 0.0, UNKNOWN)];
    fields.extend(pieces.iter().map(|&(t, s, k)| piece(t, s, k)));
    fields.push((2, 2, message(&[(3, 0, vec![model_type])])));
    fields.push((3, 2, message(&[(1, 2, b"identity".to_vec()), (3, 0, vec![0])])));
    SpModel::parse(&message(&fields)).unwrap().to_tokenizer().unwrap()
}
