//! `distro build`: its arguments, and what it prints (the index digest, last, on stdout).
use super::parse_ref;
use crate::error::bad_input;
use crate::fsutil::DirLock;
use crate::image::build::{BuildDir, BuildOptions, build};
use crate::image::workspace::Workspace;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use crate::publish::layout::OciLayout;
use crate::publish::publish;
use crate::publish::registry::Registry;
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use anyhow::{Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The arguments of `distro build`.
#[derive(Args, Debug)]
pub struct BuildArgs {
    /// Image definition: images/NAME.toml.
    #[arg(long, default_value = "engine", value_name = "NAME", value_parser = super::image_name)]
    pub image: String,
    /// Platforms to build (default: the definition's), e.g. linux/amd64,linux/arm64.
    #[arg(long, value_delimiter = ',', value_name = "P[,P]")]
    pub platform: Vec<String>,
    /// Tag date (UTC); also ignores SOURCE_DATE_EPOCH (the epoch is then the commit time).
    #[arg(long, value_name = "YYYY-MM-DD", value_parser = super::date_arg)]
    pub date: Option<String>,
    /// Base image instead of the definition's (pin it by digest for reproducible builds).
    #[arg(long, value_name = "REF")]
    pub base: Option<String>,
    /// Write an OCI image layout here (default when not pushing: target/distro/oci).
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,
    /// Push to this repository, tagged NAME-YYYY-MM-DD and NAME.
    #[arg(long, value_name = "REPO")]
    pub push: Option<String>,
    /// Extra patch for this build: [SOURCE=]PATH (repeatable; recorded in the image's lock).
    #[arg(long, value_name = "[SOURCE=]PATH")]
    pub patch: Vec<String>,
    /// Override a source for this build: NAME=URL#REF (repeatable).
    #[arg(long, value_name = "NAME=URL#REF")]
    pub source: Vec<String>,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    pub insecure: Vec<String>,
    /// Upload blobs in chunks of this many bytes (default: one request per blob).
    #[arg(long, value_name = "BYTES", hide = true, value_parser = super::chunk_size)]
    pub chunk_size: Option<u64>,
    /// Fail, writing and pushing nothing, when a platform's image is over the definition's
    /// `[budget]` (without it, a warning).
    #[arg(long)]
    pub enforce_budget: bool,
}

/// Runs `distro build`; prints the index digest as the last line on stdout.
pub fn build_cmd(a: BuildArgs) -> Result<ExitCode> {
    if let Some(out) = a.output.as_ref().filter(|o| o.exists() && !o.is_dir()) {
        return Err(bad_input(format!(
            "--output {}: the path exists and is not a directory (an OCI layout is one)",
            out.display()
        )));
    }
    let progress = Progress::new();
    let platforms = if a.platform.is_empty() {
        None
    } else {
        Some(a.platform.iter().map(|p| Platform::parse(p)).collect::<Result<Vec<_>>>()?)
    };
    let start_dir = std::env::current_dir()?;
    let push = a.push.as_deref().map(|p| parse_ref(p, "--push")).transpose()?;
    // A pushed index holds every platform of the definition: a tag that silently lost one
    // (JAX-Toolbox's arm64, its #2224) is worse than no tag. A partial build goes to a layout.
    if let (Some(repo), Some(chosen)) = (&push, &platforms) {
        let ws = Workspace::open(&start_dir)?;
        let def_path = ws.root.join("images").join(format!("{}.toml", a.image));
        let def = crate::image::def::ImageDef::load(&def_path)?;
        if let Some(missing) = def.platforms.iter().find(|p| !chosen.contains(p)) {
            return Err(bad_input(format!(
                "--push {repo}: the index would lack {missing}, a platform of {}; a pushed index holds every platform (build them all, or write a layout with --output)",
                def_path.display()
            )));
        }
    }
    // One owner per directory, taken before any work so that a refused build changes nothing:
    // the build directory, then the layout this build will write (created now, to be locked).
    let build_dir = BuildDir::lock(&Workspace::open(&start_dir)?)?;
    let layout = match (a.output, &push) {
        (Some(o), _) => Some(o),
        (None, None) => Some(build_dir.path().join("oci")),
        (None, Some(_)) => None,
    };
    let _layout_lock = match &layout {
        Some(dir) => lock_layout(dir, &build_dir)?,
        None => None,
    };
    let opts = BuildOptions {
        patches: a.patch,
        source_overrides: a.source,
        image: a.image,
        platforms,
        date: a.date,
        base: a.base.as_deref().map(|b| parse_ref(b, "--base")).transpose()?,
        start_dir,
    };
    // One client pulls the base and pushes, with the credentials of the registry pushed to.
    let client = Client::new(Credentials::from_environment(push.as_ref().map(|r| r.api_host()))?, a.insecure)?;
    let built = build(&opts, &build_dir, &client, &progress)?;
    // Sizes against the definition's budget, before anything is written or pushed.
    let def_name = built.def_path.display().to_string();
    let mut over = Vec::new();
    for s in &built.sizes {
        progress.info(format!("size {}", s.report(&built.budget)));
        over.extend(s.over(&built.budget, &def_name));
    }
    if let Some(first) = over.first() {
        if a.enforce_budget {
            anyhow::bail!("{first}; nothing was written or pushed (--enforce-budget)");
        }
        for o in &over {
            progress.info(format!("warning: {o}"));
        }
    }
    // The layout: where asked, else target/distro/oci unless pushing.
    if let Some(dir) = &layout {
        publish(&OciLayout { dir: dir.clone() }, &built.bundle, &progress)?;
    }
    if let Some(repo) = push {
        publish(&Registry { client: &client, repo, chunk_size: a.chunk_size }, &built.bundle, &progress)?;
    }
    if let Some(dir) = &layout {
        progress.info(format!("layout {}: {}", dir.display(), built.bundle.tags().join(", ")));
    }
    println!("{}", built.index.digest);
    Ok(ExitCode::SUCCESS)
}

/// Creates and locks the layout `dir` for this build's life: two builds writing one layout would
/// each remove, as unreferenced, the blobs the other just linked, or drop the other's tags. A
/// layout that is the build directory itself is already held.
fn lock_layout(dir: &Path, build_dir: &BuildDir) -> Result<Option<DirLock>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    if std::fs::canonicalize(dir).ok() == std::fs::canonicalize(build_dir.path()).ok() {
        return Ok(None);
    }
    DirLock::exclusive(dir, "OCI layout", "wait for it to finish, or choose another --output").map(Some)
}
