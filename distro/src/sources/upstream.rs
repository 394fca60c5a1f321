//! Talking to upstream git repositories: fetching refs and pinned commits (with retries), and
//! exporting upstream refs such as `pull/123/head` as patch files.

use anyhow::{Context, Result};

use super::cache::Repo;
use crate::error::bad_input;
use crate::git::is_object_id;
use crate::hex::sha256_hex;
use crate::retry;

/// The cache repository key for a git URL (as git will fetch it): readable and unique.
pub fn repo_key(fetch_url: &str) -> String {
    let tail = fetch_url.trim_end_matches('/').rsplit(['/', ':']).next().unwrap_or("repo").trim_end_matches(".git");
    let tail: String = tail
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
        .take(40)
        .collect();
    format!("git-{tail}-{}", &sha256_hex(fetch_url.as_bytes())[..16])
}

/// Where a fetched upstream ref is kept in the cache repository.
fn local_ref(git_ref: &str) -> String {
    format!("refs/distro/upstream/{}", git_ref.strip_prefix("refs/").unwrap_or(git_ref))
}

fn is_permanent(stderr: &str) -> bool {
    const PERMANENT: &[&str] = &[
        "couldn't find remote ref",
        "not our ref",
        "does not appear to be a git repository",
        "repository not found",
        "no such file or directory",
        "invalid refspec",
        "is not a valid",
        "unadvertised object",
    ];
    let lower = stderr.to_ascii_lowercase();
    PERMANENT.iter().any(|p| lower.contains(p))
}

/// Runs `git fetch URL REFSPEC` in `repo` with retries; permanent failures fail at once.
fn fetch(repo: &Repo, url: &str, refspec: &str, what: &str) -> Result<()> {
    retry::retry(retry::Policy::from_env(), what, || {
        let mut cmd = repo.git.network_command([
            "fetch",
            "--quiet",
            "--no-tags",
            "--no-write-fetch-head",
            "--no-recurse-submodules",
            "--end-of-options",
            url,
            refspec,
        ]);
        retry::command_attempt(&mut cmd, is_permanent)
    })
}

/// Fetches `git_ref` (a branch, tag, `pull/N/head`, any ref, or a full commit id) from `url`
/// and returns the commit it points to.
pub fn fetch_ref(repo: &Repo, url: &str, git_ref: &str) -> Result<String> {
    eprintln!("distro: fetching {git_ref} from {url}");
    if is_object_id(git_ref) {
        if !repo.git.has_commit(git_ref) {
            fetch(repo, url, git_ref, &format!("fetching commit {git_ref} from {url}"))?;
        }
        keep(repo, git_ref)?;
        return Ok(git_ref.to_owned());
    }
    let local = local_ref(git_ref);
    fetch(repo, url, &format!("+{git_ref}:{local}"), &format!("fetching {git_ref} from {url}")).map_err(|e| {
        if e.to_string().contains("couldn't find remote ref") {
            bad_input(format!(
                "{url} has no ref `{git_ref}`: check the name (a branch such as `main`, a tag, or `pull/123/head`)"
            ))
        } else {
            e
        }
    })?;
    repo.git
        .rev_parse(&format!("{local}^{{commit}}"))
        .with_context(|| format!("{git_ref} at {url} does not point to a commit"))
}

/// Makes sure `commit` is in the cache repository: fetches `tracking_ref` first (the usual
/// place for a pin), then asks the server for the commit by id. A commit upstream does not
/// have is a one-line error naming it.
pub fn ensure_commit(repo: &Repo, url: &str, tracking_ref: &str, commit: &str) -> Result<()> {
    if !repo.git.has_commit(commit) {
        fetch_ref(repo, url, tracking_ref)?;
    }
    if !repo.git.has_commit(commit) {
        // Servers that allow it (GitHub does) serve any commit by id; others refuse, which is
        // fine: the commit is then missing upstream as far as we can tell.
        let _ = fetch(repo, url, commit, &format!("fetching commit {commit} from {url}"));
    }
    if !repo.git.has_commit(commit) {
        return Err(bad_input(format!(
            "commit {commit} does not exist at {url} (it is not reachable from `{tracking_ref}` and the server does not serve it by id); fix `commit` in the manifest or run `distro bump`"
        )));
    }
    keep(repo, commit)
}

/// Keeps `commit` reachable from a ref, so no garbage collection can drop a pin.
fn keep(repo: &Repo, commit: &str) -> Result<()> {
    repo.git.run(["update-ref", &format!("refs/distro/pins/{commit}"), commit])?;
    Ok(())
}

/// Exports the commits of upstream ref `git_ref` that are not on `tracking_ref` (nor already
/// there as equivalent patches) as one mbox, the way `git format-patch` writes it, with full
/// blob ids so `git am --3way` can fall back to a merge. `None` when there are no such commits
/// (the ref was merged upstream).
pub fn export_ref(repo: &Repo, url: &str, tracking_ref: &str, git_ref: &str) -> Result<Option<Vec<u8>>> {
    let tip = fetch_ref(repo, url, tracking_ref)?;
    let head = fetch_ref(repo, url, git_ref)?;
    let mbox = repo.git.run_bytes([
        "format-patch",
        "--stdout",
        "--full-index",
        "--binary",
        "--no-signature",
        "--stat=72",
        "--encoding=UTF-8",
        "--ignore-if-in-upstream",
        &format!("{tip}..{head}"),
    ])?;
    Ok((!mbox.is_empty()).then_some(mbox))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_keys_are_readable_and_distinct() {
        let a = repo_key("https://example.invalid/owner/cudarc.git");
        assert!(a.starts_with("git-cudarc-"), "{a}");
        assert_ne!(a, repo_key("https://example.invalid/fork/cudarc.git"));
        assert!(repo_key("git@host:owner/x y.git").starts_with("git-x_y-"));
    }

    #[test]
    fn refs_are_kept_under_a_distro_namespace() {
        assert_eq!(local_ref("main"), "refs/distro/upstream/main");
        assert_eq!(local_ref("pull/12/head"), "refs/distro/upstream/pull/12/head");
        assert_eq!(local_ref("refs/heads/x"), "refs/distro/upstream/heads/x");
    }

    #[test]
    fn missing_refs_and_repositories_are_permanent() {
        assert!(is_permanent("fatal: couldn't find remote ref refs/heads/nope"));
        assert!(is_permanent("fatal: '/x' does not appear to be a git repository"));
        assert!(!is_permanent("fatal: unable to access 'https://h/': Could not resolve host: h"));
        assert!(!is_permanent("fatal: unable to connect to 127.0.0.1: Connection refused"));
    }
}
