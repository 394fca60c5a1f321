//! Image definitions: `images/<name>.toml`, one per flavor (see docs/images.md).
use crate::error::{bad_input, line_of};
use crate::oci::platform::Platform;
use crate::registry::reference::Reference;
use anyhow::Result;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;
use toml::Spanned;

/// A parsed and validated image definition.
#[derive(Clone, Debug)]
pub struct ImageDef {
    /// Image name; tags are `NAME` and `NAME-YYYY-MM-DD`.
    pub name: String,
    /// One line for `org.opencontainers.image.description`.
    pub description: String,
    /// Platforms built by default.
    pub platforms: Vec<Platform>,
    /// The base image: a reference (production: pinned by digest), or a base the manifest
    /// tracks (`base = { source = "NAME" }`: `[bases.NAME]` of images/manifest.toml).
    pub base: BaseRef,
    /// The image's default command (`CMD`).
    pub cmd: Vec<String>,
    /// Entrypoint; `None` keeps the base image's.
    pub entrypoint: Option<Vec<String>>,
    /// The image's working directory (`WORKDIR`), if set.
    pub workdir: Option<String>,
    /// Binaries built from the workspace.
    pub binaries: Vec<Binary>,
    /// Small files written from the definition itself.
    pub files: Vec<InlineFile>,
    /// Directories copied from the workspace.
    pub trees: Vec<Tree>,
    /// Directories copied from pinned, patched upstream sources (content that is not a crate).
    pub source_trees: Vec<SourceTree>,
    /// Baked-in environment, in key order.
    pub env: BTreeMap<String, EnvVar>,
    /// Extra labels (the `org.opencontainers.image.*` annotations are added by the build).
    pub labels: BTreeMap<String, String>,
    /// The most each platform's image may weigh (`[budget]`).
    pub budget: super::size::Budget,
    /// Pinned wheels (`[wheels.NAME]` of images/manifest.toml) whose shared libraries are
    /// unpacked into the image, one layer each (`image::wheels`).
    pub wheels: Vec<String>,
}

/// Where an image definition's base comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BaseRef {
    /// A registry reference written in the definition.
    Image(Reference),
    /// A base of images/manifest.toml, by name (pinned, bumped and locked there).
    Source(String),
}

impl ImageDef {
    /// The base's registry reference: the definition's own, or the manifest base's
    /// `IMAGE:TAG@DIGEST` (read from `root`/images/manifest.toml, which must pin its digest).
    pub fn base_reference(&self, root: &Path) -> Result<Reference> {
        let name = match &self.base {
            BaseRef::Image(r) => return Ok(r.clone()),
            BaseRef::Source(name) => name,
        };
        let path = root.join(crate::sources::DEFAULT_MANIFEST);
        let manifest = crate::sources::Manifest::load(&path)?;
        let base = manifest.bases.get(name).ok_or_else(|| {
            bad_input(format!(
                "images/{}.toml: base: {} has no [bases.{name}] (bases: {})",
                self.name,
                path.display(),
                manifest.bases.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })?;
        if base.digest.is_none() {
            return Err(bad_input(format!(
                "{}: base `{name}` has no digest; run `distro bump {name}` to pin it",
                path.display()
            )));
        }
        Reference::parse(&base.reference()).map_err(|e| bad_input(format!("{}: base `{name}`: {e:#}", path.display())))
    }
}

/// A binary target built with cargo and installed at `dest`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Binary {
    /// Cargo package that holds the binary target.
    pub package: String,
    /// Binary target name (defaults to the package name).
    #[serde(default)]
    pub bin: Option<String>,
    /// Absolute path in the image.
    pub dest: String,
}

impl Binary {
    /// The binary target name.
    pub fn bin_name(&self) -> &str {
        self.bin.as_deref().unwrap_or(&self.package)
    }
}

/// A file whose content is written in the definition (e.g. the `test-all` wrapper).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InlineFile {
    /// Absolute path in the image.
    pub dest: String,
    /// Permission bits in the image (default 0644).
    #[serde(default = "default_file_mode")]
    pub mode: u32,
    /// The file's content, written as is.
    pub content: String,
}

fn default_file_mode() -> u32 {
    0o644
}

/// A workspace directory copied into the image (git-tracked files only).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tree {
    /// Directory relative to the workspace root.
    pub src: String,
    /// Absolute path in the image.
    pub dest: String,
    /// When true, a missing `src` adds nothing instead of failing.
    #[serde(default)]
    pub optional: bool,
}

/// A directory of a pinned upstream source (as patched, from images/manifest.toml) copied into
/// the image: for content that is not built with cargo (scripts, data, configuration).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceTree {
    /// Source name in images/manifest.toml.
    pub source: String,
    /// Directory inside the source tree (default: the whole tree).
    #[serde(default)]
    pub src: String,
    /// Absolute path in the image.
    pub dest: String,
}

/// One baked-in environment variable and why it is set (docs/flags.md lists them all).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EnvVar {
    /// The value baked into the image's environment.
    pub value: String,
    /// Why it is set; required, so no flag is baked in without a reason.
    pub reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    name: Spanned<String>,
    description: String,
    platforms: Vec<Spanned<String>>,
    base: Spanned<RawBaseRef>,
    cmd: Vec<String>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    workdir: Option<Spanned<String>>,
    #[serde(default)]
    binary: Vec<Spanned<Binary>>,
    #[serde(default)]
    file: Vec<Spanned<InlineFile>>,
    #[serde(default)]
    tree: Vec<Spanned<Tree>>,
    #[serde(default)]
    source_tree: Vec<Spanned<SourceTree>>,
    #[serde(default)]
    env: BTreeMap<String, Spanned<EnvVar>>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    budget: super::size::Budget,
    #[serde(default)]
    wheels: Vec<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawBaseRef {
    Image(String),
    Source { source: String },
}

/// Variables the image must never set: they belong to the user (a baked value would be a
/// silent replace-all of what they pass).
pub const RESERVED_ENV: &[&str] = &["ENGINE_FLAGS"];

impl ImageDef {
    /// Reads and validates `path`; errors name the file, line and key.
    pub fn load(path: &Path) -> Result<ImageDef> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad_input(format!("{}: cannot read image definition: {e}", path.display())))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses definition text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<ImageDef> {
        let raw: Raw = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| format!(":{}", line_of(text, s.start))).unwrap_or_default();
            bad_input(format!("{origin}{line}: {}", e.message().trim()))
        })?;
        let at = |span: std::ops::Range<usize>, key: &str, msg: String| {
            bad_input(format!("{origin}:{}: {key}: {msg}", line_of(text, span.start)))
        };

        let name = raw.name.get_ref().clone();
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') {
            return Err(at(raw.name.span(), "name", format!("{name:?} must be lowercase letters, digits and '-'")));
        }
        let mut platforms = Vec::new();
        for p in &raw.platforms {
            let platform = Platform::parse(p.get_ref()).map_err(|e| at(p.span(), "platforms", e.to_string()))?;
            if platforms.contains(&platform) {
                return Err(at(p.span(), "platforms", format!("{} is listed twice", p.get_ref())));
            }
            platforms.push(platform);
        }
        if platforms.is_empty() {
            return Err(bad_input(format!("{origin}: platforms: at least one platform is needed")));
        }
        let base = match raw.base.get_ref() {
            RawBaseRef::Image(r) => {
                BaseRef::Image(Reference::parse(r).map_err(|e| at(raw.base.span(), "base", format!("{e:#}")))?)
            }
            RawBaseRef::Source { source } => BaseRef::Source(source.clone()),
        };
        if raw.cmd.is_empty() {
            return Err(bad_input(format!("{origin}: cmd: the default command cannot be empty")));
        }
        let workdir = match raw.workdir {
            Some(w) if !w.get_ref().starts_with('/') => {
                return Err(at(w.span(), "workdir", format!("{:?} must be absolute", w.get_ref())));
            }
            w => w.map(Spanned::into_inner),
        };
        let mut dests: BTreeMap<String, ()> = BTreeMap::new();
        let mut check_dest = |span: std::ops::Range<usize>, key: &str, dest: &str| -> Result<()> {
            if !dest.starts_with('/') || dest.split('/').skip(1).any(|c| c.is_empty() || c == "." || c == "..") {
                return Err(at(span, key, format!("dest {dest:?} must be a clean absolute path")));
            }
            if dest.starts_with("/opt/distro") {
                return Err(at(span, key, format!("dest {dest:?}: /opt/distro is written by the build itself")));
            }
            if dests.insert(dest.to_string(), ()).is_some() {
                return Err(at(span, key, format!("dest {dest:?} is used twice")));
            }
            Ok(())
        };
        let mut binaries = Vec::new();
        for b in raw.binary {
            check_dest(b.span(), "binary", &b.get_ref().dest)?;
            binaries.push(b.into_inner());
        }
        let mut files = Vec::new();
        for f in raw.file {
            check_dest(f.span(), "file", &f.get_ref().dest)?;
            if f.get_ref().mode > 0o777 {
                return Err(at(f.span(), "file.mode", format!("{:o} is not a permission mode", f.get_ref().mode)));
            }
            files.push(f.into_inner());
        }
        let mut trees = Vec::new();
        for t in raw.tree {
            check_dest(t.span(), "tree", &t.get_ref().dest)?;
            let src = &t.get_ref().src;
            if src.starts_with('/') || src.split('/').any(|c| c == "..") {
                return Err(at(t.span(), "tree.src", format!("{src:?} must be relative to the workspace")));
            }
            trees.push(t.into_inner());
        }
        let mut source_trees = Vec::new();
        for t in raw.source_tree {
            check_dest(t.span(), "source_tree", &t.get_ref().dest)?;
            let src = &t.get_ref().src;
            if src.starts_with('/') || src.split('/').any(|c| c == "..") {
                return Err(at(t.span(), "source_tree.src", format!("{src:?} must be relative to the source's tree")));
            }
            source_trees.push(t.into_inner());
        }
        let mut env = BTreeMap::new();
        for (k, v) in raw.env {
            let valid = !k.is_empty()
                && !k.starts_with(|c: char| c.is_ascii_digit())
                && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !valid {
                return Err(at(v.span(), &format!("env.{k}"), "not a valid variable name".into()));
            }
            if RESERVED_ENV.contains(&k.as_str()) {
                return Err(at(
                    v.span(),
                    &format!("env.{k}"),
                    "is the user's variable; put the image's defaults in ENGINE_DEFAULT_FLAGS".into(),
                ));
            }
            if v.get_ref().reason.trim().is_empty() {
                return Err(at(v.span(), &format!("env.{k}.reason"), "every baked-in flag needs a reason".into()));
            }
            env.insert(k, v.into_inner());
        }
        let mut wheels: Vec<String> = Vec::new();
        for w in raw.wheels {
            if wheels.contains(w.get_ref()) {
                return Err(at(w.span(), "wheels", format!("{:?} is listed twice", w.get_ref())));
            }
            wheels.push(w.into_inner());
        }
        Ok(ImageDef {
            wheels,
            name,
            description: raw.description,
            platforms,
            base,
            cmd: raw.cmd,
            entrypoint: raw.entrypoint,
            workdir,
            binaries,
            files,
            trees,
            source_trees,
            env,
            labels: raw.labels,
            budget: raw.budget,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r##"
name = "engine"
description = "d"
platforms = ["linux/amd64", "linux/arm64"]
base = "localhost:5000/debian@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
cmd = ["engine", "info"]

[[binary]]
package = "engine"
dest = "/usr/local/bin/engine"

[[file]]
dest = "/usr/local/bin/test-all"
mode = 0o755
content = "#!/bin/sh\n"

[env.NCCL_DEBUG]
value = "WARN"
reason = "show warnings"
"##;

    #[test]
    fn parses_the_good_one() {
        let d = ImageDef::parse(GOOD, "x.toml").unwrap();
        assert_eq!(d.platforms.len(), 2);
        assert_eq!(d.files[0].mode, 0o755);
        assert_eq!(d.binaries[0].bin_name(), "engine");
        assert_eq!(d.env["NCCL_DEBUG"].value, "WARN");
    }

    fn err(text: &str) -> String {
        let e = ImageDef::parse(text, "x.toml").unwrap_err();
        assert!(crate::error::is_bad_input(&e));
        format!("{e:#}")
    }

    #[test]
    fn errors_name_line_and_key() {
        let e = err(&GOOD.replace("linux/arm64\"", "linux/s390x\""));
        assert!(e.starts_with("x.toml:4: platforms:"), "{e}");
        let e = err(&GOOD.replace("[env.NCCL_DEBUG]", "[env.ENGINE_FLAGS]"));
        assert!(e.contains("x.toml:17: env.ENGINE_FLAGS"), "{e}");
        let e = err(&GOOD.replace("cmd = ", "cmdd = "));
        assert!(e.starts_with("x.toml:"), "{e}");
        assert!(e.contains("cmdd"), "{e}");
        let e = err(&GOOD.replace("reason = \"show warnings\"", "reason = \" \""));
        assert!(e.contains("reason"), "{e}");
        let e = err(&GOOD.replace("/usr/local/bin/test-all", "/usr/local/bin/engine"));
        assert!(e.contains("used twice"), "{e}");
        let e = err(&GOOD.replace("@sha256:e3b0", "@sha256:zzzz"));
        assert!(e.starts_with("x.toml:5: base:"), "{e}");
        let e = err(&GOOD.replace("base = \"", "base = { sorce = \"cuda\" }\nx = \""));
        assert!(e.starts_with("x.toml:5:"), "{e}");
    }

    #[test]
    fn a_budget_is_read_and_its_keys_checked() {
        let d = ImageDef::parse(&format!("{GOOD}\n[budget]\ncompressed_mib = 10\n"), "x.toml").unwrap();
        assert_eq!(d.budget, crate::image::size::Budget { compressed_mib: Some(10), uncompressed_mib: None });
        let e = err(&format!("{GOOD}\n[budget]\ncompresed_mib = 10\n"));
        assert!(e.starts_with("x.toml:") && e.contains("compresed_mib"), "{e}");
    }

    #[test]
    fn a_base_from_the_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let text = GOOD.replace("base = \"localhost", "base = { source = \"deb\" }\nlabels.x = \"localhost");
        let d = ImageDef::parse(&text, "x.toml").unwrap();
        assert_eq!(d.base, BaseRef::Source("deb".into()));
        std::fs::create_dir_all(dir.path().join("images")).unwrap();
        let m = dir.path().join("images/manifest.toml");
        std::fs::write(&m, "[bases.deb]\nimage = \"localhost:5000/debian\"\ntag = \"trixie\"\n").unwrap();
        let e = format!("{:#}", d.base_reference(dir.path()).unwrap_err());
        assert!(e.contains("base `deb` has no digest; run `distro bump deb`"), "{e}");
        let digest = format!("sha256:{}", "e".repeat(64));
        std::fs::write(
            &m,
            format!("[bases.deb]\nimage = \"localhost:5000/debian\"\ntag = \"trixie\"\ndigest = \"{digest}\"\n"),
        )
        .unwrap();
        let r = d.base_reference(dir.path()).unwrap();
        assert_eq!(r.to_string(), format!("localhost:5000/debian:trixie@{digest}"));
        std::fs::write(&m, "").unwrap();
        let e = format!("{:#}", d.base_reference(dir.path()).unwrap_err());
        assert!(e.contains("has no [bases.deb]"), "{e}");
    }

    #[test]
    fn wheels_are_listed_once() {
        let d = ImageDef::parse(&GOOD.replace("cmd = ", "wheels = [\"nvrtc\", \"cublas\"]\ncmd = "), "x.toml").unwrap();
        assert_eq!(d.wheels, ["nvrtc", "cublas"]);
        let e = err(&GOOD.replace("cmd = ", "wheels = [\"nvrtc\", \"nvrtc\"]\ncmd = "));
        assert!(e.starts_with("x.toml:6: wheels:") && e.contains("listed twice"), "{e}");
    }

    #[test]
    fn source_trees_parse_and_are_checked() {
        let with = format!("{GOOD}\n[[source_tree]]\nsource = \"probe\"\nsrc = \"bin\"\ndest = \"/opt/probe\"\n");
        let d = ImageDef::parse(&with, "x.toml").unwrap();
        assert_eq!((d.source_trees[0].source.as_str(), d.source_trees[0].src.as_str()), ("probe", "bin"));
        let e = err(&with.replace("src = \"bin\"", "src = \"../x\""));
        assert!(e.contains("source_tree.src"), "{e}");
        let e = err(&with.replace("/opt/probe", "/usr/local/bin/engine"));
        assert!(e.contains("used twice"), "{e}");
    }
}
