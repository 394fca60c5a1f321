//! `distro fetch --out DIR`: copies of the patched trees outside the cache, at `DIR/NAME/`.
//!
//! `DIR/.distro-fetch.toml` records the tree id of each copy, so a later fetch replaces a copy
//! it wrote (when unmodified) and never touches anything else.

use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use super::cache::Cache;
use super::resolve::{FetchedSource, repo_for_origin};
use super::trees::hash_dir;
use crate::error::bad_input;
use crate::fsutil::{copy_tree, remove_all, write_atomic};

const MARKER: &str = ".distro-fetch.toml";

/// Copies each fetched tree to `out/NAME` and returns the copies' paths. An existing
/// `out/NAME` is replaced only if distro wrote it and nobody changed it since; anything else
/// is an error that asks the user to move it away.
pub fn copy_out(fetched: &[FetchedSource], out: &Path, root: &Path, cache: &Cache) -> Result<Vec<PathBuf>> {
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let marker_path = out.join(MARKER);
    let mut marker: BTreeMap<String, String> = match fs::read_to_string(&marker_path) {
        Ok(text) => toml::from_str::<Marker>(&text).map(|m| m.trees).unwrap_or_default(),
        Err(_) => BTreeMap::new(),
    };
    let mut paths = Vec::new();
    for f in fetched {
        let dest = out.join(&f.name);
        if fs::symlink_metadata(&dest).is_ok() {
            let Some(recorded) = marker.get(&f.name) else {
                return Err(bad_input(format!(
                    "{} exists and was not written by `distro fetch`; move it away or choose another --out",
                    dest.display()
                )));
            };
            let repo = repo_for_origin(cache, &f.origin, root)?;
            let scratch = cache.scratch()?;
            let now = hash_dir(&repo, &dest, scratch.path())?;
            if &now != recorded {
                return Err(bad_input(format!(
                    "{} has local changes since `distro fetch` wrote it; move it away (or delete it) and run the command again",
                    dest.display()
                )));
            }
            if now == f.tree {
                eprintln!("distro: {} is up to date", dest.display());
                paths.push(dest);
                continue;
            }
            remove_all(&dest)?;
        }
        let staging = out.join(format!(".{}.distro-tmp", f.name));
        remove_all(&staging)?;
        copy_tree(&f.dir, &staging)?;
        fs::rename(&staging, &dest).with_context(|| format!("moving the copy into {}", dest.display()))?;
        marker.insert(f.name.clone(), f.tree.clone());
        write_atomic(&marker_path, render(&marker).as_bytes())?;
        paths.push(dest);
    }
    Ok(paths)
}

#[derive(serde::Deserialize)]
struct Marker {
    #[serde(default)]
    trees: BTreeMap<String, String>,
}

fn render(trees: &BTreeMap<String, String>) -> String {
    let mut out =
        String::from("# Written by `distro fetch --out`: the git tree id of each source copied here.\n[trees]\n");
    for (name, tree) in trees {
        out.push_str(&format!("{} = {}\n", toml::Value::String(name.clone()), toml::Value::String(tree.clone())));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_round_trips() {
        let mut trees = BTreeMap::new();
        trees.insert("cudarc".to_owned(), "a".repeat(40));
        trees.insert("odd name".to_owned(), "b".repeat(40));
        let text = render(&trees);
        let back: Marker = toml::from_str(&text).unwrap();
        assert_eq!(back.trees, trees);
    }
}
