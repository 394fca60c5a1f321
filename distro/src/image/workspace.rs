//! The workspace being built: its root, revision, commit time and git-tracked files.
use crate::error::bad_input;
use crate::git::Git;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// A git checkout of the project.
#[derive(Clone, Debug)]
pub struct Workspace {
    /// Top-level directory of the checkout (where the root `Cargo.toml` is).
    pub root: PathBuf,
    /// Commit id of `HEAD`.
    pub commit: String,
    /// True when tracked files differ from `HEAD`.
    pub dirty: bool,
    /// Committer time of `HEAD` (Unix seconds): the default `SOURCE_DATE_EPOCH`.
    pub commit_time: u64,
    /// Tracked files (relative, `/`-separated, sorted), as present in the working tree.
    pub files: Vec<String>,
    /// `workspace.package.repository` from the root `Cargo.toml`, if any.
    pub repository: Option<String>,
}

/// Runs git in the user's checkout (their configuration applies, as for `git status`).
fn git(dir: &Path, args: &[&str]) -> Result<Vec<u8>> {
    Git::checkout(dir).run_bytes(args)
}

impl Workspace {
    /// Opens the git checkout containing `start`.
    pub fn open(start: &Path) -> Result<Workspace> {
        let top = git(start, &["rev-parse", "--show-toplevel"])
            .map_err(|e| bad_input(format!("{}: not inside a git checkout of the project ({e:#})", start.display())))?;
        let root = PathBuf::from(String::from_utf8_lossy(&top).trim());
        let head = git(&root, &["log", "-1", "--format=%H %ct"])
            .map_err(|e| bad_input(format!("{}: the checkout has no commit to build ({e:#})", root.display())))?;
        let head = String::from_utf8_lossy(&head);
        let (commit, time) = head.trim().split_once(' ').context("unexpected git log output")?;
        let dirty = !git(&root, &["status", "--porcelain", "--untracked-files=no"])?.is_empty();
        let mut files: Vec<String> = git(&root, &["ls-files", "-z", "--cached"])?
            .split(|&b| b == 0)
            .filter(|p| !p.is_empty())
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .filter(|p| root.join(p).symlink_metadata().is_ok_and(|m| !m.is_dir()))
            .collect();
        files.sort();
        files.dedup();
        let repository = std::fs::read_to_string(root.join("Cargo.toml"))
            .ok()
            .and_then(|t| t.parse::<toml::Table>().ok())
            .and_then(|t| t.get("workspace")?.get("package")?.get("repository")?.as_str().map(String::from));
        Ok(Workspace {
            root,
            commit: commit.to_string(),
            dirty,
            commit_time: time.parse().context("commit time")?,
            files,
            repository,
        })
    }

    /// A workspace without git (a Docker build context): the nearest directory holding a
    /// `Cargo.toml` with `[workspace]`; the commit is `revision` (or `unknown`) and the commit
    /// time `SOURCE_DATE_EPOCH` (or 0).
    pub fn plain(start: &Path, revision: Option<&str>) -> Result<Workspace> {
        let mut dir = Some(start);
        while let Some(d) = dir {
            let text = std::fs::read_to_string(d.join("Cargo.toml")).unwrap_or_default();
            if text.parse::<toml::Table>().ok().is_some_and(|t| t.contains_key("workspace")) {
                let repository = text
                    .parse::<toml::Table>()
                    .ok()
                    .and_then(|t| t.get("workspace")?.get("package")?.get("repository")?.as_str().map(String::from));
                let commit_time =
                    std::env::var("SOURCE_DATE_EPOCH").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
                return Ok(Workspace {
                    root: d.to_path_buf(),
                    commit: revision.unwrap_or("unknown").to_string(),
                    dirty: false,
                    commit_time,
                    files: Vec::new(),
                    repository,
                });
            }
            dir = d.parent();
        }
        Err(bad_input(format!("{}: not inside a cargo workspace", start.display())))
    }

    /// The revision recorded in the image: the commit, with `-dirty` when the tree differs.
    pub fn revision(&self) -> String {
        if self.dirty { format!("{}-dirty", self.commit) } else { self.commit.clone() }
    }

    /// Tracked files under directory `dir` (relative to the root).
    pub fn files_under<'a>(&'a self, dir: &str) -> impl Iterator<Item = &'a String> + 'a {
        let prefix = format!("{}/", dir.trim_end_matches('/'));
        self.files.iter().filter(move |f| f.starts_with(&prefix))
    }
}
