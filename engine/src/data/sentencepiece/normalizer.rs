//! Normalization (`normalizer.cc`, `Normalizer::Normalize`): user-defined symbols kept, the
//! precompiled character map's rules applied, whitespace removed, added and escaped as the
//! model's normalizer settings say.

use anyhow::{Result, anyhow, bail};

use super::lookup::FrozenTrie;

/// A precompiled character map (`Normalizer::DecodePrecompiledCharsMap`): the size of a Darts
/// double-array trie (u32, little-endian), the trie's 32-bit units, then the replacements, each
/// ending with a NUL byte; a key's value is the offset of its replacement.
pub(super) struct CharsMap {
    units: Vec<u32>,
    replacements: String,
}

impl CharsMap {
    pub(super) fn parse(blob: &[u8]) -> Result<CharsMap> {
        let size = blob.get(..4).ok_or_else(|| anyhow!("shorter than 4 bytes"))?;
        let size = u32::from_le_bytes(size.try_into().expect("4 bytes")) as usize;
        let trie = blob.get(4..4 + size).ok_or_else(|| anyhow!("its trie of {size} bytes is longer than the map"))?;
        let units: Vec<u32> =
            trie.chunks_exact(4).map(|u| u32::from_le_bytes(u.try_into().expect("4 bytes"))).collect();
        let replacements = String::from_utf8(blob[4 + size..].to_vec())
            .map_err(|_| anyhow!("its replacement strings are not UTF-8"))?;
        if units.is_empty() {
            bail!("its trie is empty");
        }
        Ok(CharsMap { units, replacements })
    }

    /// The longest rule matching a prefix of `text` (`NormalizePrefix`): its length in bytes and
    /// replacement. Darts' `commonPrefixSearch`, with reads outside the trie taken as no match.
    fn longest<'a>(&'a self, text: &[u8]) -> Result<Option<(usize, &'a str)>> {
        // Unit fields (darts.h, DoubleArrayUnit).
        let has_leaf = |u: u32| (u >> 8) & 1 == 1;
        let value = |u: u32| u & ((1 << 31) - 1);
        let label = |u: u32| u & ((1 << 31) | 0xFF);
        let offset = |u: u32| ((u >> 10) << ((u & (1 << 9)) >> 6)) as usize;
        let mut longest = None;
        let mut found = 0;
        let mut node = offset(self.units[0]);
        for (i, &c) in text.iter().enumerate() {
            node ^= c as usize;
            let Some(&unit) = self.units.get(node) else { break };
            if label(unit) != c as u32 {
                break;
            }
            node ^= offset(unit);
            if has_leaf(unit) {
                let Some(&leaf) = self.units.get(node) else { break };
                // The reference keeps the first kMaxTrieResultsSize (32) matches.
                if found < 32 {
                    longest = Some((i + 1, value(leaf) as usize));
                }
                found += 1;
            }
        }
        let Some((len, at)) = longest else { return Ok(None) };
        let rest = self.replacements.get(at..).ok_or_else(|| anyhow!("precompiled_charsmap: bad replacement {at}"))?;
        Ok(Some((len, &rest[..rest.find('\0').unwrap_or(rest.len())])))
    }
}

/// The normalizer's settings (`NormalizerSpec`, and the trainer's `treat_whitespace_as_suffix`).
pub(super) struct Normalizer {
    pub(super) charsmap: Option<CharsMap>,
    pub(super) add_dummy_prefix: bool,
    pub(super) remove_extra_whitespaces: bool,
    pub(super) escape_whitespaces: bool,
    pub(super) treat_whitespace_as_suffix: bool,
}

impl Normalizer {
    /// The normalized form of the next prefix of `input` and the bytes it takes
    /// (`NormalizePrefix`): a user-defined symbol as it is, else the longest character-map rule,
    /// else one character.
    fn prefix<'a>(&'a self, input: &'a str, user: &FrozenTrie) -> Result<(&'a str, usize)> {
        if let Some(len) = user.longest(input.as_bytes()) {
            return Ok((&input[..len], len));
        }
        if let Some(map) = &self.charsmap
            && let Some((len, to)) = map.longest(input.as_bytes())?
        {
            if !input.is_char_boundary(len) {
                bail!("precompiled_charsmap: a rule ends inside a character");
            }
            return Ok((to, len));
        }
        let len = input.chars().next().map_or(0, char::len_utf8);
        Ok((&input[..len], len))
    }

    /// `Normalizer::Normalize`.
    pub(super) fn normalize(&self, mut input: &str, user: &FrozenTrie) -> Result<String> {
        if self.remove_extra_whitespaces {
            // Leading prefixes that normalize to one space are dropped.
            while !input.is_empty() {
                let (to, len) = self.prefix(input, user)?;
                if to != " " {
                    break;
                }
                input = &input[len..];
            }
        }
        let mut out = String::with_capacity(input.len() * 3 / 2 + 4);
        if input.is_empty() {
            return Ok(out);
        }
        let space = if self.escape_whitespaces { "\u{2581}" } else { " " };
        if self.add_dummy_prefix && !self.treat_whitespace_as_suffix {
            out.push_str(space);
        }
        let mut prev_space = self.remove_extra_whitespaces;
        while !input.is_empty() {
            let (mut to, len) = self.prefix(input, user)?;
            if prev_space {
                to = to.trim_start_matches(' ');
            }
            if !to.is_empty() {
                for piece in to.split_inclusive(' ') {
                    match piece.strip_suffix(' ') {
                        Some(text) if self.escape_whitespaces => {
                            out.push_str(text);
                            out.push('\u{2581}');
                        }
                        _ => out.push_str(piece),
                    }
                }
                prev_space = to.ends_with(' ');
            }
            input = &input[len..];
            if !self.remove_extra_whitespaces {
                prev_space = false;
            }
        }
        if self.remove_extra_whitespaces {
            while out.ends_with(space) {
                out.truncate(out.len() - space.len());
            }
        }
        if self.add_dummy_prefix && self.treat_whitespace_as_suffix {
            out.push_str(space);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::super::SpModel;
    use super::super::lookup::Trie;
    use super::*;
    use std::path::Path;

    #[test]
    fn the_normalizer_follows_the_flags() {
        let user = Trie::default().freeze();
        let n = |dummy, extra, escape, suffix| Normalizer {
            charsmap: None,
            add_dummy_prefix: dummy,
            remove_extra_whitespaces: extra,
            escape_whitespaces: escape,
            treat_whitespace_as_suffix: suffix,
        };
        let text = "  a  b\tc  ";
        assert_eq!(n(true, true, true, false).normalize(text, &user).unwrap(), "\u{2581}a\u{2581}b\tc");
        assert_eq!(n(true, true, true, true).normalize(text, &user).unwrap(), "a\u{2581}b\tc\u{2581}");
        assert_eq!(
            n(true, false, true, false).normalize(text, &user).unwrap(),
            "\u{2581}\u{2581}\u{2581}a\u{2581}\u{2581}b\tc\u{2581}\u{2581}"
        );
        assert_eq!(n(false, true, false, false).normalize(text, &user).unwrap(), "a b\tc");
        assert_eq!(n(true, true, true, false).normalize("   ", &user).unwrap(), "");
    }

    #[test]
    fn a_precompiled_charsmap_is_read() {
        // The nmt_nfkc map of the Unigram fixture (trained by the Python package).
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizers/spm-unigram.model");
        let m = SpModel::open(&path).unwrap();
        let t = m.to_tokenizer().unwrap();
        assert_eq!(t.normalizer.normalize("  \u{FF21}  \u{FB01}ne ", &t.user).unwrap(), "\u{2581}A\u{2581}fine");
        let broken = CharsMap::parse(&[8, 0, 0, 0, 1, 2]).map(|_| ()).unwrap_err();
        assert!(broken.to_string().contains("longer than the map"), "{broken}");
    }
}
