//! Canonical JSON: object keys sorted by their bytes, no insignificant whitespace.
//!
//! Digests of manifests and configs are digests of their JSON bytes, so the bytes must not depend
//! on map iteration order (oci-spec's types hold `HashMap`s, random per process) nor on whether
//! some crate in the tree turned on serde_json's `preserve_order`. The writer sorts keys itself
//! instead of trusting `serde_json::Map` to be a `BTreeMap`.
use anyhow::Result;
use serde::Serialize;
use serde_json::Value;

/// Canonical bytes of `value`.
pub fn canonical(value: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    write(value, &mut out);
    out
}

/// Canonical bytes of anything serializable (through [`serde_json::Value`]).
pub fn to_canonical<T: Serialize>(t: &T) -> Result<Vec<u8>> {
    Ok(canonical(&serde_json::to_value(t)?))
}

fn write(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, k).expect("writing a string to a Vec cannot fail");
                out.push(b':');
                write(v, out);
            }
            out.push(b'}');
        }
        // Scalars have one serde_json spelling each.
        scalar => serde_json::to_writer(&mut *out, scalar).expect("writing to a Vec cannot fail"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::HashMap;

    #[test]
    fn sorts_keys_at_every_depth_and_drops_whitespace() {
        let v = json!({"b": 1, "a": {"z": [3, {"y": null, "x": true}], "m": "é\"\n"}, "A": 1.5});
        assert_eq!(
            String::from_utf8(canonical(&v)).unwrap(),
            r#"{"A":1.5,"a":{"m":"é\"\n","z":[3,{"x":true,"y":null}]},"b":1}"#
        );
    }

    #[test]
    fn hashmap_order_does_not_leak() {
        // Many HashMaps with the same content have different iteration orders (random seeds);
        // their canonical bytes must all be equal.
        let first = {
            let m: HashMap<String, u32> = (0..64).map(|i| (format!("k{i}"), i)).collect();
            to_canonical(&m).unwrap()
        };
        for _ in 0..16 {
            let m: HashMap<String, u32> = (0..64).rev().map(|i| (format!("k{i}"), i)).collect();
            assert_eq!(to_canonical(&m).unwrap(), first);
        }
    }

    #[test]
    fn keys_sort_by_bytes_not_by_locale() {
        let v = json!({"b": 0, "B": 0, "_": 0, "a": 0, "ä": 0});
        assert_eq!(String::from_utf8(canonical(&v)).unwrap(), r#"{"B":0,"_":0,"a":0,"b":0,"ä":0}"#);
    }
}
