//! Fixtures for the integration tests: upstream git repositories, projects with a manifest, a
//! local Cargo registry, and a runner for the real `distro` binary.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs git for fixtures with a fixed identity and no user configuration.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .current_dir(dir)
        .args(args)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_AUTHOR_NAME", "Up Stream")
        .env("GIT_AUTHOR_EMAIL", "up@example.invalid")
        .env("GIT_AUTHOR_DATE", "1700000000 +0000")
        .env("GIT_COMMITTER_NAME", "Up Stream")
        .env("GIT_COMMITTER_EMAIL", "up@example.invalid")
        .env("GIT_COMMITTER_DATE", "1700000000 +0000")
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git {args:?} in {} failed: {}", dir.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim_end().to_owned()
}

/// `n` numbered lines.
pub fn lines(n: usize) -> String {
    (1..=n).map(|i| format!("line {i}\n")).collect()
}

/// `text` with line `n` (from 1) replaced by `new`.
pub fn set_line(text: &str, n: usize, new: &str) -> String {
    text.lines().enumerate().map(|(i, l)| if i + 1 == n { format!("{new}\n") } else { format!("{l}\n") }).collect()
}

/// An upstream git repository with a working tree.
pub struct Upstream {
    pub dir: PathBuf,
}

impl Upstream {
    /// A new repository on branch `main` with `lib.txt` (20 lines) committed.
    pub fn new(dir: PathBuf) -> Upstream {
        fs::create_dir_all(&dir).unwrap();
        git(&dir, &["init", "-q", "-b", "main"]);
        let up = Upstream { dir };
        up.write("lib.txt", &lines(20));
        up.commit("Initial import");
        up
    }

    pub fn git(&self, args: &[&str]) -> String {
        git(&self.dir, args)
    }

    pub fn write(&self, file: &str, content: &str) {
        let p = self.dir.join(file);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, content).unwrap();
    }

    pub fn read(&self, file: &str) -> String {
        fs::read_to_string(self.dir.join(file)).unwrap()
    }

    /// Commits everything; returns the commit id.
    pub fn commit(&self, message: &str) -> String {
        self.git(&["add", "-A"]);
        self.git(&["commit", "-q", "-m", message]);
        self.head()
    }

    pub fn head(&self) -> String {
        self.git(&["rev-parse", "HEAD"])
    }

    /// Sets line `n` of `lib.txt` to `new` on the current branch and commits.
    pub fn change_line(&self, n: usize, new: &str, message: &str) -> String {
        let text = set_line(&self.read("lib.txt"), n, new);
        self.write("lib.txt", &text);
        self.commit(message)
    }

    /// A `git format-patch` mbox of one commit on top of `base` that sets line `n` of `lib.txt`.
    pub fn patch_setting_line(&self, base: &str, n: usize, new: &str, subject: &str) -> Vec<u8> {
        self.git(&["checkout", "-q", "-b", "patch-work", base]);
        self.change_line(n, new, subject);
        let mbox = self.git(&["format-patch", "-1", "--stdout", "--full-index", "HEAD"]);
        self.git(&["checkout", "-q", "main"]);
        self.git(&["branch", "-q", "-D", "patch-work"]);
        format!("{mbox}\n").into_bytes()
    }

    /// The path as a manifest URL.
    pub fn url(&self) -> String {
        self.dir.to_str().unwrap().to_owned()
    }
}

/// A project: `images/manifest.toml` and `patches/` under `root`.
pub struct Project {
    pub root: PathBuf,
}

impl Project {
    pub fn new(root: PathBuf) -> Project {
        fs::create_dir_all(root.join("images")).unwrap();
        Project { root }
    }

    pub fn manifest_path(&self) -> PathBuf {
        self.root.join("images/manifest.toml")
    }

    pub fn lock_path(&self) -> PathBuf {
        self.root.join("images/manifest.lock")
    }

    pub fn write_manifest(&self, text: &str) {
        fs::write(self.manifest_path(), text).unwrap();
    }

    pub fn manifest(&self) -> String {
        fs::read_to_string(self.manifest_path()).unwrap()
    }

    pub fn lock(&self) -> String {
        fs::read_to_string(self.lock_path()).unwrap()
    }

    pub fn write_file(&self, rel: &str, bytes: &[u8]) {
        let p = self.root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, bytes).unwrap();
    }
}

/// What a `distro` run printed and how it ended.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Panics with the output unless the run succeeded.
    pub fn ok(self) -> Run {
        assert_eq!(self.code, 0, "distro failed:\nstdout: {}\nstderr: {}", self.stdout, self.stderr);
        self
    }

    /// The last stderr line, which must be the single `error: ` line.
    pub fn error_line(&self) -> &str {
        let last = self.stderr.lines().last().unwrap_or("");
        assert!(last.starts_with("error: "), "no error line in stderr: {}", self.stderr);
        assert!(!self.stderr.contains("panicked"), "{}", self.stderr);
        last
    }
}

/// A machine for `distro`: its own HOME and cache directory (and extra environment).
pub struct Machine {
    pub home: PathBuf,
    pub cache: PathBuf,
    pub env: Vec<(String, String)>,
}

impl Machine {
    pub fn new(dir: &Path) -> Machine {
        fs::create_dir_all(dir.join("home")).unwrap();
        Machine { home: dir.join("home"), cache: dir.join("cache"), env: Vec::new() }
    }

    pub fn with_env(mut self, key: &str, value: &str) -> Machine {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Runs `distro ARGS` in `cwd`.
    pub fn run(&self, cwd: &Path, args: &[&str]) -> Run {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_distro"));
        cmd.current_dir(cwd)
            .args(args)
            .env("HOME", &self.home)
            .env("DISTRO_CACHE_DIR", &self.cache)
            .env("DISTRO_NET_BACKOFF_MS", "10")
            .env_remove("XDG_CACHE_HOME")
            .env_remove("RUST_BACKTRACE");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("distro runs");
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

/// The git manifest table of a source.
pub fn git_source(name: &str, url: &str, commit: &str, patches: &[&str]) -> String {
    let list: Vec<String> = patches.iter().map(|p| format!("\"{p}\"")).collect();
    format!(
        "[sources.{name}]\nurl = \"{url}\"\ntracking_ref = \"main\"\ncommit = \"{commit}\"\npatches = [{}]\n",
        list.join(", ")
    )
}
