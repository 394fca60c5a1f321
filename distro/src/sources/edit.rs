//! Format-preserving edits of the manifest (`distro bump`): new pins and dropped patches,
//! leaving comments, order and layout as the maintainer wrote them.

use anyhow::{Context, Result, anyhow};
use toml_edit::{DocumentMut, Item, Value};

/// What `distro bump` changes in one source's table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceEdit {
    /// The source's name.
    pub name: String,
    /// The key of the pin (`commit` or `version`) and its new value.
    pub pin: (&'static str, String),
    /// Patch entries to remove from `patches` (as written in the manifest).
    pub drop_patches: Vec<String>,
}

/// Sets `digest` of base `name` (`[bases.NAME]`) in manifest `text`, keeping its decoration.
pub fn edit_base_digest(text: &str, name: &str, digest: &str) -> Result<String> {
    let mut doc: DocumentMut = text.parse().context("re-reading the manifest for editing")?;
    let table = doc
        .get_mut("bases")
        .and_then(|s| s.get_mut(name))
        .and_then(Item::as_table_like_mut)
        .ok_or_else(|| anyhow!("base `{name}` vanished from the manifest while editing"))?;
    match table.get_mut("digest").and_then(Item::as_value_mut) {
        Some(value) => {
            let decor = value.decor().clone();
            *value = Value::from(digest);
            *value.decor_mut() = decor;
        }
        None => {
            table.insert("digest", toml_edit::value(digest));
        }
    }
    Ok(doc.to_string())
}

/// Applies `edits` to manifest `text` and returns the new text.
pub fn edit_manifest(text: &str, edits: &[SourceEdit]) -> Result<String> {
    let mut doc: DocumentMut = text.parse().context("re-reading the manifest for editing")?;
    for edit in edits {
        let table = doc
            .get_mut("sources")
            .and_then(|s| s.get_mut(&edit.name))
            .and_then(Item::as_table_like_mut)
            .ok_or_else(|| anyhow!("source `{}` vanished from the manifest while editing", edit.name))?;
        let (key, new) = &edit.pin;
        match table.get_mut(key).and_then(Item::as_value_mut) {
            Some(value) => {
                let decor = value.decor().clone();
                *value = Value::from(new.as_str());
                *value.decor_mut() = decor;
            }
            None => {
                table.insert(key, toml_edit::value(new.as_str()));
            }
        }
        if edit.drop_patches.is_empty() {
            continue;
        }
        let patches = table
            .get_mut("patches")
            .and_then(Item::as_array_mut)
            .ok_or_else(|| anyhow!("source `{}` has no `patches` array to drop patches from", edit.name))?;
        for entry in &edit.drop_patches {
            let Some(i) = patches.iter().position(|v| v.as_str() == Some(entry.as_str())) else {
                continue;
            };
            let removed = patches.remove(i);
            // On one line (`["a", "b"]`), the element that becomes first takes the removed
            // one's spacing; on several lines each element keeps its own (and its comments).
            let prefix = removed.decor().prefix().and_then(|p| p.as_str()).unwrap_or("").to_owned();
            if i == 0
                && !prefix.contains('\n')
                && let Some(first) = patches.get_mut(0)
            {
                first.decor_mut().set_prefix(prefix);
            }
        }
    }
    Ok(doc.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# Upstream sources.
[sources.foo]
url = "u"               # the repo
tracking_ref = "main"
commit = "aaaa"  # pinned by bump
patches = [
  # fixes the build on aarch64
  "patches/foo/0001-a.patch",
  "pull/7/head",  # upstream PR
]

[sources.c]
crate = "c"
patches = ["patches/c/x.patch", "patches/c/y.patch"]
"#;

    #[test]
    fn pins_change_and_comments_stay() {
        let out = edit_manifest(
            TEXT,
            &[SourceEdit { name: "foo".into(), pin: ("commit", "bbbb".into()), drop_patches: vec![] }],
        )
        .unwrap();
        assert_eq!(out, TEXT.replace("\"aaaa\"", "\"bbbb\""));
    }

    #[test]
    fn dropped_patches_take_their_comment_with_them() {
        let out = edit_manifest(
            TEXT,
            &[
                SourceEdit {
                    name: "foo".into(),
                    pin: ("commit", "aaaa".into()),
                    drop_patches: vec!["patches/foo/0001-a.patch".into()],
                },
                SourceEdit {
                    name: "c".into(),
                    pin: ("version", "1.0.0".into()),
                    drop_patches: vec!["patches/c/x.patch".into()],
                },
            ],
        )
        .unwrap();
        assert!(out.contains("patches = [\n  \"pull/7/head\",  # upstream PR\n]"), "{out}");
        assert!(!out.contains("aarch64"), "{out}");
        assert!(out.contains("patches = [\"patches/c/y.patch\"]\nversion = \"1.0.0\"\n"), "{out}");
    }
}
