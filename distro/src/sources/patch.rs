//! Patch files: reading them for a source (with their SHA-256), and parsing the file and hunk
//! headers that conflict reports name.

use crate::error::bad_input;
use anyhow::Result;

use super::lock::LockedPatch;
use super::manifest::{Manifest, PatchSpec, Source};
use crate::hex::sha256_hex;

/// A patch ready to apply: its bytes and where it came from.
#[derive(Clone, Debug)]
pub struct PatchFile {
    /// The entry as written in the manifest or on the command line.
    pub entry: String,
    /// The file relative to the project root, when the patch lives in the project.
    pub file: Option<String>,
    /// The patch (an mbox as `git format-patch` writes it).
    pub bytes: Vec<u8>,
    /// SHA-256 of `bytes`.
    pub sha256: String,
    /// True for a patch added for one run (`--patch`), not listed in the manifest.
    pub extra: bool,
}

impl PatchFile {
    /// A patch from its bytes.
    pub fn new(entry: String, file: Option<String>, bytes: Vec<u8>, extra: bool) -> PatchFile {
        let sha256 = sha256_hex(&bytes);
        PatchFile { entry, file, bytes, sha256, extra }
    }

    /// How the lock records this patch.
    pub fn locked(&self) -> LockedPatch {
        LockedPatch {
            entry: self.entry.clone(),
            file: self.file.clone(),
            sha256: self.sha256.clone(),
            extra: self.extra,
        }
    }

    /// The name used in messages: the file when there is one, else the entry.
    pub fn label(&self) -> String {
        match &self.file {
            Some(f) if f != &self.entry => format!("{} ({f})", self.entry),
            _ => self.entry.clone(),
        }
    }
}

/// Reads every patch of `source` from the project, in manifest order. A missing file is a
/// one-line error naming it and its manifest position; an upstream ref that has not been
/// exported asks for `distro patches refresh`.
pub fn read_source_patches(manifest: &Manifest, source: &Source) -> Result<Vec<PatchFile>> {
    source
        .patches
        .iter()
        .map(|p| {
            let file = p.spec.file(&source.name);
            let path = manifest.project_path(&file);
            match std::fs::read(&path) {
                Ok(bytes) => Ok(PatchFile::new(p.spec.text().to_owned(), Some(file), bytes, false)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(bad_input(match &p.spec {
                    PatchSpec::File(_) => format!(
                        "{}: patch file {} does not exist; restore it or remove it from `patches`",
                        manifest.at(p.loc),
                        path.display()
                    ),
                    PatchSpec::Ref(r) => format!(
                        "{}: upstream patch {r} has not been exported to {}; run `distro patches refresh {}`",
                        manifest.at(p.loc),
                        path.display(),
                        source.name
                    ),
                })),
                Err(e) => Err(bad_input(format!("{}: reading {}: {e}", manifest.at(p.loc), path.display()))),
            }
        })
        .collect()
}

/// The hunks of one file in a patch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileHunks {
    /// The file's path (the new name; the old one for a deletion).
    pub path: String,
    /// Hunk headers (`@@ -1,5 +1,6 @@ context`), in order; hunk #N is `hunks[N-1]`.
    pub hunks: Vec<String>,
}

/// The files and hunk headers of a unified diff in git's format, in order of appearance.
pub fn parse_hunks(patch: &str) -> Vec<FileHunks> {
    let mut files: Vec<FileHunks> = Vec::new();
    let mut old_path: Option<String> = None;
    let mut in_diff = false;
    for line in patch.lines() {
        if let Some(rest) = line.strip_prefix("diff --git ") {
            in_diff = true;
            old_path = None;
            // Until ---/+++ lines name it, take the b/ side of the header.
            let path = rest.rsplit_once(" b/").map(|(_, b)| b.to_owned()).unwrap_or_else(|| rest.to_owned());
            files.push(FileHunks { path, hunks: Vec::new() });
        } else if !in_diff {
            continue;
        } else if let Some(p) = line.strip_prefix("--- ") {
            old_path = p.strip_prefix("a/").map(str::to_owned);
        } else if let Some(p) = line.strip_prefix("+++ ") {
            let path = match p.strip_prefix("b/") {
                Some(b) => Some(b.to_owned()),
                None => old_path.clone(), // +++ /dev/null: a deletion
            };
            if let (Some(path), Some(f)) = (path, files.last_mut()) {
                f.path = path;
            }
        } else if line.starts_with("@@ ") {
            if let Some(f) = files.last_mut() {
                f.hunks.push(line.trim_end().to_owned());
            }
        } else if line == "-- " {
            // The signature separator ends the diff of this mail.
            in_diff = false;
        }
    }
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATCH: &str = "From 1 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] x\n\n---\n a | 2 +-\n\ndiff --git a/src/a.rs b/src/a.rs\nindex 1..2 100644\n--- a/src/a.rs\n+++ b/src/a.rs\n@@ -1,3 +1,3 @@ fn main() {\n-a\n+b\n c\n@@ -10,2 +10,2 @@\n-x\n+y\ndiff --git a/gone.txt b/gone.txt\ndeleted file mode 100644\n--- a/gone.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\ndiff --git a/new file.txt b/new file.txt\nnew file mode 100644\n--- /dev/null\n+++ b/new file.txt\n@@ -0,0 +1 @@\n+hi\n-- \n2.47.3\n";

    #[test]
    fn files_and_hunks_are_listed_in_order() {
        let files = parse_hunks(PATCH);
        assert_eq!(
            files,
            vec![
                FileHunks {
                    path: "src/a.rs".into(),
                    hunks: vec!["@@ -1,3 +1,3 @@ fn main() {".into(), "@@ -10,2 +10,2 @@".into()]
                },
                FileHunks { path: "gone.txt".into(), hunks: vec!["@@ -1 +0,0 @@".into()] },
                FileHunks { path: "new file.txt".into(), hunks: vec!["@@ -0,0 +1 @@".into()] },
            ]
        );
    }

    #[test]
    fn labels_name_ref_and_file() {
        let p = PatchFile::new("pull/1/head".into(), Some("patches/x/PR-1.patch".into()), b"x".to_vec(), false);
        assert_eq!(p.label(), "pull/1/head (patches/x/PR-1.patch)");
        let p = PatchFile::new("patches/x/a.patch".into(), Some("patches/x/a.patch".into()), b"x".to_vec(), false);
        assert_eq!(p.label(), "patches/x/a.patch");
    }
}
