//! The manifest (`images/manifest.toml`): one table per upstream source, with its pin and the
//! patches carried on top of it. Parsing keeps line/column positions so every error names the
//! place to fix.

use crate::error::bad_input;
use anyhow::Result;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use toml::Spanned;

pub use super::loc::Loc;
use crate::git::is_object_id;

/// Where the manifest is looked for when `--manifest` is not given.
pub const DEFAULT_MANIFEST: &str = "images/manifest.toml";

/// The parsed, validated manifest.
#[derive(Clone, Debug)]
pub struct Manifest {
    /// The manifest file, as it was named on the command line (used in messages).
    pub path: PathBuf,
    /// The project root: patch files and local upstream paths are relative to it. It is the
    /// manifest's `root` key, relative to the manifest's directory, by default `..` (so that
    /// `images/manifest.toml` has the repository as its root).
    pub root: PathBuf,
    /// The sources, by name.
    pub sources: BTreeMap<String, Source>,
    /// The base images (`[bases.NAME]`), by name: what image definitions build on.
    pub bases: BTreeMap<String, BaseSpec>,
    /// Pinned Python wheels (`[wheels.NAME]`: NVIDIA's CUDA libraries), by name.
    pub wheels: BTreeMap<String, super::wheels::WheelSpec>,
}

/// A base image the manifest tracks (`[bases.NAME]`): a registry repository, the tag `distro
/// bump` follows, and the pinned digest of what the tag resolved to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseSpec {
    /// The table name in `[bases.NAME]`.
    pub name: String,
    /// The repository, with its registry (`docker.io/nvidia/cuda`).
    pub image: String,
    /// The tag `distro bump` follows.
    pub tag: String,
    /// The pinned digest (`sha256:...`); `None` until `distro bump NAME` pins it.
    pub digest: Option<String>,
    /// Position of the table.
    pub loc: Loc,
}

impl BaseSpec {
    /// `IMAGE:TAG@DIGEST` (without the digest when unpinned).
    pub fn reference(&self) -> String {
        match &self.digest {
            Some(d) => format!("{}:{}@{d}", self.image, self.tag),
            None => format!("{}:{}", self.image, self.tag),
        }
    }
}

/// One upstream source.
#[derive(Clone, Debug)]
pub struct Source {
    /// The table name in `[sources.NAME]`; also the directory under `patches/`.
    pub name: String,
    /// Where the source comes from and what is pinned.
    pub kind: SourceKind,
    /// Patches applied on top of the pin, in order.
    pub patches: Vec<PatchEntry>,
    /// Position of the source's table.
    pub loc: Loc,
}

/// The two kinds of upstream source.
#[derive(Clone, Debug)]
pub enum SourceKind {
    /// A git repository followed on a branch.
    Git(GitSpec),
    /// A crate from a Cargo registry, obtained with `cargo`.
    Crate(CrateSpec),
}

/// A git source: `url`, `tracking_ref`, `commit`.
#[derive(Clone, Debug)]
pub struct GitSpec {
    /// A git URL, or a local path (relative paths are relative to the project root).
    pub url: String,
    /// The ref `distro bump` follows (a branch such as `main`).
    pub tracking_ref: String,
    /// The pinned commit; `None` for a source that `distro bump` has not pinned yet.
    pub commit: Option<String>,
    /// Position of the `commit` value (or of the table when absent).
    pub commit_loc: Loc,
}

/// A crate source: `crate`, `version`, optional `tracking_req` and `registry`.
#[derive(Clone, Debug)]
pub struct CrateSpec {
    /// The crate's name in the registry.
    pub name: String,
    /// The pinned version (`x.y.z`); `None` for a source `distro bump` has not pinned yet.
    pub version: Option<String>,
    /// Position of the `version` value (or of the table when absent).
    pub version_loc: Loc,
    /// The version requirement `distro bump` follows (`*` by default: the newest release).
    pub tracking_req: String,
    /// A registry name from Cargo's configuration (`[registries.NAME]`); default: Cargo's default.
    pub registry: Option<String>,
}

/// One entry of a source's `patches` list, with its position.
#[derive(Clone, Debug)]
pub struct PatchEntry {
    /// What the entry names.
    pub spec: PatchSpec,
    /// Position of the entry in the manifest.
    pub loc: Loc,
}

/// A patch: a file in the project, or an upstream ref exported to a file.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PatchSpec {
    /// A patch file (mbox, as `git format-patch` writes), relative to the project root, under
    /// `patches/NAME/`.
    File(String),
    /// An upstream ref such as `pull/123/head`; `distro patches refresh` exports its commits to
    /// `patches/NAME/PR-123.patch`, and builds read only that file.
    Ref(String),
}

impl PatchSpec {
    /// Parses a `patches` entry of source `source`.
    pub fn parse(entry: &str, source: &str) -> std::result::Result<PatchSpec, String> {
        if is_upstream_ref(entry) {
            if !valid_ref(entry) {
                return Err(format!("patch ref `{entry}` is not a valid git ref name"));
            }
            return Ok(PatchSpec::Ref(entry.to_owned()));
        }
        if entry.ends_with(".patch") || entry.ends_with(".diff") {
            let prefix = format!("patches/{source}/");
            let path = Path::new(entry);
            let clean = path.components().all(|c| matches!(c, Component::Normal(_)));
            if !clean || !entry.starts_with(&prefix) || entry.len() == prefix.len() {
                return Err(format!("patch file `{entry}` must be a relative path under `{prefix}` (without `..`)"));
            }
            return Ok(PatchSpec::File(entry.to_owned()));
        }
        Err(format!(
            "patch entry `{entry}` is neither a patch file (`patches/{source}/NAME.patch`) nor an \
             upstream ref (`pull/123/head`, `merge-requests/7/head` or `refs/...`)"
        ))
    }

    /// The entry as written in the manifest.
    pub fn text(&self) -> &str {
        match self {
            PatchSpec::File(s) | PatchSpec::Ref(s) => s,
        }
    }

    /// The patch file this entry is read from, relative to the project root: the file itself,
    /// or where `distro patches refresh` exports the ref.
    pub fn file(&self, source: &str) -> String {
        match self {
            PatchSpec::File(f) => f.clone(),
            PatchSpec::Ref(r) => format!("patches/{source}/{}", ref_file_name(r)),
        }
    }
}

fn is_upstream_ref(entry: &str) -> bool {
    entry.starts_with("refs/") || entry.starts_with("pull/") || entry.starts_with("merge-requests/")
}

/// Whether `r` is a name git accepts for a ref (`git check-ref-format`'s rules, as far as a
/// manifest needs them).
fn valid_ref(r: &str) -> bool {
    let bad = r.is_empty()
        || r.ends_with('/')
        || r.ends_with(".lock")
        || r.contains("..")
        || r.contains("//")
        || r.contains("@{")
        || r.chars().any(|c| c.is_whitespace() || c.is_control() || "~^:?*[\\".contains(c));
    !bad
}

/// The file name an upstream ref is exported to: `pull/123/head` → `PR-123.patch`,
/// `merge-requests/7/head` → `MR-7.patch`, `refs/heads/fix` → `heads-fix.patch`.
pub fn ref_file_name(r: &str) -> String {
    let parts: Vec<&str> = r.split('/').collect();
    match parts.as_slice() {
        ["pull", n, "head"] => format!("PR-{n}.patch"),
        ["merge-requests", n, "head"] => format!("MR-{n}.patch"),
        _ => format!("{}.patch", r.strip_prefix("refs/").unwrap_or(r).replace('/', "-")),
    }
}

// ---- raw TOML shapes ----------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    root: Option<Spanned<String>>,
    #[serde(default)]
    sources: BTreeMap<String, Spanned<RawSource>>,
    #[serde(default)]
    bases: BTreeMap<String, Spanned<RawBase>>,
    #[serde(default)]
    wheels: BTreeMap<String, Spanned<super::wheels::RawWheel>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBase {
    image: Spanned<String>,
    tag: Spanned<String>,
    digest: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSource {
    url: Option<Spanned<String>>,
    tracking_ref: Option<Spanned<String>>,
    commit: Option<Spanned<String>>,
    #[serde(rename = "crate")]
    krate: Option<Spanned<String>>,
    version: Option<Spanned<String>>,
    tracking_req: Option<Spanned<String>>,
    registry: Option<Spanned<String>>,
    patches: Option<Spanned<Vec<Spanned<String>>>>,
}

impl Manifest {
    /// Reads and validates the manifest at `path`. Every error names `path:line:column`.
    pub fn load(path: &Path) -> Result<Manifest> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(bad_input(format!(
                    "manifest {} not found; run distro from the project root or pass --manifest FILE",
                    path.display()
                )));
            }
            Err(e) => return Err(bad_input(format!("reading {}: {e}", path.display()))),
        };
        Manifest::parse(path, &text)
    }

    /// Parses manifest `text`; `path` names the file in messages and anchors relative paths.
    pub fn parse(path: &Path, text: &str) -> Result<Manifest> {
        let err_at = |offset: usize, msg: &str| {
            let loc = Loc::at(text, offset);
            bad_input(format!("{}:{}:{}: {msg}", path.display(), loc.line, loc.column))
        };
        let raw: RawManifest = toml::from_str(text).map_err(|e| {
            let offset = e.span().map(|s| s.start).unwrap_or(0);
            err_at(offset, e.message().trim())
        })?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let root_rel = raw.root.as_ref().map(|r| r.get_ref().as_str()).unwrap_or("..");
        if let Some(r) = &raw.root
            && r.get_ref().is_empty()
        {
            return Err(err_at(r.span().start, "`root` must not be empty (use \".\" for the manifest's directory)"));
        }
        let root = lexical_join(&dir, Path::new(root_rel));

        let mut sources = BTreeMap::new();
        for (name, raw_source) in raw.sources {
            let table_offset = raw_source.span().start;
            let source = validate_source(&name, raw_source.into_inner(), table_offset, text)
                .map_err(|(offset, msg)| err_at(offset, &msg))?;
            sources.insert(name, source);
        }
        let mut bases = BTreeMap::new();
        for (name, raw_base) in raw.bases {
            let table = raw_base.span().start;
            let b = raw_base.into_inner();
            if !valid_name(&name) || sources.contains_key(&name) {
                return Err(err_at(
                    table,
                    &format!("base name `{name}` must be a name (letters, digits, `-`, `_`) no source uses"),
                ));
            }
            let plain = |v: &Spanned<String>, key: &str, extra: &dyn Fn(&str) -> bool| {
                let t = v.get_ref();
                if t.is_empty() || t.chars().any(|c| c.is_whitespace() || "@".contains(c)) || !extra(t) {
                    return Err(err_at(v.span().start, &format!("`{key}` of base `{name}` is not valid: {t:?}")));
                }
                Ok(t.clone())
            };
            let image = plain(&b.image, "image", &|t| {
                !t.contains(':') || t.split('/').next().is_some_and(|h| h.contains(':'))
            })?;
            let tag = plain(&b.tag, "tag", &|t| {
                t.len() <= 128
                    && t.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
                    && !t.starts_with(['.', '-'])
            })?;
            let digest = match &b.digest {
                Some(d) => Some(plain(d, "digest", &|t| {
                    t.strip_prefix("sha256:").is_some_and(|h| {
                        h.len() == 64 && h.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
                    })
                })?),
                None => None,
            };
            bases.insert(name.clone(), BaseSpec { name, image, tag, digest, loc: Loc::at(text, table) });
        }
        let mut wheels = BTreeMap::new();
        for (name, raw_wheel) in raw.wheels {
            let table = raw_wheel.span().start;
            let w = super::wheels::validate(&name, raw_wheel.into_inner(), table, text)
                .map_err(|(offset, msg)| err_at(offset, &msg))?;
            wheels.insert(name, w);
        }
        Ok(Manifest { path: path.to_path_buf(), root, sources, bases, wheels })
    }

    /// The lock file that belongs to this manifest: the same path with the `.lock` extension.
    pub fn lock_path(&self) -> PathBuf {
        self.path.with_extension("lock")
    }

    /// `path:line:column` of `loc`, for messages.
    pub fn at(&self, loc: Loc) -> String {
        format!("{}:{}:{}", self.path.display(), loc.line, loc.column)
    }

    /// The source named `name`, or a bad-input error listing the known names.
    pub fn source(&self, name: &str) -> Result<&Source> {
        self.sources.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.sources.keys().map(String::as_str).collect();
            bad_input(format!(
                "no source named `{name}` in {} (sources: {})",
                self.path.display(),
                if known.is_empty() { "none".into() } else { known.join(", ") }
            ))
        })
    }

    /// The sources named in `names` (all sources when `names` is empty), in name order.
    pub fn select(&self, names: &[String]) -> Result<Vec<&Source>> {
        if names.is_empty() {
            return Ok(self.sources.values().collect());
        }
        let wanted: BTreeSet<&str> = names.iter().map(String::as_str).collect();
        wanted.into_iter().map(|n| self.source(n)).collect()
    }

    /// Splits `names` into source names and base names: (sources, bases), where `None` selects
    /// no source and an empty list every source (as [`Manifest::select`] reads it). With no
    /// names, all of both; a name that is neither is bad input listing both.
    pub fn split_names(&self, names: &[String]) -> Result<(Option<Vec<String>>, Vec<String>)> {
        if names.is_empty() {
            return Ok((Some(Vec::new()), self.bases.keys().cloned().collect()));
        }
        let (bases, sources): (Vec<String>, Vec<String>) =
            names.iter().cloned().partition(|n| self.bases.contains_key(n));
        if !sources.is_empty() {
            self.select(&sources).map_err(|e| {
                if self.bases.is_empty() {
                    e
                } else {
                    let known: Vec<&str> = self.bases.keys().map(String::as_str).collect();
                    bad_input(format!("{e:#}; bases: {}", known.join(", ")))
                }
            })?;
        }
        Ok(((!sources.is_empty()).then_some(sources), bases))
    }

    /// A path relative to the project root, as a path usable from the current directory.
    pub fn project_path(&self, rel: &str) -> PathBuf {
        lexical_join(&self.root, Path::new(rel))
    }

    /// The URL git should fetch from: remote URLs unchanged, local paths made absolute
    /// (relative ones are relative to the project root).
    pub fn fetch_url(&self, url: &str) -> String {
        fetch_url(url, &self.root)
    }
}

/// Remote URLs unchanged; a local path made absolute, relative ones taken from `base`.
pub fn fetch_url(url: &str, base: &Path) -> String {
    if is_remote_url(url) {
        return url.to_owned();
    }
    let p = lexical_join(base, Path::new(url));
    let abs = if p.is_absolute() { p } else { std::env::current_dir().map(|d| lexical_join(&d, &p)).unwrap_or(p) };
    abs.canonicalize().unwrap_or(abs).to_string_lossy().into_owned()
}

/// True for URLs git reaches through a transport (`https://`, `ssh://`, `file://`, `host:path`),
/// false for plain local paths.
pub fn is_remote_url(url: &str) -> bool {
    if url.contains("://") {
        return true;
    }
    // scp-like syntax `[user@]host:path`: a colon before any slash (and not a drive letter).
    match url.find(':') {
        Some(i) => i > 1 && !url[..i].contains('/'),
        None => false,
    }
}

/// Joins `rel` onto `base`, resolving `.` and `..` lexically where `base` allows.
pub fn lexical_join(base: &Path, rel: &Path) -> PathBuf {
    if rel.is_absolute() {
        return rel.to_path_buf();
    }
    // "." adds nothing to a relative path but noise in messages ("./patches/...").
    let mut out = if base == Path::new(".") { PathBuf::new() } else { base.to_path_buf() };
    for c in rel.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                let last_is_normal = matches!(out.components().next_back(), Some(Component::Normal(_)));
                if last_is_normal {
                    out.pop();
                } else {
                    out.push("..");
                }
            }
            other => out.push(other.as_os_str()),
        }
    }
    if out.as_os_str().is_empty() {
        out.push(".");
    }
    out
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// True for an exact semantic version `MAJOR.MINOR.PATCH[-PRE][+BUILD]`.
pub fn is_exact_version(v: &str) -> bool {
    let (core, rest) = match v.find(['-', '+']) {
        Some(i) => (&v[..i], &v[i..]),
        None => (v, ""),
    };
    let nums: Vec<&str> = core.split('.').collect();
    nums.len() == 3
        && nums.iter().all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        && rest.chars().all(|c| c.is_ascii_alphanumeric() || "-+.".contains(c))
        && !rest.ends_with(['-', '+', '.'])
        && rest != "-"
}

type SpanError = (usize, String);

fn validate_source(name: &str, raw: RawSource, table: usize, text: &str) -> std::result::Result<Source, SpanError> {
    if !valid_name(name) {
        return Err((
            table,
            format!(
                "source name `{name}` must start with a letter or digit and contain only letters, digits, `-` and `_`"
            ),
        ));
    }
    let loc_of = |offset: usize| Loc::at(text, offset);
    let check_nonempty = |field: &Option<Spanned<String>>, key: &str| -> std::result::Result<(), SpanError> {
        match field {
            Some(v) if v.get_ref().trim().is_empty() || v.get_ref().trim() != v.get_ref() => Err((
                v.span().start,
                format!("`{key}` of source `{name}` must be non-empty, without surrounding spaces"),
            )),
            _ => Ok(()),
        }
    };
    for (field, key) in [
        (&raw.url, "url"),
        (&raw.tracking_ref, "tracking_ref"),
        (&raw.commit, "commit"),
        (&raw.krate, "crate"),
        (&raw.version, "version"),
        (&raw.tracking_req, "tracking_req"),
        (&raw.registry, "registry"),
    ] {
        check_nonempty(field, key)?;
    }

    let kind = match (&raw.url, &raw.krate) {
        (Some(_), Some(k)) => {
            return Err((
                k.span().start,
                format!("source `{name}` has both `url` and `crate`; a source is either a git repository or a crate"),
            ));
        }
        (None, None) => {
            return Err((
                table,
                format!("source `{name}` needs `url` (a git repository) or `crate` (a crate from a registry)"),
            ));
        }
        (Some(url), None) => {
            for (field, key) in
                [(&raw.version, "version"), (&raw.tracking_req, "tracking_req"), (&raw.registry, "registry")]
            {
                if let Some(f) = field {
                    return Err((
                        f.span().start,
                        format!(
                            "`{key}` is for crate sources; git source `{name}` uses `url`, `tracking_ref` and `commit`"
                        ),
                    ));
                }
            }
            let Some(tracking_ref) = &raw.tracking_ref else {
                return Err((
                    table,
                    format!(
                        "git source `{name}` needs `tracking_ref` (the branch `distro bump` follows, e.g. \"main\")"
                    ),
                ));
            };
            if !valid_ref(tracking_ref.get_ref()) || tracking_ref.get_ref().starts_with('-') {
                return Err((
                    tracking_ref.span().start,
                    format!("`tracking_ref` `{}` is not a valid git ref name", tracking_ref.get_ref()),
                ));
            }
            if url.get_ref().chars().any(char::is_whitespace) || url.get_ref().starts_with('-') {
                return Err((url.span().start, format!("`url` `{}` is not a git URL or path", url.get_ref())));
            }
            if let Some(c) = &raw.commit
                && !is_object_id(c.get_ref())
            {
                return Err((
                    c.span().start,
                    format!("`commit` must be a full commit id (40 lowercase hex digits), not `{}`", c.get_ref()),
                ));
            }
            SourceKind::Git(GitSpec {
                url: url.get_ref().clone(),
                tracking_ref: tracking_ref.get_ref().clone(),
                commit: raw.commit.as_ref().map(|c| c.get_ref().clone()),
                commit_loc: loc_of(raw.commit.as_ref().map(|c| c.span().start).unwrap_or(table)),
            })
        }
        (None, Some(krate)) => {
            for (field, key) in [(&raw.tracking_ref, "tracking_ref"), (&raw.commit, "commit")] {
                if let Some(f) = field {
                    return Err((
                        f.span().start,
                        format!(
                            "`{key}` is for git sources; crate source `{name}` uses `crate`, `version` and optionally `tracking_req` and `registry`"
                        ),
                    ));
                }
            }
            let crate_name = krate.get_ref();
            if !crate_name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
                return Err((krate.span().start, format!("`crate` `{crate_name}` is not a valid crate name")));
            }
            if let Some(v) = &raw.version
                && !is_exact_version(v.get_ref())
            {
                return Err((
                    v.span().start,
                    format!(
                        "`version` must be an exact version like \"1.2.3\", not `{}` (put requirements in `tracking_req`)",
                        v.get_ref()
                    ),
                ));
            }
            if let Some(r) = &raw.registry
                && !valid_name(r.get_ref())
            {
                return Err((
                    r.span().start,
                    format!("`registry` `{}` is not a registry name from Cargo's configuration", r.get_ref()),
                ));
            }
            SourceKind::Crate(CrateSpec {
                name: crate_name.clone(),
                version: raw.version.as_ref().map(|v| v.get_ref().clone()),
                version_loc: loc_of(raw.version.as_ref().map(|v| v.span().start).unwrap_or(table)),
                tracking_req: raw.tracking_req.as_ref().map(|r| r.get_ref().clone()).unwrap_or_else(|| "*".into()),
                registry: raw.registry.as_ref().map(|r| r.get_ref().clone()),
            })
        }
    };

    let mut patches = Vec::new();
    let mut seen_files = BTreeMap::new();
    for entry in raw.patches.map(Spanned::into_inner).unwrap_or_default() {
        let offset = entry.span().start;
        let spec = PatchSpec::parse(entry.get_ref(), name).map_err(|m| (offset, m))?;
        if matches!(spec, PatchSpec::Ref(_)) && matches!(kind, SourceKind::Crate(_)) {
            return Err((
                offset,
                format!(
                    "crate source `{name}` cannot take an upstream ref patch; export the change to a file under `patches/{name}/`"
                ),
            ));
        }
        if let Some(prev) = seen_files.insert(spec.file(name), spec.text().to_owned()) {
            return Err((offset, format!("patch `{}` is listed twice (it is the same file as `{prev}`)", spec.text())));
        }
        patches.push(PatchEntry { spec, loc: loc_of(offset) });
    }
    Ok(Source { name: name.to_owned(), kind, patches, loc: loc_of(table) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Manifest> {
        Manifest::parse(Path::new("images/manifest.toml"), text)
    }

    fn err(text: &str) -> String {
        format!("{:#}", parse(text).unwrap_err())
    }

    const C: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn parses_git_and_crate_sources() {
        let m = parse(&format!(
            r#"
[sources.foo]
url = "https://example.invalid/foo.git"
tracking_ref = "main"
commit = "{C}"
patches = ["patches/foo/0001-fix.patch", "pull/123/head"]

[sources.cudarc]
crate = "cudarc"
version = "0.19.10"
patches = []
"#
        ))
        .unwrap();
        assert_eq!(m.root, Path::new("."));
        assert_eq!(m.lock_path(), Path::new("images/manifest.lock"));
        let foo = &m.sources["foo"];
        let SourceKind::Git(g) = &foo.kind else { panic!() };
        assert_eq!(g.commit.as_deref(), Some(C));
        assert_eq!(g.commit_loc, Loc { line: 5, column: 10 });
        assert_eq!(foo.patches[1].spec, PatchSpec::Ref("pull/123/head".into()));
        assert_eq!(foo.patches[1].spec.file("foo"), "patches/foo/PR-123.patch");
        let SourceKind::Crate(c) = &m.sources["cudarc"].kind else { panic!() };
        assert_eq!((c.version.as_deref(), c.tracking_req.as_str()), (Some("0.19.10"), "*"));
    }

    #[test]
    fn syntax_errors_have_line_and_column() {
        let e = err("[sources.foo]\nurl = \"x\"\ntracking_ref = main\n");
        assert!(e.starts_with("images/manifest.toml:3:16: "), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }

    #[test]
    fn unknown_keys_are_rejected_with_position() {
        let e =
            err(&format!("[sources.foo]\nurl = \"x\"\ntracking_ref = \"main\"\ncommit = \"{C}\"\nbranch = \"dev\"\n"));
        assert!(e.starts_with("images/manifest.toml:5:1: unknown field `branch`"), "{e}");
        let e = err("[source.foo]\n");
        assert!(e.starts_with("images/manifest.toml:1:2: unknown field `source`"), "{e}");
    }

    #[test]
    fn semantic_errors_point_at_the_value() {
        let e = err("[sources.foo]\nurl = \"x\"\ntracking_ref = \"main\"\ncommit = \"abc\"\n");
        assert!(e.starts_with("images/manifest.toml:4:10: `commit` must be a full commit id"), "{e}");
        let e = err("[sources.c]\ncrate = \"c\"\nversion = \"^1.0\"\n");
        assert!(e.starts_with("images/manifest.toml:3:11: `version` must be an exact version"), "{e}");
        let e = err("[sources.foo]\nurl = \"x\"\n");
        assert!(e.contains("needs `tracking_ref`"), "{e}");
        let e = err("[sources.foo]\nurl = \"x\"\ncrate = \"y\"\n");
        assert!(e.contains("both `url` and `crate`"), "{e}");
        let e = err("[sources.foo]\nurl = \"x\"\ntracking_ref = \"main\"\npatches = [\"fix.patch\"]\n");
        assert!(
            e.starts_with(
                "images/manifest.toml:4:12: patch file `fix.patch` must be a relative path under `patches/foo/`"
            ),
            "{e}"
        );
        let e = err(
            "[sources.foo]\nurl = \"x\"\ntracking_ref = \"main\"\npatches = [\"pull/1/head\", \"patches/foo/PR-1.patch\"]\n",
        );
        assert!(e.contains("listed twice"), "{e}");
        let e = err("[sources.c]\ncrate = \"c\"\npatches = [\"pull/1/head\"]\n");
        assert!(e.contains("cannot take an upstream ref patch"), "{e}");
        let e = err("[sources.foo]\nurl = \"x\"\ntracking_ref = \"main\"\npatches = [\"fix\"]\n");
        assert!(e.contains("neither a patch file"), "{e}");
    }

    #[test]
    fn ref_file_names_follow_the_forge_conventions() {
        assert_eq!(ref_file_name("pull/123/head"), "PR-123.patch");
        assert_eq!(ref_file_name("merge-requests/7/head"), "MR-7.patch");
        assert_eq!(ref_file_name("refs/heads/fix/x"), "heads-fix-x.patch");
    }

    #[test]
    fn versions_and_urls() {
        assert!(is_exact_version("0.19.10"));
        assert!(is_exact_version("1.0.0-rc.1+build.5"));
        assert!(!is_exact_version("1.0"));
        assert!(!is_exact_version("^1.0.0"));
        assert!(is_remote_url("https://h/r.git"));
        assert!(is_remote_url("git@h:r.git"));
        assert!(is_remote_url("file:///tmp/r"));
        assert!(!is_remote_url("../up/r.git"));
        assert!(!is_remote_url("/tmp/x:y"));
    }

    #[test]
    fn root_is_resolved_lexically() {
        assert_eq!(lexical_join(Path::new("images"), Path::new("..")), Path::new("."));
        assert_eq!(lexical_join(Path::new("/p/images"), Path::new("../patches/x")), Path::new("/p/patches/x"));
        assert_eq!(lexical_join(Path::new("."), Path::new("..")), Path::new(".."));
        assert_eq!(lexical_join(Path::new("."), Path::new("patches/x")), Path::new("patches/x"));
        let m = Manifest::parse(Path::new("/p/m.toml"), "root = \".\"\n").unwrap();
        assert_eq!(m.root, Path::new("/p"));
    }
}
