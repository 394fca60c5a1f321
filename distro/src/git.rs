//! The one `git` runner of the crate: the `git` command line, run with a controlled environment.
//!
//! Three environments, one per kind of repository:
//! - *isolated* ([`Git::new`]), for repositories distro owns (the sources cache, triage's
//!   mirrors);
//! - *network* ([`Git::network_command`]), for fetches into those repositories;
//! - *checkout* ([`Git::checkout`]), for the user's own checkout of the project, read as the
//!   user's git reads it (their configuration and environment apply, nothing is overridden),
//!   so that "is the tree dirty" means what `git status` says.
//!
//! Everything that creates objects (commits after `git am`, crate imports, trees) runs *isolated*:
//! the user's global and system configuration, attributes and ignore files are not read, and
//! author/committer identity and dates are fixed, so the same inputs give the same commit ids on
//! any machine. Network commands (`fetch`, `ls-remote`) may read the user's configuration, so their
//! credential helpers, proxies and `insteadOf` rewrites work; what they fetch is verified by object
//! id, so that configuration cannot change results.

use crate::hex::is_lower_hex;
use anyhow::{Context, Result, bail};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// Name of the fixed identity used for every commit distro makes (committer of patched commits,
/// author and committer of crate imports).
pub const IDENTITY_NAME: &str = "distro";
/// E-mail of the fixed identity (the `.invalid` top-level domain is reserved: it never resolves).
pub const IDENTITY_EMAIL: &str = "distro@distro.invalid";
/// The fixed date of every commit distro makes: 2000-01-01T00:00:00Z, as git's raw date format.
pub const FIXED_DATE: &str = "946684800 +0000";

/// Settings passed with `-c` to every command, so that a repository's behaviour never depends on
/// configuration distro did not write (line endings, file modes, hooks, diff prefixes, ...).
const SETTINGS: &[&str] = &[
    "core.autocrlf=false",
    "core.eol=lf",
    "core.safecrlf=false",
    "core.fileMode=true",
    "core.symlinks=true",
    "core.ignoreCase=false",
    "core.precomposeUnicode=false",
    "core.quotePath=false",
    "core.attributesFile=/dev/null",
    "core.excludesFile=/dev/null",
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "core.abbrev=12",
    "gc.auto=0",
    "maintenance.auto=false",
    "commit.gpgSign=false",
    "apply.whitespace=nowarn",
    "am.threeWay=false",
    "am.keepCR=false",
    "am.messageId=false",
    "diff.algorithm=myers",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "diff.renames=true",
    "i18n.commitEncoding=UTF-8",
    "i18n.logOutputEncoding=UTF-8",
    "init.defaultBranch=distro",
    "advice.detachedHead=false",
    "merge.conflictStyle=merge",
    "rerere.enabled=false",
];

/// Environment variables a network command keeps from the user (authentication, proxies, TLS).
const NETWORK_ENV_KEPT: &[&str] = &[
    "GIT_ASKPASS",
    "GIT_SSH",
    "GIT_SSH_COMMAND",
    "GIT_SSH_VARIANT",
    "GIT_SSL_CAINFO",
    "GIT_SSL_CAPATH",
    "GIT_SSL_NO_VERIFY",
    "GIT_PROXY_COMMAND",
    "GIT_HTTP_USER_AGENT",
    "GIT_TRACE",
    "GIT_TRACE_CURL",
    "GIT_CURL_VERBOSE",
];

/// Which environment a [`Git`] runs its commands in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// A repository distro owns: fixed identity and settings, no user configuration.
    Isolated,
    /// The user's checkout: their configuration and environment, unchanged.
    Checkout,
}

/// A git repository (or a directory to run `git init` in), driven through the `git` CLI.
#[derive(Clone, Debug)]
pub struct Git {
    dir: PathBuf,
    mode: Mode,
}

impl Git {
    /// A handle on a repository distro owns, whose working tree (or bare directory) is `dir`;
    /// its commands run isolated.
    pub fn new(dir: impl Into<PathBuf>) -> Git {
        Git { dir: dir.into(), mode: Mode::Isolated }
    }

    /// A handle on the user's checkout containing `dir`; its commands run as the user's `git`
    /// would (only prompts are turned off and stdin is closed).
    pub fn checkout(dir: impl Into<PathBuf>) -> Git {
        Git { dir: dir.into(), mode: Mode::Checkout }
    }

    /// The working tree directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A `git` command in this repository, in its environment (isolated, or the checkout's).
    pub fn command<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.environment(false);
        cmd.args(args);
        cmd
    }

    /// A `git` command in this repository that may read the user's configuration (network use).
    pub fn network_command<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.environment(true);
        cmd.args(args);
        cmd
    }

    /// A bare `git` command in this repository's environment (`network`: a fetch).
    fn environment(&self, network: bool) -> Command {
        match self.mode {
            Mode::Isolated => self.base(network),
            Mode::Checkout => self.user(),
        }
    }

    fn user(&self) -> Command {
        let mut cmd = Command::new("git");
        // `-C` rather than a working directory: a missing directory is git's error, not a spawn's.
        cmd.arg("-C").arg(&self.dir).env("GIT_TERMINAL_PROMPT", "0").stdin(Stdio::null());
        cmd
    }

    fn base(&self, network: bool) -> Command {
        let mut cmd = Command::new("git");
        cmd.current_dir(&self.dir);
        for (key, _) in std::env::vars_os() {
            let Some(key) = key.to_str() else { continue };
            if key.starts_with("GIT_") && !(network && NETWORK_ENV_KEPT.contains(&key)) {
                cmd.env_remove(key);
            }
        }
        if !network {
            cmd.env("GIT_CONFIG_GLOBAL", "/dev/null")
                .env("GIT_CONFIG_NOSYSTEM", "1")
                .env("GIT_AUTHOR_NAME", IDENTITY_NAME)
                .env("GIT_AUTHOR_EMAIL", IDENTITY_EMAIL)
                .env("GIT_AUTHOR_DATE", FIXED_DATE)
                .env("GIT_COMMITTER_NAME", IDENTITY_NAME)
                .env("GIT_COMMITTER_EMAIL", IDENTITY_EMAIL)
                .env("GIT_COMMITTER_DATE", FIXED_DATE);
        }
        cmd.env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_EDITOR", "true")
            .env("GIT_PAGER", "cat")
            .env("GIT_ADVICE", "0")
            .env("LC_ALL", "C")
            .env("TZ", "UTC")
            .stdin(Stdio::null());
        for setting in SETTINGS {
            cmd.arg("-c").arg(setting);
        }
        cmd
    }

    /// Runs a command and returns its stdout without the trailing newline.
    pub fn run<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let out = self.run_bytes(args)?;
        let mut text = String::from_utf8(out).context("git printed something that is not UTF-8")?;
        while text.ends_with('\n') {
            text.pop();
        }
        Ok(text)
    }

    /// Runs a command and returns its raw stdout; fails with git's message on error.
    pub fn run_bytes<I, S>(&self, args: I) -> Result<Vec<u8>>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.command(args);
        let out = output(&mut cmd)?;
        if !out.status.success() {
            bail!("{} failed: {}", describe(&cmd), stderr_summary(&out));
        }
        Ok(out.stdout)
    }

    /// Runs a network command (a fetch) once; fails with git's message. (Sources retry theirs,
    /// telling permanent failures from transient ones.)
    pub fn run_network<I, S>(&self, args: I) -> Result<()>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.network_command(args);
        let out = output(&mut cmd)?;
        if !out.status.success() {
            bail!("{} failed: {}", describe(&cmd), stderr_summary(&out));
        }
        Ok(())
    }

    /// Runs a command with extra environment variables; fails with git's message.
    pub fn run_env<I, S>(&self, args: I, env: &[(&str, &OsStr)]) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.command(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = output(&mut cmd)?;
        if !out.status.success() {
            bail!("{} failed: {}", describe(&cmd), stderr_summary(&out));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim_end().to_owned())
    }

    /// Runs a command and returns its output whatever its exit status.
    pub fn output<I, S>(&self, args: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        output(&mut self.command(args))
    }

    /// True when the command exits with status 0.
    pub fn succeeds<I, S>(&self, args: I) -> bool
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.output(args).map(|o| o.status.success()).unwrap_or(false)
    }

    /// True when `rev` names an object of type commit in this repository.
    pub fn has_commit(&self, rev: &str) -> bool {
        self.succeeds(["cat-file", "-e", &format!("{rev}^{{commit}}")])
    }

    /// The full object id `rev` resolves to.
    pub fn rev_parse(&self, rev: &str) -> Result<String> {
        self.run(["rev-parse", "--verify", "--quiet", "--end-of-options", rev])
            .with_context(|| format!("{rev} is not in the repository {}", self.dir.display()))
    }
}

/// True when `s` is a full git object id (SHA-1: 40, SHA-256: 64 lowercase hex digits).
pub fn is_object_id(s: &str) -> bool {
    (s.len() == 40 || s.len() == 64) && is_lower_hex(s)
}

/// The oldest git that honours `GIT_CONFIG_GLOBAL`, which the isolation depends on.
pub const MIN_GIT: (u32, u32) = (2, 32);

/// Checks once per process that the `git` on `PATH` is new enough for the isolation to hold.
pub fn check_version() -> Result<()> {
    static CHECKED: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    CHECKED
        .get_or_init(|| {
            let out = output(Command::new("git").arg("--version")).map_err(|e| format!("{e:#}"))?;
            let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            match parse_version(&text) {
                Some(v) if v >= MIN_GIT => Ok(()),
                _ => Err(format!(
                    "distro needs git {}.{} or newer (found `{text}`); install a newer git",
                    MIN_GIT.0, MIN_GIT.1
                )),
            }
        })
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}

/// `(major, minor)` from `git version 2.47.3` (or `git version 2.39.2.windows.1`).
fn parse_version(text: &str) -> Option<(u32, u32)> {
    let v = text.strip_prefix("git version ")?;
    let mut parts = v.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Runs `cmd`, capturing stdout and stderr; fails only when `git` cannot be started.
pub fn output(cmd: &mut Command) -> Result<Output> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            anyhow::anyhow!(
                "`{}` was not found on PATH; install it (Debian: apt-get install git)",
                cmd.get_program().to_string_lossy()
            )
        } else {
            anyhow::Error::new(e).context(format!("starting {}", describe(cmd)))
        }
    })
}

/// `git SUBCOMMAND ARGS` without the `-c` settings, for messages.
pub fn describe(cmd: &Command) -> String {
    let mut words = vec![cmd.get_program().to_string_lossy().into_owned()];
    let mut args = cmd.get_args().peekable();
    while let Some(a) = args.next() {
        if a == "-c" {
            args.next();
            continue;
        }
        words.push(a.to_string_lossy().into_owned());
    }
    format!("`{}`", words.join(" "))
}

/// The meaningful lines of a command's stderr on one line (hints dropped), for error messages.
pub fn stderr_summary(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("hint:")).collect();
    if lines.is_empty() {
        return format!("exit status {}", out.status);
    }
    let joined = lines.join("; ");
    // Keep messages readable: the end of git's output names the actual failure.
    if joined.len() > 600 {
        let cut = joined.len() - 600;
        let start = (cut..joined.len()).find(|i| joined.is_char_boundary(*i)).unwrap_or(cut);
        format!("...{}", &joined[start..])
    } else {
        joined
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_ids_are_full_lowercase_hex() {
        assert!(is_object_id(&"a".repeat(40)));
        assert!(is_object_id(&"0".repeat(64)));
        assert!(!is_object_id(&"A".repeat(40)));
        assert!(!is_object_id("abc123"));
        assert!(!is_object_id(&"g".repeat(40)));
    }

    #[test]
    fn isolated_commits_do_not_depend_on_the_callers_environment() {
        let dir = tempfile::tempdir().unwrap();
        let git = Git::new(dir.path());
        git.run(["init", "--quiet", "--template="]).unwrap();
        std::fs::write(dir.path().join("f"), "x\n").unwrap();
        git.run(["add", "f"]).unwrap();
        // Env a user might have set: removed for isolated commands.
        let mut cmd = git.command(["commit", "--quiet", "-m", "m"]);
        cmd.env("GIT_AUTHOR_NAME_UNRELATED", "x");
        assert!(output(&mut cmd).unwrap().status.success());
        let id = git.rev_parse("HEAD").unwrap();
        let log = git.run(["log", "-1", "--format=%an <%ae> %ad|%cn <%ce> %cd", "--date=raw"]).unwrap();
        assert_eq!(
            log,
            format!("{IDENTITY_NAME} <{IDENTITY_EMAIL}> {FIXED_DATE}|{IDENTITY_NAME} <{IDENTITY_EMAIL}> {FIXED_DATE}")
        );
        assert!(is_object_id(&id));
    }

    #[test]
    fn git_versions_are_parsed_and_checked() {
        assert_eq!(parse_version("git version 2.47.3"), Some((2, 47)));
        assert_eq!(parse_version("git version 2.39.2.windows.1"), Some((2, 39)));
        assert_eq!(parse_version("hub version 1"), None);
        assert!(parse_version("git version 2.31.0").unwrap() < MIN_GIT);
        check_version().unwrap();
    }

    #[test]
    fn failures_carry_gits_message() {
        let dir = tempfile::tempdir().unwrap();
        let git = Git::new(dir.path());
        let err = git.run(["rev-parse", "--verify", "nope"]).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("git rev-parse --verify nope"), "{msg}");
        assert!(!msg.contains("core.autocrlf"), "{msg}");
    }
}
