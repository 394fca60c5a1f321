//! Materialised source trees: checking a git tree out into the content-addressed store, and
//! hashing a directory back into a tree id to verify it.

use anyhow::{Context, Result, bail};
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};

use super::cache::{Cache, Repo};
use crate::fsutil::remove_all;
use crate::git::Git;

/// Fails when `tree` contains submodules: distro materialises plain files only, so such a tree
/// could never be verified. Names the first submodule path.
pub fn check_no_submodules(repo: &Repo, tree: &str, source: &str) -> Result<()> {
    let listing = repo.git.run_bytes(["ls-tree", "-r", "-z", tree])?;
    for entry in listing.split(|b| *b == 0) {
        if entry.starts_with(b"160000 ") {
            let text = String::from_utf8_lossy(entry);
            let path = text.split_once('\t').map(|(_, p)| p).unwrap_or(&text);
            bail!(
                "source `{source}` contains a git submodule at `{path}`, which distro does not fetch; pin the submodule's repository as its own source instead"
            );
        }
    }
    Ok(())
}

/// The git tree id of the files under `dir` (as `git add --all --force` would record them),
/// computed with a temporary index in `repo`.
pub fn hash_dir(repo: &Repo, dir: &Path, scratch: &Path) -> Result<String> {
    let index = scratch.join("hash.index");
    let _ = fs::remove_file(&index);
    let git_dir = format!("--git-dir={}", repo.git_dir().display());
    let env: [(&str, &OsStr); 1] = [("GIT_INDEX_FILE", index.as_os_str())];
    let g = Git::new(dir);
    g.run_env([git_dir.as_str(), "--work-tree=.", "add", "--all", "--force", "--", "."], &env)?;
    g.run_env([git_dir.as_str(), "write-tree"], &env)
}

/// Makes sure `cache/trees/<tree>` holds exactly the files of git tree `tree`: an existing one
/// is verified (and rebuilt if it was modified), a missing one is checked out from `repo`
/// into a scratch directory and moved into place atomically.
pub fn materialise_tree(cache: &Cache, repo: &Repo, tree: &str) -> Result<PathBuf> {
    let dest = cache.tree_dir(tree);
    let scratch = cache.scratch()?;
    if dest.is_dir() {
        if hash_dir(repo, &dest, scratch.path())? == tree {
            return Ok(dest);
        }
        eprintln!("distro: warning: {} was modified in the cache; checking it out again", dest.display());
        remove_all(&dest)?;
    }
    let staging = scratch.path().join("tree");
    fs::create_dir(&staging)?;
    checkout_tree(repo, tree, &staging, scratch.path())?;
    if let Some(parent) = dest.parent() {
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    if let Err(e) = fs::rename(&staging, &dest) {
        // Another process may have put the same tree in place first; that is as good.
        if !dest.is_dir() {
            return Err(e).with_context(|| format!("moving the tree into {}", dest.display()));
        }
    }
    Ok(dest)
}

/// Writes the files of git tree `tree` into the existing empty directory `dir`.
pub fn checkout_tree(repo: &Repo, tree: &str, dir: &Path, scratch: &Path) -> Result<()> {
    let index = scratch.join("checkout.index");
    let _ = fs::remove_file(&index);
    let git_dir = format!("--git-dir={}", repo.git_dir().display());
    let env: [(&str, &OsStr); 1] = [("GIT_INDEX_FILE", index.as_os_str())];
    let g = Git::new(dir);
    g.run_env([git_dir.as_str(), "--work-tree=.", "read-tree", tree], &env)?;
    g.run_env([git_dir.as_str(), "--work-tree=.", "checkout-index", "--all", "--force"], &env)?;
    let _ = fs::remove_file(&index);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn repo_with_files(cache: &Cache) -> (Repo, String) {
        let repo = cache.open_repo("t").unwrap();
        let d = repo.dir();
        fs::create_dir_all(d.join("bin")).unwrap();
        fs::write(d.join("bin/run.sh"), "#!/bin/sh\n").unwrap();
        fs::set_permissions(d.join("bin/run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::write(d.join("crlf.txt"), "a\r\nb\r\n").unwrap();
        std::os::unix::fs::symlink("bin/run.sh", d.join("run")).unwrap();
        repo.git.run(["add", "-A"]).unwrap();
        repo.git.run(["commit", "-q", "-m", "x"]).unwrap();
        let tree = repo.git.rev_parse("HEAD^{tree}").unwrap();
        (repo, tree)
    }

    #[test]
    fn materialised_trees_hash_back_to_their_id_and_are_repaired() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path());
        let (repo, tree) = repo_with_files(&cache);
        let out = materialise_tree(&cache, &repo, &tree).unwrap();
        assert_eq!(out, cache.tree_dir(&tree));
        assert_eq!(fs::read(out.join("crlf.txt")).unwrap(), b"a\r\nb\r\n");
        assert!(fs::symlink_metadata(out.join("run")).unwrap().is_symlink());
        let scratch = cache.scratch().unwrap();
        assert_eq!(hash_dir(&repo, &out, scratch.path()).unwrap(), tree);
        // A modified copy no longer hashes to the id, and is checked out again.
        fs::set_permissions(out.join("bin/run.sh"), fs::Permissions::from_mode(0o644)).unwrap();
        assert_ne!(hash_dir(&repo, &out, scratch.path()).unwrap(), tree);
        materialise_tree(&cache, &repo, &tree).unwrap();
        assert_eq!(hash_dir(&repo, &out, scratch.path()).unwrap(), tree);
    }

    #[test]
    fn submodules_are_refused_by_path() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path());
        let (repo, _) = repo_with_files(&cache);
        let head = repo.git.rev_parse("HEAD").unwrap();
        repo.git.run(["update-index", "--add", "--cacheinfo", &format!("160000,{head},third_party/sub")]).unwrap();
        let tree = repo.git.run(["write-tree"]).unwrap();
        let err = check_no_submodules(&repo, &tree, "foo").unwrap_err().to_string();
        assert!(err.contains("git submodule at `third_party/sub`"), "{err}");
    }
}
