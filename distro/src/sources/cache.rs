//! The content-addressed cache under the user's cache directory.
//!
//! ```text
//! $DISTRO_CACHE_DIR, else $XDG_CACHE_HOME/distro, else ~/.cache/distro
//!   repos/<key>/        one git repository (with working tree) per upstream URL or crate
//!   repos/<key>.lock    held (flock) while a distro process uses the repository
//!   trees/<tree-id>/    materialised patched source trees, named by their git tree id
//!   patches/<sha256>    every patch distro applied, by SHA-256 (extra patches of one build too)
//!   tmp/                scratch space (Cargo projects, temporary indexes)
//! ```
//!
//! A repository's working tree is reset to a clean checkout before every use. One left in the
//! middle of `git am` (an earlier run crashed or was killed) is detected, reported and recovered.

use anyhow::{Context, Result, bail};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::fsutil::{holder, remove_all, write_atomic};
use crate::git::Git;
use crate::hex::{is_sha256, sha256_hex};

/// The cache root and its layout.
#[derive(Clone, Debug)]
pub struct Cache {
    root: PathBuf,
}

/// A cache repository, locked for this process while the value lives.
#[derive(Debug)]
pub struct Repo {
    /// The repository (its working tree is `repos/<key>/`).
    pub git: Git,
    _lock: File,
}

impl Cache {
    /// The cache from the environment: `DISTRO_CACHE_DIR`, else `$XDG_CACHE_HOME/distro`, else
    /// `$HOME/.cache/distro`.
    pub fn from_env() -> Result<Cache> {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let root = if let Some(dir) = var("DISTRO_CACHE_DIR") {
            dir
        } else if let Some(xdg) = var("XDG_CACHE_HOME").filter(|p| p.is_absolute()) {
            xdg.join("distro")
        } else if let Some(home) = var("HOME") {
            home.join(".cache").join("distro")
        } else {
            bail!("cannot find a cache directory: set DISTRO_CACHE_DIR (or XDG_CACHE_HOME or HOME)");
        };
        Ok(Cache::at(root))
    }

    /// A cache rooted at `root` (created on first use; a relative path is made absolute, since
    /// git runs in directories below it).
    pub fn at(root: impl Into<PathBuf>) -> Cache {
        let root = root.into();
        Cache { root: std::path::absolute(&root).unwrap_or(root) }
    }

    /// The cache's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the materialised tree with git tree id `tree` lives.
    pub fn tree_dir(&self, tree: &str) -> PathBuf {
        self.root.join("trees").join(tree)
    }

    /// A fresh scratch directory under the cache (removed when dropped).
    pub fn scratch(&self) -> Result<tempfile::TempDir> {
        let dir = self.root.join("tmp");
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        tempfile::Builder::new()
            .prefix("work-")
            .tempdir_in(&dir)
            .with_context(|| format!("creating a scratch directory in {}", dir.display()))
    }

    /// Keeps `bytes` in the patch store; returns their SHA-256.
    pub fn store_patch(&self, bytes: &[u8]) -> Result<String> {
        let sha = sha256_hex(bytes);
        let path = self.root.join("patches").join(&sha);
        if !path.exists() {
            write_atomic(&path, bytes)?;
        }
        Ok(sha)
    }

    /// The patch with SHA-256 `sha` from the store, when present and intact.
    pub fn stored_patch(&self, sha: &str) -> Option<Vec<u8>> {
        if !is_sha256(sha) {
            return None;
        }
        let bytes = fs::read(self.root.join("patches").join(sha)).ok()?;
        (sha256_hex(&bytes) == sha).then_some(bytes)
    }

    /// Opens (creating if needed) and locks the repository `repos/<key>`, recovering it if an
    /// earlier run left it mid-operation.
    pub fn open_repo(&self, key: &str) -> Result<Repo> {
        crate::git::check_version()?;
        let repos = self.root.join("repos");
        fs::create_dir_all(&repos).with_context(|| format!("creating {}", repos.display()))?;
        let dir = repos.join(key);
        let lock_path = repos.join(format!("{key}.lock"));
        let mut lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .with_context(|| format!("opening {}", lock_path.display()))?;
        // Waited for, not refused: a repository is held only while one fetch, patch series or
        // checkout runs (seconds to minutes), and the cache is shared by every build of the user.
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                eprintln!("distro: waiting for {}, which is using {}", holder(&lock_path), dir.display());
                lock.lock().with_context(|| format!("locking {}", lock_path.display()))?;
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", lock_path.display()));
            }
        }
        // The holder's PID, for the line above in the next process that waits.
        let _ = lock.set_len(0).and_then(|()| lock.write_all(format!("{}\n", std::process::id()).as_bytes()));
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let git = Git::new(&dir);
        if !dir.join(".git").join("HEAD").exists() {
            git.run(["init", "--quiet", "--template="])?;
        }
        // Blobs are written and checked out byte for byte: no end-of-line conversion, filters
        // or keyword expansion, whatever `.gitattributes` upstream (or a crate) carries.
        let info = dir.join(".git").join("info");
        fs::create_dir_all(&info)?;
        let attributes = "* -text -filter -ident -working-tree-encoding\n";
        if fs::read_to_string(info.join("attributes")).ok().as_deref() != Some(attributes) {
            fs::write(info.join("attributes"), attributes)?;
        }
        let repo = Repo { git, _lock: lock };
        repo.recover()?;
        Ok(repo)
    }
}

impl Repo {
    /// The working tree directory.
    pub fn dir(&self) -> &Path {
        self.git.dir()
    }

    /// The `.git` directory.
    pub fn git_dir(&self) -> PathBuf {
        self.dir().join(".git")
    }

    /// Puts back a repository that an interrupted run left mid-`git am` (or mid-merge, or with
    /// a stale index lock). We hold the repository's lock, so such state cannot belong to a
    /// live process.
    fn recover(&self) -> Result<()> {
        let gd = self.git_dir();
        if gd.join("index.lock").exists() {
            eprintln!(
                "distro: warning: removing a stale {} left by an interrupted run",
                gd.join("index.lock").display()
            );
            remove_all(&gd.join("index.lock"))?;
        }
        if gd.join("rebase-apply").exists() {
            eprintln!(
                "distro: warning: {} was left in the middle of `git am` by an earlier run that did not finish; aborting it and applying the patches again from a clean checkout",
                self.dir().display()
            );
            let _ = self.git.output(["am", "--abort"]);
            remove_all(&gd.join("rebase-apply"))?;
        }
        for leftover in ["rebase-merge", "MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD"] {
            remove_all(&gd.join(leftover))?;
        }
        Ok(())
    }

    /// Checks out `commit` (detached) and removes every file not in it, so nothing from an
    /// earlier use of the working tree can leak into the next result.
    pub fn checkout_clean(&self, commit: &str) -> Result<()> {
        self.git.run(["checkout", "--quiet", "--detach", "--force", commit])?;
        self.git.run(["clean", "-ffdxq"])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_store_is_content_addressed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path());
        let sha = cache.store_patch(b"diff").unwrap();
        assert_eq!(cache.stored_patch(&sha).unwrap(), b"diff");
        // A tampered entry is not returned.
        fs::write(dir.path().join("patches").join(&sha), "other").unwrap();
        assert!(cache.stored_patch(&sha).is_none());
    }

    #[test]
    fn a_repository_left_mid_am_is_recovered_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path());
        let repo = cache.open_repo("r").unwrap();
        fs::write(repo.dir().join("f"), "1\n").unwrap();
        repo.git.run(["add", "f"]).unwrap();
        repo.git.run(["commit", "-q", "-m", "base"]).unwrap();
        // A patch that cannot apply leaves .git/rebase-apply behind, as a crash would.
        let patch = "From 0 Mon Sep 17 00:00:00 2001\nFrom: a <a@b>\nDate: Thu, 1 Jan 2015 00:00:00 +0000\nSubject: [PATCH] x\n\n---\ndiff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-zzz\n+2\n";
        fs::write(dir.path().join("p.patch"), patch).unwrap();
        let out = repo.git.output(["am", dir.path().join("p.patch").to_str().unwrap()]).unwrap();
        assert!(!out.status.success());
        assert!(repo.git_dir().join("rebase-apply").exists());
        drop(repo);
        let repo = cache.open_repo("r").unwrap();
        assert!(!repo.git_dir().join("rebase-apply").exists());
        assert_eq!(repo.git.run(["status", "--porcelain"]).unwrap(), "");
    }

    #[test]
    fn tree_dirs_are_named_by_tree_id() {
        let c = Cache::at("/x");
        assert_eq!(c.tree_dir(&"a".repeat(40)), Path::new("/x/trees").join("a".repeat(40)));
    }
}
