//! Applying a series of patches onto an upstream commit with `git am --3way`, detecting patches
//! upstream has already merged, and explaining the ones that no longer apply (patch, upstream
//! commit, files and hunks).

use anyhow::{Context, Result};
use std::fmt;
use std::fs;

use super::cache::{Cache, Repo};
use super::patch::{PatchFile, parse_hunks};
use crate::git::stderr_summary;

/// The commit patches are applied onto, and how to name it in messages.
#[derive(Clone, Debug)]
pub struct Base {
    /// The commit id.
    pub commit: String,
    /// E.g. "the pinned commit", "the tip of `main`", "crate 0.19.10".
    pub label: String,
}

/// What happened to one patch of a series.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The patch changed the tree.
    Applied,
    /// `git am` applied it without any change: everything it does is already there.
    NoChange,
    /// Its change is already upstream (reverse-applying the change it made on the old pin
    /// succeeds on the new base), so it was not applied.
    Merged,
}

/// A series applied successfully.
#[derive(Clone, Debug)]
pub struct Applied {
    /// The commit after the last patch (the base when nothing applied).
    pub head: String,
    /// Its tree id.
    pub tree: String,
    /// One outcome per patch, in order.
    pub outcomes: Vec<Outcome>,
    /// Per patch, the diff it made (only when asked for with `record_effects`).
    pub effects: Vec<Option<Vec<u8>>>,
}

/// How to apply a series.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options<'a> {
    /// Record the diff each patch made (`Applied::effects`), for merge detection on a later base.
    pub record_effects: bool,
    /// Per patch, the diff it made on the old base: when that diff reverse-applies on the new
    /// base the patch is reported [`Outcome::Merged`] and skipped.
    pub merged_if: Option<&'a [Option<Vec<u8>>]>,
}

/// A patch that does not apply: which patch, onto which upstream commit, and what failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    /// The source's name.
    pub source: String,
    /// The patch entry (and file).
    pub patch: String,
    /// The upstream commit the patch was applied onto.
    pub upstream_commit: String,
    /// How that commit was chosen ("the tip of `main`", "the pinned commit", ...).
    pub upstream: String,
    /// The commit inside the patch file that failed: `2/3 "Subject"`.
    pub failing_commit: Option<String>,
    /// The files that failed, with their failed hunks.
    pub files: Vec<FileFailure>,
    /// What `git am` said.
    pub git_message: String,
    /// Earlier patches of the series found already upstream (when merges are being detected):
    /// they would be dropped, were it not for this conflict.
    pub merged_earlier: Vec<String>,
}

/// One file of a conflicting patch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileFailure {
    /// The file's path in the source.
    pub path: String,
    /// Hunks that failed, as `#N @@ -a,b +c,d @@`.
    pub hunks: Vec<String>,
    /// A file-level problem ("does not exist upstream"), if any.
    pub problem: Option<String>,
}

impl fmt::Display for FileFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path)?;
        let mut parts: Vec<String> = self.problem.iter().cloned().collect();
        parts.extend(self.hunks.iter().map(|h| format!("hunk {h} failed")));
        if !parts.is_empty() {
            write!(f, ": {}", parts.join(", "))?;
        }
        Ok(())
    }
}

impl fmt::Display for Conflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "patch {} of source `{}` does not apply to upstream commit {} ({})",
            self.patch, self.source, self.upstream_commit, self.upstream
        )?;
        if let Some(c) = &self.failing_commit {
            write!(f, "; failing commit {c}")?;
        }
        if self.files.is_empty() {
            write!(f, "; git: {}", self.git_message)
        } else {
            let files: Vec<String> = self.files.iter().map(ToString::to_string).collect();
            write!(f, "; {}", files.join("; "))
        }
    }
}

impl std::error::Error for Conflict {}

impl Conflict {
    /// A multi-line report for people (stderr), one fact per line.
    pub fn report(&self) -> String {
        let mut out = format!("conflict in source `{}`:\n", self.source);
        out.push_str(&format!("  patch:    {}\n", self.patch));
        out.push_str(&format!("  upstream: {} ({})\n", self.upstream_commit, self.upstream));
        if let Some(c) = &self.failing_commit {
            out.push_str(&format!("  commit:   {c}\n"));
        }
        for (i, file) in self.files.iter().enumerate() {
            out.push_str(if i == 0 { "  failed:   " } else { "            " });
            out.push_str(&format!("{file}\n"));
        }
        out.push_str(&format!("  git:      {}\n", self.git_message));
        for m in &self.merged_earlier {
            out.push_str(&format!("  merged:   {m} is already upstream (would be dropped)\n"));
        }
        out
    }
}

/// Applies `patches` in order onto `base` in `repo` with `git am --3way`. Returns the result, or
/// the first patch that does not apply as a [`Conflict`] (the repository is left clean).
pub fn apply_series(
    cache: &Cache,
    repo: &Repo,
    source: &str,
    base: &Base,
    patches: &[PatchFile],
    options: Options<'_>,
) -> Result<std::result::Result<Applied, Conflict>> {
    repo.checkout_clean(&base.commit)?;
    let scratch = cache.scratch()?;
    let mut outcomes = Vec::new();
    let mut effects = Vec::new();
    for (i, patch) in patches.iter().enumerate() {
        let before = repo.git.rev_parse("HEAD")?;
        if let Some(Some(effect)) = options.merged_if.and_then(|m| m.get(i))
            && !effect.is_empty()
        {
            let path = scratch.path().join(format!("effect-{i}.diff"));
            fs::write(&path, effect)?;
            let reverse = repo.git.output([
                "apply",
                "--reverse",
                "--check",
                "--binary",
                path.to_str().context("non-UTF-8 cache path")?,
            ])?;
            if reverse.status.success() {
                outcomes.push(Outcome::Merged);
                effects.push(None);
                continue;
            }
        }
        let path = scratch.path().join(format!("{i}.patch"));
        fs::write(&path, &patch.bytes)?;
        let path_str = path.to_str().context("non-UTF-8 cache path")?;
        let out = repo.git.output(["am", "--3way", "--keep-cr", "--quiet", "--no-gpg-sign", path_str])?;
        if !out.status.success() {
            let conflict = diagnose(repo, source, base, patch, &scratch, &stderr_summary(&out));
            let _ = repo.git.output(["am", "--abort"]);
            repo.checkout_clean(&before)?;
            let mut conflict = conflict?;
            if options.merged_if.is_some() {
                conflict.merged_earlier = patches
                    .iter()
                    .zip(&outcomes)
                    .filter(|(_, o)| **o != Outcome::Applied)
                    .map(|(p, _)| p.label())
                    .collect();
            }
            return Ok(Err(conflict));
        }
        let after = repo.git.rev_parse("HEAD")?;
        if after == before {
            outcomes.push(Outcome::NoChange);
            effects.push(None);
            continue;
        }
        outcomes.push(Outcome::Applied);
        effects.push(if options.record_effects {
            Some(repo.git.run_bytes(["diff", "--full-index", "--binary", "--no-color", &before, &after])?)
        } else {
            None
        });
    }
    let head = repo.git.rev_parse("HEAD")?;
    let tree = repo.git.rev_parse("HEAD^{tree}")?;
    Ok(Ok(Applied { head, tree, outcomes, effects }))
}

/// Works out what failed while `git am` is stopped on a patch: the failing commit, the files
/// in conflict, and (by applying each file of the failing commit alone with `--reject`) the
/// hunks that do not apply.
fn diagnose(
    repo: &Repo,
    source: &str,
    base: &Base,
    patch: &PatchFile,
    scratch: &tempfile::TempDir,
    git_message: &str,
) -> Result<Conflict> {
    let state = repo.git_dir().join("rebase-apply");
    let read = |name: &str| fs::read_to_string(state.join(name)).unwrap_or_default();
    let subject = read("info").lines().find_map(|l| l.strip_prefix("Subject: ").map(str::to_owned));
    let (next, last) = (read("next").trim().to_owned(), read("last").trim().to_owned());
    let failing_commit = match (subject, next.is_empty()) {
        (Some(s), false) => Some(format!("{next}/{last} \"{s}\"")),
        (Some(s), true) => Some(format!("\"{s}\"")),
        (None, _) => None,
    };
    let conflicted: Vec<String> = repo
        .git
        .run(["diff", "--name-only", "--diff-filter=U"])
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect();
    let failing = fs::read(state.join("patch")).unwrap_or_default();
    let failing_path = scratch.path().join("failing.diff");
    fs::write(&failing_path, &failing)?;
    let failing_str = failing_path.to_str().context("non-UTF-8 cache path")?;

    let mut files = Vec::new();
    for file in parse_hunks(&String::from_utf8_lossy(&failing)) {
        repo.git.run(["reset", "--quiet", "--hard"])?;
        repo.git.run(["clean", "-ffdxq"])?;
        let out =
            repo.git.output(["apply", "--reject", "--verbose", &format!("--include={}", file.path), failing_str])?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        let mut failure = parse_reject_output(&stderr, &file.path, &file.hunks);
        if conflicted.contains(&file.path) && failure.problem.is_none() {
            failure.problem = Some("3-way merge conflict".into());
        }
        if !out.status.success() || failure.problem.is_some() || !failure.hunks.is_empty() {
            files.push(failure);
        }
    }
    repo.git.run(["reset", "--quiet", "--hard"])?;
    repo.git.run(["clean", "-ffdxq"])?;
    Ok(Conflict {
        source: source.to_owned(),
        patch: patch.label(),
        upstream_commit: base.commit.clone(),
        upstream: base.label.clone(),
        failing_commit,
        files,
        git_message: git_message.to_owned(),
        merged_earlier: Vec::new(),
    })
}

/// Reads `git apply --reject --verbose` output (C locale) for one file: its rejected hunks
/// (named with their headers from `hunks`) and any file-level error.
fn parse_reject_output(stderr: &str, path: &str, hunks: &[String]) -> FileFailure {
    let mut failure = FileFailure { path: path.to_owned(), hunks: Vec::new(), problem: None };
    for line in stderr.lines() {
        if let Some(rest) = line.strip_prefix("Rejected hunk #") {
            let n: usize = rest.trim_end_matches('.').parse().unwrap_or(0);
            let header = n.checked_sub(1).and_then(|i| hunks.get(i));
            failure.hunks.push(match header {
                Some(h) => format!("#{n} {h}"),
                None => format!("#{n}"),
            });
        } else if let Some(rest) = line.strip_prefix("error: ") {
            let Some(what) = rest.strip_prefix(path).and_then(|r| r.strip_prefix(": ")) else {
                continue;
            };
            let problem = if what.contains("does not exist") || what.contains("No such file") {
                "does not exist upstream".to_owned()
            } else if what.contains("already exists") {
                "already exists upstream".to_owned()
            } else {
                what.to_owned()
            };
            failure.problem.get_or_insert(problem);
        }
    }
    failure
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejected_hunks_are_named_with_their_headers() {
        let stderr = "Checking patch src/a.rs...\nerror: while searching for:\nold\nerror: patch failed: src/a.rs:10\nApplying patch src/a.rs with 1 reject...\nHunk #1 applied cleanly.\nRejected hunk #2.\n";
        let hunks = vec!["@@ -1,3 +1,3 @@".to_owned(), "@@ -10,3 +10,3 @@ fn f()".to_owned()];
        let f = parse_reject_output(stderr, "src/a.rs", &hunks);
        assert_eq!(f.hunks, vec!["#2 @@ -10,3 +10,3 @@ fn f()"]);
        assert_eq!(f.problem, None);
        assert_eq!(f.to_string(), "src/a.rs: hunk #2 @@ -10,3 +10,3 @@ fn f() failed");
    }

    #[test]
    fn missing_files_are_a_file_level_problem() {
        let f = parse_reject_output("Checking patch b.txt...\nerror: b.txt: No such file or directory\n", "b.txt", &[]);
        assert_eq!(f.problem.as_deref(), Some("does not exist upstream"));
        assert_eq!(f.to_string(), "b.txt: does not exist upstream");
    }

    #[test]
    fn conflict_summary_is_one_line_and_names_everything() {
        let c = Conflict {
            source: "foo".into(),
            patch: "patches/foo/0002-b.patch".into(),
            upstream_commit: "a".repeat(40),
            upstream: "the tip of `main`".into(),
            failing_commit: Some("1/1 \"Change b\"".into()),
            files: vec![FileFailure { path: "b.txt".into(), hunks: vec!["#1 @@ -1 +1 @@".into()], problem: None }],
            git_message: "Patch failed at 0001 Change b".into(),
            merged_earlier: vec!["patches/foo/0001-a.patch".into()],
        };
        let line = c.to_string();
        assert!(!line.contains('\n'));
        for needle in ["patches/foo/0002-b.patch", &"a".repeat(40), "b.txt", "hunk #1 @@ -1 +1 @@", "Change b"] {
            assert!(line.contains(needle), "{line} lacks {needle}");
        }
        assert!(c.report().contains("  failed:   b.txt: hunk #1"));
        assert!(c.report().contains("  merged:   patches/foo/0001-a.patch is already upstream"));
    }
}
