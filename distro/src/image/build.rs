//! The build pipeline. Each step is a function of its inputs: base image + workspace +
//! definition + pinned sources -> engine binaries -> layers -> configs -> manifests -> index,
//! returned as a [`Built`] for the publishers (the `publish` folder); nothing here writes a layout
//! or pushes. Layer blobs are cached by a key of their exact inputs, so an unchanged input
//! rebuilds nothing.
use super::base::{self, BasePlatform};
use super::config::{AddedLayer, image_config};
use super::def::ImageDef;
use super::engine_build::Stage;
use super::layer::{Layer, LayerSpec, MODE_EXEC, MODE_FILE, cached_layer};
use super::pins::{PIN_ANNOTATION_PREFIX, PinnedSources};
use super::sbom::{SbomInput, sbom};
use super::workspace::Workspace;
use crate::dated::{parse_date, rfc3339, utc_date};
use crate::error::bad_input;
use crate::fsutil::DirLock;
use crate::oci::bundle::{BlobOrigin, Bundle, BundleBlob, ManifestDoc};
use crate::oci::manifest::{
    Descriptor, OCI_CONFIG, OCI_INDEX, OCI_LAYER_GZIP, OCI_MANIFEST, image_index, image_manifest,
};
use crate::oci::platform::Platform;
use crate::oci::store::BlobStore;
use crate::progress::Progress;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use crate::sources::wheels::WheelSpec;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Options of one build.
#[derive(Clone, Debug, Default)]
pub struct BuildOptions {
    /// Image definition name (`images/<name>.toml`).
    pub image: String,
    /// Platforms (default: the definition's).
    pub platforms: Option<Vec<Platform>>,
    /// Tag date `YYYY-MM-DD`; also makes the build ignore `SOURCE_DATE_EPOCH`.
    pub date: Option<String>,
    /// Base image instead of the definition's (`--base`).
    pub base: Option<Reference>,
    /// Where to find the workspace (any directory inside it).
    pub start_dir: PathBuf,
    /// Extra patches for this build (`--patch [SOURCE=]PATH`).
    pub patches: Vec<String>,
    /// Source overrides for this build (`--source NAME=URL#REF`).
    pub source_overrides: Vec<String>,
}

/// What a build produced, ready for any publisher (`publish::Publisher`).
#[derive(Clone, Debug)]
pub struct Built {
    /// Descriptor of the multi-arch index: its digest is what `distro build` prints.
    pub index: Descriptor,
    /// The index with every blob it references (in the build's store) and its refs: the
    /// multi-arch tags `NAME-YYYY-MM-DD` and `NAME` point at the index, and one dated tag per
    /// platform, `NAME-YYYY-MM-DD-ARCH`, at that platform's manifest, for tools that cannot pick
    /// a platform from an index (umoci).
    pub bundle: Bundle,
    /// Each platform's size, compressed and uncompressed.
    pub sizes: Vec<super::size::PlatformSize>,
    /// The definition's size budget.
    pub budget: super::size::Budget,
    /// The image definition's path (for messages).
    pub def_path: PathBuf,
}

/// The build directory: `$DISTRO_TARGET_DIR`, else `<workspace>/target/distro` (the sources
/// cache, `$DISTRO_CACHE_DIR`, is another, per-user directory).
pub fn build_dir(ws: &Workspace) -> PathBuf {
    std::env::var_os("DISTRO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| ws.root.join("target/distro"))
}

/// The build directory of a workspace ([`build_dir`]), held by this process for its life: the
/// stage's workspace copy is rewritten by every build and read by cargo for minutes, so two
/// builds in one directory would build from each other's files. A second process is refused in
/// one line naming the directory and the process holding it (exit code 2).
#[derive(Debug)]
pub struct BuildDir {
    path: PathBuf,
    _lock: DirLock,
}

impl BuildDir {
    /// Creates (when missing) and locks the build directory of `ws`.
    pub fn lock(ws: &Workspace) -> Result<BuildDir> {
        let path = build_dir(ws);
        fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        let lock = DirLock::exclusive(
            &path,
            "build directory",
            "wait for it to finish, or set DISTRO_TARGET_DIR to another directory to build beside it",
        )?;
        Ok(BuildDir { path, _lock: lock })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Resolves the epoch and the tag date. With `--date`, the epoch is the commit time whatever the
/// environment says; without it, `SOURCE_DATE_EPOCH` (else the commit time) and today's date.
pub fn epoch_and_date(ws: &Workspace, date: Option<&str>) -> Result<(u64, String)> {
    if let Some(d) = date {
        if parse_date(d).is_none() {
            return Err(bad_input(format!("--date {d:?} is not a date in YYYY-MM-DD form")));
        }
        return Ok((ws.commit_time, d.to_string()));
    }
    let epoch = match std::env::var("SOURCE_DATE_EPOCH") {
        Ok(s) if !s.is_empty() => s
            .trim()
            .parse::<u64>()
            .map_err(|_| bad_input(format!("SOURCE_DATE_EPOCH={s:?} is not a Unix time in seconds")))?,
        _ => ws.commit_time,
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    Ok((epoch, utc_date(now)))
}

fn file_mode(path: &Path) -> Result<u32> {
    let m = fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(if m.permissions().mode() & 0o111 != 0 { MODE_EXEC } else { MODE_FILE })
}

/// The layer of the definition's `[[tree]]`s (tracked workspace files) and `[[source_tree]]`s
/// (directories of the patched sources); empty when the definition has neither.
fn trees_spec(ws: &Workspace, def: &ImageDef, def_path: &Path, sources: &PinnedSources) -> Result<LayerSpec> {
    let mut trees = LayerSpec::new();
    for t in &def.trees {
        let mut any = false;
        for f in ws.files_under(&t.src) {
            let rel = &f[t.src.trim_end_matches('/').len() + 1..];
            add_host_file(&mut trees, &t.dest, rel, &ws.root.join(f))?;
            any = true;
        }
        if !any && !t.optional {
            return Err(bad_input(format!(
                "{}: tree {:?} has no tracked files (mark it optional = true if that is fine)",
                def_path.display(),
                t.src
            )));
        }
    }
    for t in &def.source_trees {
        let dir = sources.trees.get(&t.source).ok_or_else(|| {
            bad_input(format!(
                "{}: source_tree: source {:?} is not in images/manifest.toml",
                def_path.display(),
                t.source
            ))
        })?;
        let root = dir.join(&t.src);
        let files = if root.is_dir() { super::engine_build::walk_files(&root)? } else { Vec::new() };
        if files.is_empty() {
            // Not bad input: the definition is fine, this pin of the source lacks the directory.
            anyhow::bail!(
                "{}: source_tree: {:?} has no files in source {} at {}",
                def_path.display(),
                t.src,
                t.source,
                sources.annotations.get(&format!("{PIN_ANNOTATION_PREFIX}{}.pin", t.source)).map_or("?", |s| s)
            );
        }
        for rel in files {
            add_host_file(&mut trees, &t.dest, &rel.to_string_lossy(), &root.join(&rel))?;
        }
    }
    Ok(trees)
}

/// Adds host file `src` at `dest_dir/rel`, executable when the host file is.
fn add_host_file(spec: &mut LayerSpec, dest_dir: &str, rel: &str, src: &Path) -> Result<()> {
    spec.add_file(&format!("{}/{rel}", dest_dir.trim_end_matches('/')), Arc::new(fs::read(src)?), file_mode(src)?)
}

/// The `/opt/distro` layer of one platform: its SBOM, the `Cargo.lock` the engine was built
/// with, and the build's manifest lock and applied patches.
fn opt_distro_spec(sbom: Vec<u8>, cargo_lock: &[u8], sources: &PinnedSources) -> Result<LayerSpec> {
    let mut distro = LayerSpec::new();
    distro.add_file("/opt/distro/sbom.spdx.json", Arc::new(sbom), MODE_FILE)?;
    distro.add_file("/opt/distro/Cargo.lock", Arc::new(cargo_lock.to_vec()), MODE_FILE)?;
    if let Some(l) = &sources.lock_text {
        distro.add_file("/opt/distro/manifest.lock", Arc::new(l.clone().into_bytes()), MODE_FILE)?;
    }
    distro.add_dir("/opt/distro/patches")?;
    for (rel, bytes) in &sources.patch_files {
        distro.add_file(&format!("/opt/distro/patches/{rel}"), Arc::new(bytes.clone()), MODE_FILE)?;
    }
    Ok(distro)
}

/// Runs the build in `dir` (the workspace's build directory, held); `client` pulls the base
/// image. Publishes nothing.
pub fn build(opts: &BuildOptions, dir: &BuildDir, client: &Client, progress: &Progress) -> Result<Built> {
    let ws = Workspace::open(&opts.start_dir)?;
    let def_path = ws.root.join("images").join(format!("{}.toml", opts.image));
    let def = ImageDef::load(&def_path)?;
    let platforms = opts.platforms.clone().unwrap_or_else(|| def.platforms.clone());
    let (epoch, date) = epoch_and_date(&ws, opts.date.as_deref())?;
    let version = format!("{}-{date}", def.name);
    let cache = dir.path().to_path_buf();
    let store = BlobStore::new(cache.join("store"));
    let base_ref = match &opts.base {
        Some(b) => b.clone(),
        None => def.base_reference(&ws.root)?,
    };
    if base_ref.digest.is_none() {
        progress.info(format!(
            "warning: base {base_ref} is not pinned by digest; the build is only as reproducible as that tag"
        ));
    }
    // 1. Base image.
    let base = base::resolve(client, &base_ref, &platforms, &store, progress)?;

    // 2. The pinned sources (after the base, so a bad base fails before any fetching).
    let sources = super::pins::collect(&ws, &opts.patches, &opts.source_overrides, progress)?;
    let wheels = super::wheels::specs(&ws.root, &def, &def_path, &platforms, progress)?;

    // 3. Engine binaries, all platforms in one cargo run.
    let stage = Stage::prepare(&ws, &cache, &sources.crate_patches, progress)?;
    // A definition without binaries (content only) needs no cargo build.
    let built = if def.binaries.is_empty() {
        BTreeMap::new()
    } else {
        stage.build(&platforms, &def.binaries, &ws.revision(), progress)?
    };

    // 4. Layers that do not depend on the platform.
    let step = progress.step("assembling layers");
    let trees = trees_spec(&ws, &def, &def_path, &sources)?;
    let tree_layer = if trees.is_empty() { None } else { Some(cached_layer(&trees, epoch, &cache, &store)?) };

    // 5. Per platform: its layers, config and manifest ([`platform_image`]); then the index.
    let base_name = Reference { tag: base_ref.tag.clone(), digest: None, ..base_ref.clone() }.to_string();
    let mut annotations: BTreeMap<String, String> = BTreeMap::from([
        ("org.opencontainers.image.created".into(), rfc3339(epoch)),
        ("org.opencontainers.image.revision".into(), ws.revision()),
        ("org.opencontainers.image.version".into(), version.clone()),
        ("org.opencontainers.image.title".into(), def.name.clone()),
        ("org.opencontainers.image.description".into(), def.description.clone()),
        ("org.opencontainers.image.base.name".into(), base_name.clone()),
        ("org.opencontainers.image.base.digest".into(), base.digest.to_string()),
    ]);
    if let Some(r) = &ws.repository {
        annotations.insert("org.opencontainers.image.source".into(), r.clone());
    }
    annotations.extend(sources.annotations.clone());
    let base_origin = BlobOrigin { api_host: base_ref.api_host().to_string(), repository: base_ref.repository.clone() };
    let common = Common {
        ws: &ws,
        def: &def,
        version: &version,
        epoch,
        cache: &cache,
        store: &store,
        stage: &stage,
        built: &built,
        sources: &sources,
        wheels: &wheels,
        tree_layer: tree_layer.as_ref(),
        annotations: &annotations,
        base_ref: &base_ref,
        base_origin: &base_origin,
        progress,
    };
    let mut manifests: Vec<(Platform, Descriptor)> = Vec::new();
    let mut sizes = Vec::new();
    let mut blobs: Vec<BundleBlob> = Vec::new();
    let mut manifest_docs: Vec<ManifestDoc> = Vec::new();
    for p in &platforms {
        let image = platform_image(&common, p, &base.platforms[p])?;
        for b in image.blobs {
            if !blobs.iter().any(|have| have.digest == b.digest) {
                blobs.push(b);
            }
        }
        manifest_docs.push(ManifestDoc::new(OCI_MANIFEST, image.manifest));
        manifests.push((p.clone(), image.descriptor));
        sizes.push(image.size);
    }
    // The index names every platform of its definition, so that a publisher can refuse an
    // index that lost one (a `--platform` subset written to a layout, then pushed).
    let mut index_annotations = annotations.clone();
    index_annotations.insert(
        crate::publish::registry::PLATFORMS_ANNOTATION.into(),
        def.platforms.iter().map(Platform::to_string).collect::<Vec<_>>().join(","),
    );
    let index = image_index(&manifests, &index_annotations)?;
    store.put(&index)?;
    let index_desc = Descriptor::of(OCI_INDEX, &index);
    manifest_docs.push(ManifestDoc::new(OCI_INDEX, index));
    step.done(format!("{} layers", blobs.len() + manifest_docs.len()));

    // 6. The refs. The multi-arch tags point at the index; one dated tag per platform points at
    // that platform's manifest, for tools that cannot pick a platform from an index (umoci).
    let mut refs: Vec<(String, Descriptor)> =
        vec![(version.clone(), index_desc.clone()), (def.name.clone(), index_desc.clone())];
    for (p, md) in &manifests {
        refs.push((format!("{version}-{}", p.architecture), md.clone()));
    }
    let bundle = Bundle { name: version, store, blobs, manifests: manifest_docs, refs };
    Ok(Built { index: index_desc, bundle, sizes, budget: def.budget.clone(), def_path })
}

/// The annotation of each layer the build adds, naming its group for `distro report`'s sizes:
/// [`GROUP_ENGINE`] or [`GROUP_CUDA`]. The base's layers carry none: a layer without it is the
/// base's ([`GROUP_BASE`]). An annotation of the manifest's descriptor, not of the layer, so the
/// layers' bytes and their cache keys are unchanged.
pub const LAYER_GROUP_ANNOTATION: &str = "io.github.llm-distro.layer-group";
/// The base image's layers (never annotated).
pub const GROUP_BASE: &str = "base";
/// The engine: its binaries, the trees it reads (recipes, baselines) and `/opt/distro`.
pub const GROUP_ENGINE: &str = "engine";
/// The CUDA libraries unpacked from NVIDIA's wheels (images/engine-wheels.toml).
pub const GROUP_CUDA: &str = "cuda";

/// What every platform's image of one build shares: the build's inputs and the layer that does
/// not depend on the platform.
struct Common<'a> {
    ws: &'a Workspace,
    def: &'a ImageDef,
    version: &'a str,
    epoch: u64,
    cache: &'a Path,
    store: &'a BlobStore,
    stage: &'a Stage,
    /// The engine binaries, by platform and binary name.
    built: &'a BTreeMap<(Platform, String), PathBuf>,
    sources: &'a PinnedSources,
    wheels: &'a [WheelSpec],
    tree_layer: Option<&'a Layer>,
    /// The annotations of the index and of every manifest.
    annotations: &'a BTreeMap<String, String>,
    base_ref: &'a Reference,
    base_origin: &'a BlobOrigin,
    progress: &'a Progress,
}

/// One platform's image, stored: its manifest and what it references.
struct PlatformImage {
    manifest: Vec<u8>,
    descriptor: Descriptor,
    /// The config and every layer in manifest order, the base's with their origin.
    blobs: Vec<BundleBlob>,
    size: super::size::PlatformSize,
}

/// The image of platform `p` on the base's `bp`: the binaries layer, the tree layer, the wheels'
/// layers and the `/opt/distro` layer (with this platform's SBOM), then its config and manifest.
fn platform_image(c: &Common, p: &Platform, bp: &BasePlatform) -> Result<PlatformImage> {
    let (def, epoch, cache, store, stage) = (c.def, c.epoch, c.cache, c.store, c.stage);
    let mut bins = LayerSpec::new();
    for b in &def.binaries {
        let path = &c.built[&(p.clone(), b.bin_name().to_string())];
        bins.add_file(&b.dest, Arc::new(fs::read(path)?), MODE_EXEC)?;
    }
    for f in &def.files {
        bins.add_file(&f.dest, Arc::new(f.content.clone().into_bytes()), f.mode)?;
    }
    let bin_layer = cached_layer(&bins, epoch, cache, store)?;

    let metadata = stage.metadata(p)?;
    let base_contents = super::dpkg::base_contents(store, &bp.layers, &bp.manifest_digest, &cache.join("dpkg"))?;
    let roots: Vec<String> = def.binaries.iter().map(|b| b.package.clone()).collect();
    let sbom_bytes = sbom(&SbomInput {
        image: &def.name,
        version: c.version,
        platform: p,
        epoch,
        revision: &c.ws.revision(),
        repository: c.ws.repository.as_deref(),
        lock: stage.lock(),
        metadata: &metadata,
        roots: &roots,
        base_name: c.base_ref.name(),
        base_tag: c.base_ref.tag.clone(),
        base_digest: &bp.manifest_digest,
        base_contents: Some(&base_contents),
    })?;
    let sbom_bytes = super::wheels::add_to_sbom(sbom_bytes, c.wheels, p)?;
    let distro = opt_distro_spec(sbom_bytes, stage.lock(), c.sources)?;
    let distro_layer = cached_layer(&distro, epoch, cache, store)?;

    let bin_paths: Vec<&str> =
        def.binaries.iter().map(|b| b.dest.as_str()).chain(def.files.iter().map(|f| f.dest.as_str())).collect();
    let mut ours = vec![(bin_layer, format!("binaries: {}", bin_paths.join(" ")), GROUP_ENGINE)];
    if let Some(t) = c.tree_layer {
        ours.push((
            t.clone(),
            "trees: ".to_string()
                + &def
                    .trees
                    .iter()
                    .map(|t| t.dest.as_str())
                    .chain(def.source_trees.iter().map(|t| t.dest.as_str()))
                    .collect::<Vec<_>>()
                    .join(" "),
            GROUP_ENGINE,
        ));
    }
    let wheels = super::wheels::layers(c.wheels, p, epoch, cache, store, c.progress)?;
    ours.extend(wheels.into_iter().map(|(l, what)| (l, what, GROUP_CUDA)));
    ours.push((distro_layer, "/opt/distro: manifest lock, patches, Cargo.lock, SBOM".into(), GROUP_ENGINE));

    let added: Vec<AddedLayer> = ours
        .iter()
        .map(|(l, what, _)| AddedLayer { diff_id: l.diff_id.clone(), created_by: format!("distro build: {what}") })
        .collect();
    let mut labels = c.annotations.clone();
    labels.insert("org.opencontainers.image.base.digest".into(), bp.manifest_digest.to_string());
    let config = image_config(&bp.config, def, p, epoch, &added, &labels)?;
    let config_desc = Descriptor::of(OCI_CONFIG, &config);
    store.put(&config)?;
    let mut layers = bp.layers.clone();
    layers.extend(ours.iter().map(|(l, _, group)| Descriptor {
        media_type: OCI_LAYER_GZIP.into(),
        digest: l.digest.clone(),
        size: l.size,
        platform: None,
        annotations: Some(BTreeMap::from([(LAYER_GROUP_ANNOTATION.to_string(), group.to_string())])),
    }));
    let manifest = image_manifest(&config_desc, &layers, &labels)?;
    store.put(&manifest)?;
    let descriptor = Descriptor::of(OCI_MANIFEST, &manifest);
    let blobs = std::iter::once(&config_desc)
        .chain(&layers)
        .map(|d| BundleBlob {
            digest: d.digest.clone(),
            size: d.size,
            origin: bp.layers.iter().any(|b| b.digest == d.digest).then(|| c.base_origin.clone()),
        })
        .collect();
    let size = super::size::measure(&p.to_string(), &layers, store, &cache.join("sizes"))?;
    Ok(PlatformImage { manifest, descriptor, blobs, size })
}
