//! Helpers shared by the integration tests: running the real `engine` binary, scratch
//! directories, the fixtures, and the optional Python tools some tests read results with.

#![allow(dead_code)] // each test binary uses a part

pub mod svg;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A command running the engine binary, with the user's override variables and the test hooks
/// removed.
pub fn engine_cmd(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_engine"));
    cmd.args(args).env_remove("ENGINE_FLAGS").env_remove("ENGINE_DEFAULT_FLAGS").env_remove("ENGINE_TEST_PAUSE_SAVE");
    cmd.env_remove("ENGINE_TEST_EMULATOR_FAULT").env_remove("ENGINE_TEST_CURVE_OVERRIDES");
    cmd.env_remove("ENGINE_TEST_PANIC_READER").env_remove("ENGINE_LAUNCH_ERROR_FD");
    cmd
}

/// Runs the engine binary.
pub fn engine(args: &[&str]) -> Output {
    engine_cmd(args).output().expect("engine runs")
}

/// Runs `engine data prepare` on the bundled Shakespeare text with the byte-level BPE fixture,
/// into `out`, with `extra` flags.
pub fn prepare_shakespeare(out: &Path, extra: &[&str]) -> Output {
    let tokenizer = fixture("tokenizers/bytelevel-bpe.json");
    let text = concat!(env!("CARGO_MANIFEST_DIR"), "/data/shakespeare.txt");
    let mut args = vec!["data", "prepare", "--tokenizer", s(&tokenizer), "--input", text, "--out", s(out)];
    args.extend_from_slice(extra);
    engine(&args)
}

/// Runs the engine binary and insists that it succeeds; returns its stdout.
pub fn ok(args: &[&str]) -> String {
    let out = engine(args);
    assert!(out.status.success(), "engine {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Runs the engine binary, expecting bad input: exit code 2 and one line on stderr holding
/// `expected`, no panic. Returns the line.
pub fn fails(args: &[&str], expected: &str) -> String {
    let out = engine(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(expected), "{args:?}: expected `{expected}` in: {stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("internal error"), "{args:?}: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: more than one line: {stderr}");
    stderr
}

/// Copies the directory `from` to `to`, recursively.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("engine-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A scratch directory, removed when the test passes and kept to look at when it fails: the
/// checkpoints some tests write reach gigabytes, and a suite that left them behind filled CI's
/// disk.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// `tests/fixtures/...` of the repository.
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(rel)
}

/// A path as a `&str` argument.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The JSON records of a run's metrics.jsonl.
pub fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A Python interpreter that can `import module`: `$var` if set, else `python3`. None when there
/// is none, unless `ci_installs` and `ENGINE_TEST_REQUIRE_PYTHON=1` (set by tests/run.sh, which
/// installs those tools): then a missing tool fails the test instead of skipping it.
pub fn python_with(var: &str, module: &str, ci_installs: bool) -> Option<String> {
    let python = std::env::var(var).unwrap_or_else(|_| "python3".into());
    let works = Command::new(&python)
        .args(["-c", &format!("import {module}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if works {
        return Some(python);
    }
    if ci_installs && std::env::var("ENGINE_TEST_REQUIRE_PYTHON").is_ok_and(|v| v == "1") {
        panic!("{python} cannot import {module} and ENGINE_TEST_REQUIRE_PYTHON=1 (tests/run.sh installs it)");
    }
    eprintln!("skipped: no Python with `{module}` ({var} unset or `{python}` lacks it)");
    None
}

/// The tiny recipe made cheaper, as the virtual devices' tests make it: what crosses processes
/// is the same at any width, and the full width's checkpoints took 448 MB each.
pub const SHRINK: [&str; 8] = [
    "model.vocab_size=512",
    "model.d_model=64",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.head_dim=32",
    "model.mlp_dim=128",
    "train.seq_len=32",
    "optim.warmup_steps=2",
];

/// A model small enough for a step to take milliseconds, on the embedded corpus, as `--set`
/// arguments.
pub const SMALL: [&str; 16] = [
    "--set",
    "model.vocab_size=256",
    "--set",
    "model.d_model=32",
    "--set",
    "model.mlp_dim=48",
    "--set",
    "model.n_heads=2",
    "--set",
    "model.n_kv_heads=1",
    "--set",
    "model.head_dim=16",
    "--set",
    "train.seq_len=32",
    "--set",
    "train.batch_size=2",
];
