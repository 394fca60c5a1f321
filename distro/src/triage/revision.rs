//! The project at the failing image's own revision: rebuilds use that revision's image
//! definition, patches, lock and workspace, not whatever the checkout's `HEAD` has become.
use crate::git::{Git, is_object_id};
use crate::image::workspace::Workspace;
use anyhow::{Result, bail};
use std::path::{Path, PathBuf};

/// The commit an image's `org.opencontainers.image.revision` names, and whether the image was
/// built from a tree that differed from it (`-dirty`).
pub(super) fn commit_of(revision: &str) -> Option<(&str, bool)> {
    let (commit, dirty) = match revision.strip_suffix("-dirty") {
        Some(c) => (c, true),
        None => (revision, false),
    };
    is_object_id(commit).then_some((commit, dirty))
}

/// A checkout of `commit` under `work/revisions/`, cloned from the user's checkout with
/// `--shared` (it borrows the checkout's objects; the user's repository is not changed), reused
/// when a previous triage left it at that commit. `image` names the image, for messages.
pub(super) fn checkout(ws: &Workspace, work: &Path, commit: &str, image: &str) -> Result<PathBuf> {
    if !Git::checkout(&ws.root).has_commit(commit) {
        bail!(
            "{image} was built at revision {commit}, which the checkout {} does not have: fetch it (git fetch origin {commit}) and run triage again",
            ws.root.display()
        );
    }
    let dir = work.join("revisions").join(commit);
    let git = Git::new(&dir);
    let clean = |g: &Git| {
        g.rev_parse("HEAD").is_ok_and(|h| h == commit)
            && g.run(["status", "--porcelain", "--untracked-files=no"]).is_ok_and(|s| s.is_empty())
    };
    if dir.join(".git").exists() && clean(&git) {
        return Ok(dir);
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(dir.parent().expect("under work/revisions"))?;
    Git::new(work).run([
        "clone".as_ref(),
        "-q".as_ref(),
        "--shared".as_ref(),
        "--no-checkout".as_ref(),
        ws.root.as_os_str(),
        dir.as_os_str(),
    ])?;
    git.run(["checkout", "-q", "--detach", commit])?;
    if !clean(&git) {
        bail!("the checkout of {commit} in {} is not at that commit", dir.display());
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_revision_names_a_commit() {
        let c = "0123456789abcdef0123456789abcdef01234567";
        assert_eq!(commit_of(c), Some((c, false)));
        assert_eq!(commit_of(&format!("{c}-dirty")), Some((c, true)));
        assert_eq!(commit_of("unknown"), None);
        assert_eq!(commit_of(""), None);
    }

    #[test]
    fn a_checkout_at_the_images_revision_not_head() {
        let tmp = std::env::temp_dir().join(format!("distro-triage-rev-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let repo = tmp.join("project");
        std::fs::create_dir_all(&repo).unwrap();
        let g = Git::new(&repo);
        g.run(["init", "-q", "-b", "main"]).unwrap();
        let commit = |text: &str| {
            std::fs::write(repo.join("def.toml"), text).unwrap();
            g.run(["add", "-A"]).unwrap();
            g.run_env(
                ["commit", "-q", "-m", text],
                &[
                    ("GIT_AUTHOR_NAME", "t".as_ref()),
                    ("GIT_AUTHOR_EMAIL", "t@t.invalid".as_ref()),
                    ("GIT_COMMITTER_NAME", "t".as_ref()),
                    ("GIT_COMMITTER_EMAIL", "t@t.invalid".as_ref()),
                ],
            )
            .unwrap();
            g.rev_parse("HEAD").unwrap()
        };
        let old = commit("at the image's revision");
        commit("HEAD moved on");
        let ws = Workspace::open(&repo).unwrap();
        let work = tmp.join("work");
        let dir = checkout(&ws, &work, &old, "probe-2026-03-05").unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("def.toml")).unwrap(), "at the image's revision");
        assert_eq!(Workspace::open(&dir).unwrap().revision(), old);
        // Reused as it is; a missing commit is one line naming it.
        assert_eq!(checkout(&ws, &work, &old, "x").unwrap(), dir);
        let missing = "1".repeat(40);
        let e = checkout(&ws, &work, &missing, "probe-2026-03-05").unwrap_err().to_string();
        assert!(e.contains(&format!("revision {missing}, which the checkout")), "{e}");
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
