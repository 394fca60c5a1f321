//! Command-line arguments and entry points of `distro build`, `push`, `load` and `run`
//! (`main.rs` only dispatches here).
use super::build::{BuildOptions, build};
use super::error::bad_input;
use super::layout::Layout;
use super::manifest::{Descriptor, OCI_INDEX, OCI_MANIFEST, is_index};
use super::platform::Platform;
use super::progress::Progress;
use crate::docker::{self, Gpus, RunOptions};
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use crate::registry::push::{BlobFile, ManifestDoc, PushOptions, PushPlan, push};
use crate::registry::reference::Reference;
use anyhow::Result;
use clap::Args;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

/// `distro build`.
#[derive(Args, Debug)]
pub struct BuildArgs {
    /// Image definition: images/NAME.toml.
    #[arg(long, default_value = "engine", value_name = "NAME")]
    pub image: String,
    /// Platforms to build (default: the definition's), e.g. linux/amd64,linux/arm64.
    #[arg(long, value_delimiter = ',', value_name = "P[,P]")]
    pub platform: Vec<String>,
    /// Tag date (UTC); also ignores SOURCE_DATE_EPOCH (the epoch is then the commit time).
    #[arg(long, value_name = "YYYY-MM-DD")]
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
    #[arg(long, value_name = "HOST[:PORT]")]
    pub insecure: Vec<String>,
    /// Upload blobs in chunks of this many bytes (default: one request per blob).
    #[arg(long, value_name = "BYTES", hide = true)]
    pub chunk_size: Option<u64>,
}

/// `distro sbom`.
#[derive(Args, Debug)]
pub struct SbomArgs {
    /// Image definition: images/NAME.toml.
    #[arg(long, default_value = "engine", value_name = "NAME")]
    pub image: String,
    /// Platform the SBOM describes.
    #[arg(long, value_name = "P")]
    pub platform: String,
    /// Base image (default: the definition's).
    #[arg(long, value_name = "REF")]
    pub base: Option<String>,
    /// Tag date; the version is NAME-DATE.
    #[arg(long, value_name = "YYYY-MM-DD")]
    pub date: Option<String>,
    /// Revision, when the workspace is not a git checkout (e.g. a Docker build context).
    #[arg(long, value_name = "REV")]
    pub revision: Option<String>,
    /// Write here instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// `distro push`.
#[derive(Args, Debug)]
pub struct PushArgs {
    /// OCI image layout to push.
    pub layout: PathBuf,
    /// Repository, with :TAG to push only that ref of the layout (default: every ref).
    #[arg(value_name = "REPO[:TAG]")]
    pub repo: String,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]")]
    pub insecure: Vec<String>,
    /// Upload blobs in chunks of this many bytes (default: one request per blob).
    #[arg(long, value_name = "BYTES")]
    pub chunk_size: Option<u64>,
}

/// `distro load`.
#[derive(Args, Debug)]
pub struct LoadArgs {
    /// OCI image layout (default: target/distro/oci).
    #[arg(default_value = "target/distro/oci")]
    pub layout: PathBuf,
    /// Ref of the layout to load (repeatable; default: every ref).
    #[arg(long = "ref", value_name = "REF")]
    pub refs: Vec<String>,
    /// Platform to load (default: the Docker engine's).
    #[arg(long, value_name = "P")]
    pub platform: Option<String>,
    /// Repository the loaded images are tagged in: REPO:REF.
    #[arg(long, default_value = "distro", value_name = "REPO")]
    pub repo: String,
    /// Write the tar here (for `docker load -i`) instead of loading it.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// `distro run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Image (e.g. distro:engine, or REGISTRY/REPO:engine-YYYY-MM-DD).
    pub image: String,
    /// Command (default: the image's, `engine info`).
    #[arg(last = true, value_name = "CMD")]
    pub cmd: Vec<String>,
    /// Environment variable KEY=VALUE for the container (repeatable).
    #[arg(short, long, value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// GPUs: auto (all, when the Docker engine has an NVIDIA runtime or the host NVIDIA devices),
    /// all, none.
    #[arg(long, value_enum, default_value_t = Gpus::Auto)]
    pub gpus: Gpus,
    /// Keep the container after it exits.
    #[arg(long)]
    pub keep: bool,
    /// Platform to pull when the image is not local.
    #[arg(long, value_name = "P")]
    pub platform: Option<String>,
    /// Bind mount HOST_DIR:CONTAINER_DIR[:ro] (repeatable), as `docker run -v`.
    #[arg(short, long, value_name = "HOST:CONTAINER")]
    pub volume: Vec<String>,
}

fn parse_ref(s: &str, what: &str) -> Result<Reference> {
    Reference::parse(s).map_err(|e| bad_input(format!("{what}: {e:#}")))
}

/// Runs `distro build`; prints the index digest as the last line on stdout.
pub fn build_cmd(a: BuildArgs) -> Result<ExitCode> {
    let progress = Progress::new();
    let platforms = if a.platform.is_empty() {
        None
    } else {
        Some(a.platform.iter().map(|p| Platform::parse(p)).collect::<Result<Vec<_>>>()?)
    };
    let start_dir = std::env::current_dir()?;
    let opts = BuildOptions {
        patches: a.patch,
        source_overrides: a.source,
        image: a.image,
        platforms,
        date: a.date,
        base: a.base.as_deref().map(|b| parse_ref(b, "--base")).transpose()?,
        output: a.output,
        push: a.push.as_deref().map(|p| parse_ref(p, "--push")).transpose()?,
        insecure: a.insecure,
        chunk_size: a.chunk_size,
        start_dir,
    };
    let r = build(&opts, &progress)?;
    if let Some(dir) = &r.layout {
        progress.info(format!("layout {}: {}", dir.display(), r.tags.join(", ")));
    }
    println!("{}", r.index_digest);
    Ok(ExitCode::SUCCESS)
}

/// Runs `distro sbom`: the SPDX document of the committed lock (without source patches) for
/// one platform. The Dockerfile uses it; `distro build` makes its own, from the build's lock.
pub fn sbom_cmd(a: SbomArgs) -> Result<ExitCode> {
    let platform = Platform::parse(&a.platform)?;
    let start = std::env::current_dir()?;
    let ws = match super::workspace::Workspace::open(&start) {
        Ok(ws) => ws,
        Err(_) => super::workspace::Workspace::plain(&start, a.revision.as_deref())?,
    };
    let def = super::def::ImageDef::load(&ws.root.join("images").join(format!("{}.toml", a.image)))?;
    let base = match &a.base {
        Some(b) => parse_ref(b, "--base")?,
        None => def.base.clone(),
    };
    let (epoch, date) = super::build::epoch_and_date(&ws, a.date.as_deref())?;
    let lock = std::fs::read(ws.root.join("Cargo.lock"))?;
    let out = std::process::Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .current_dir(&ws.root)
        .args(["metadata", "--format-version", "1", "--locked", "--filter-platform", platform.rust_target()])
        .output()?;
    if !out.status.success() {
        anyhow::bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let unknown = super::digest::Digest::of(b"");
    let bytes = super::sbom::sbom(&super::sbom::SbomInput {
        image: &def.name,
        version: &format!("{}-{date}", def.name),
        platform: &platform,
        epoch,
        revision: &a.revision.clone().unwrap_or_else(|| ws.revision()),
        repository: ws.repository.as_deref(),
        lock: &lock,
        metadata: &metadata,
        roots: &def.binaries.iter().map(|b| b.package.clone()).collect::<Vec<_>>(),
        base_name: base.name(),
        base_tag: base.tag.clone(),
        // Without a registry the platform manifest is unknown: the index digest stands in.
        base_digest: base.digest.as_ref().unwrap_or(&unknown),
    })?;
    match a.output {
        Some(p) => super::fsutil::write_atomic(&p, &bytes)?,
        None => println!("{}", String::from_utf8_lossy(&bytes)),
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `distro push`; prints `REPO:TAG DIGEST` per tag on stdout, the multi-arch index's
/// digest last.
pub fn push_cmd(a: PushArgs) -> Result<ExitCode> {
    let progress = Progress::new();
    let target = parse_ref(&a.repo, "REPO")?;
    if target.digest.is_some() {
        return Err(bad_input("REPO: push to a repository or REPO:TAG, not a digest"));
    }
    let layout = Layout::open(&a.layout)?;
    let refs = layout.refs()?;
    let selected: Vec<(String, Descriptor)> = match &target.tag {
        Some(t) => match refs.iter().find(|(n, _)| n == t) {
            Some(r) => vec![r.clone()],
            None => {
                let names: Vec<&str> = refs.iter().map(|(n, _)| n.as_str()).collect();
                return Err(bad_input(format!("{}: no ref {t:?} (refs: {})", a.layout.display(), names.join(", "))));
            }
        },
        None => refs.into_iter().filter(|(n, _)| !n.is_empty()).collect(),
    };
    if selected.is_empty() {
        return Err(bad_input(format!("{}: nothing to push (no named refs)", a.layout.display())));
    }
    let mut plan = PushPlan::default();
    let mut seen = std::collections::BTreeSet::new();
    for (name, d) in &selected {
        // Blobs first, then platform manifests, then the root (index), so that nothing is
        // pushed before what it references.
        let all = layout.reachable(d)?;
        for x in all.iter().filter(|x| !x.media_type.contains("manifest") && !is_index(&x.media_type)) {
            if seen.insert(x.digest.clone()) {
                plan.blobs.push(BlobFile {
                    digest: x.digest.clone(),
                    size: x.size,
                    path: layout.store.path(&x.digest),
                    mount_from: None,
                });
            }
        }
        for x in all.iter().filter(|x| x.media_type == OCI_MANIFEST) {
            if seen.insert(x.digest.clone()) {
                plan.manifests.push(ManifestDoc::new(&x.media_type, layout.store.read(&x.digest)?));
            }
        }
        let root = ManifestDoc::new(
            if is_index(&d.media_type) { OCI_INDEX } else { &d.media_type },
            layout.store.read(&d.digest)?,
        );
        if seen.insert(d.digest.clone()) {
            plan.manifests.push(root.clone());
        }
        plan.tags.insert(name.clone(), root);
    }
    let client = Client::new(Credentials::from_environment(Some(target.api_host()))?, a.insecure)?;
    let step = progress.step(format!("pushing {} to {}", a.layout.display(), target.name()));
    let report = push(&client, &target, &plan, &PushOptions { chunk_size: a.chunk_size }, &progress)?;
    step.done(report.to_string());
    let by_tag: BTreeMap<&String, &ManifestDoc> = plan.tags.iter().collect();
    for (tag, doc) in &by_tag {
        println!("{}:{tag} {}", target.name(), doc.digest);
    }
    // Last: the multi-arch index (what build prints), else the one image pushed.
    let last = by_tag.values().find(|d| d.media_type == OCI_INDEX).or(by_tag.values().next());
    if let Some(d) = last {
        println!("{}", d.digest);
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `distro load`; prints the loaded `repo:tag` names.
pub fn load_cmd(a: LoadArgs) -> Result<ExitCode> {
    let progress = Progress::new();
    let platform = a.platform.as_deref().map(Platform::parse).transpose()?;
    let names = docker::load(&a.layout, &a.refs, platform.as_ref(), &a.repo, a.output.as_deref(), &progress)?;
    for n in names {
        println!("{n}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `distro run`; exits with the container's exit code.
pub fn run_cmd(a: RunArgs) -> Result<ExitCode> {
    let progress = Progress::new();
    for e in &a.env {
        if !e.contains('=') {
            return Err(bad_input(format!("--env {e:?}: expected KEY=VALUE")));
        }
    }
    let opts = RunOptions {
        image: a.image,
        cmd: a.cmd,
        env: a.env,
        gpus: a.gpus,
        keep: a.keep,
        platform: a.platform.as_deref().map(Platform::parse).transpose()?,
        binds: a.volume.iter().map(|v| docker::bind(v)).collect::<Result<_>>()?,
        stdout_to_stderr: false,
    };
    let code = docker::run(&opts, &progress)?;
    Ok(ExitCode::from(u8::try_from(code.rem_euclid(256)).unwrap_or(1)))
}
