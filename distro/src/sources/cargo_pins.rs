//! A crate source is pinned in three places: the manifest's `version`, the requirement of every
//! workspace `Cargo.toml` that depends on the crate, and the version in the workspace's
//! `Cargo.lock`. They must agree, or the image builds something other than what the lock records
//! (or the nightly fails on the first patch release). `distro sources` checks them against each
//! other ([`check`]); `distro bump` moves them together ([`requirement_edits`], then
//! [`update_cargo_lock`]).
//!
//! Requirements are matched as Cargo matches them (`=`, `^` or bare, `~`, `<`, `<=`, `>`, `>=`,
//! `*` and `x` wildcards, comma-separated); pre-release versions are not pins this tool makes.

use anyhow::{Context, Result};
use std::fs;
use std::path::{Path, PathBuf};

use super::manifest::{Manifest, SourceKind};
use crate::error::{bad_input, line_of};

/// One dependency on a crate in a workspace `Cargo.toml`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requirement {
    /// The `Cargo.toml`, relative to the project root (`engine/Cargo.toml`).
    pub file: String,
    /// 1-based line of the requirement.
    pub line: usize,
    /// The requirement as written (`=0.19.10`).
    pub req: String,
    /// Byte range of the requirement's string literal (quotes included) in the file.
    span: std::ops::Range<usize>,
}

/// The workspace's `Cargo.toml` files: the root's, and each member's (`members` entries, with a
/// trailing `/*` glob expanded), relative to `root`, in order.
fn workspace_manifests(root: &Path) -> Vec<String> {
    let Ok(text) = fs::read_to_string(root.join("Cargo.toml")) else { return Vec::new() };
    let mut out = vec!["Cargo.toml".to_owned()];
    let Ok(doc) = text.parse::<toml::Table>() else { return out };
    let members = doc.get("workspace").and_then(|w| w.get("members")).and_then(|m| m.as_array());
    for m in members.into_iter().flatten().filter_map(|m| m.as_str()) {
        let dirs: Vec<String> = match m.strip_suffix("/*") {
            Some(parent) => {
                let mut found: Vec<String> = fs::read_dir(root.join(parent))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|e| e.path().join("Cargo.toml").is_file())
                    .map(|e| format!("{parent}/{}", e.file_name().to_string_lossy()))
                    .collect();
                found.sort();
                found
            }
            None => vec![m.to_owned()],
        };
        out.extend(dirs.into_iter().map(|d| format!("{d}/Cargo.toml")).filter(|f| root.join(f).is_file()));
    }
    out
}

/// Every registry requirement on `krate` in the workspace's `Cargo.toml` files (`[dependencies]`,
/// dev-, build-, per-target, `[workspace.dependencies]`; renamed dependencies by `package`).
/// Dependencies by path or git, or inherited with `workspace = true`, have no requirement here.
pub fn requirements(root: &Path, krate: &str) -> Result<Vec<Requirement>> {
    let mut out = Vec::new();
    for file in workspace_manifests(root) {
        let text = fs::read_to_string(root.join(&file))?;
        let doc = toml_edit::Document::parse(text.clone())
            .map_err(|e| bad_input(format!("{file}: {}", e.message().trim())))?;
        let mut tables: Vec<&toml_edit::Item> = Vec::new();
        for kind in ["dependencies", "dev-dependencies", "build-dependencies"] {
            tables.extend(doc.get(kind));
            if let Some(targets) = doc.get("target").and_then(|t| t.as_table_like()) {
                tables.extend(targets.iter().filter_map(|(_, t)| t.get(kind)));
            }
        }
        tables.extend(doc.get("workspace").and_then(|w| w.get("dependencies")));
        for table in tables.iter().filter_map(|t| t.as_table_like()) {
            for (key, item) in table.iter() {
                let package = item.get("package").and_then(|p| p.as_str()).unwrap_or(key);
                if package != krate {
                    continue;
                }
                let value = if item.is_str() { Some(item) } else { item.get("version") };
                let Some(value) = value.and_then(|v| v.as_value()) else { continue };
                let (Some(req), Some(span)) = (value.as_str(), value.span()) else { continue };
                // A value's span covers its decoration too; narrow it to the string literal.
                let literal = &text[span.clone()];
                let start = span.start + literal.find(['"', '\'']).unwrap_or(0);
                let end = span.start + literal.rfind(['"', '\'']).map(|i| i + 1).unwrap_or(literal.len());
                out.push(Requirement {
                    file: file.clone(),
                    line: line_of(&text, start),
                    req: req.to_owned(),
                    span: start..end,
                });
            }
        }
    }
    Ok(out)
}

/// The versions of `krate` from a registry in the workspace's `Cargo.lock` (empty when the crate
/// is not a dependency, or there is no lock).
pub fn locked_versions(root: &Path, krate: &str) -> Vec<String> {
    let Ok(text) = fs::read_to_string(root.join("Cargo.lock")) else { return Vec::new() };
    let Ok(t) = text.parse::<toml::Table>() else { return Vec::new() };
    let packages = t.get("package").and_then(|p| p.as_array());
    packages
        .into_iter()
        .flatten()
        .filter(|p| p.get("name").and_then(|n| n.as_str()) == Some(krate))
        .filter(|p| {
            p.get("source")
                .and_then(|s| s.as_str())
                .is_some_and(|s| s.starts_with("registry+") || s.starts_with("sparse+"))
        })
        .filter_map(|p| p.get("version").and_then(|v| v.as_str()).map(String::from))
        .collect()
}

/// Every disagreement between the crate sources' pins, `Cargo.toml` requirements and
/// `Cargo.lock`, one line each, naming the file and line to fix.
pub fn check(manifest: &Manifest) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let manifest_name = manifest.path.display();
    for source in manifest.sources.values() {
        let SourceKind::Crate(c) = &source.kind else { continue };
        let Some(version) = &c.version else { continue };
        for r in requirements(&manifest.root, &c.name)? {
            if !matches(&r.req, version).with_context(|| format!("{}:{}", r.file, r.line))? {
                out.push(format!(
                    "{}:{}: requires {} `{}`, but {manifest_name} pins {} {version}: `distro bump` moves both; or make them agree",
                    r.file, r.line, c.name, r.req, c.name
                ));
            }
        }
        let locked = locked_versions(&manifest.root, &c.name);
        if !locked.is_empty() && !locked.contains(version) {
            out.push(format!(
                "Cargo.lock has {} {}, but {manifest_name} pins {} {version}: run `cargo update -p {} --precise {version}` (or `distro bump`)",
                c.name,
                locked.join(", "),
                c.name,
                c.name
            ));
        }
    }
    Ok(out)
}

/// The edited `Cargo.toml` files (path, new text) that move `krate`'s requirements from `old` to
/// `new`: an exact requirement (`=old`) becomes `=new`; one that already admits `new` is left as
/// it is; any other is bad input naming its file and line, since bump must not move the manifest
/// where Cargo will not follow.
pub fn requirement_edits(root: &Path, krate: &str, new: &str) -> Result<Vec<(PathBuf, String)>> {
    let mut by_file: Vec<(String, String)> = Vec::new();
    let reqs = requirements(root, krate)?;
    for r in reqs.iter().rev() {
        if matches(&r.req, new).with_context(|| format!("{}:{}", r.file, r.line))? {
            continue;
        }
        if !r.req.trim().starts_with('=') {
            return Err(bad_input(format!(
                "{}:{}: the requirement {krate} `{}` does not admit {new}, the version bump found; widen it, or narrow the source's tracking_req",
                r.file, r.line, r.req
            )));
        }
        let idx = match by_file.iter().position(|(f, _)| *f == r.file) {
            Some(i) => i,
            None => {
                by_file.push((r.file.clone(), fs::read_to_string(root.join(&r.file))?));
                by_file.len() - 1
            }
        };
        // Requirements are visited last to first, so earlier spans stay valid.
        by_file[idx].1.replace_range(r.span.clone(), &format!("\"={new}\""));
    }
    Ok(by_file.into_iter().map(|(f, t)| (root.join(f), t)).collect())
}

/// Moves `krate` from `old` to `new` in the workspace's `Cargo.lock` with
/// `cargo update -p krate@old --precise new` (nothing when the lock does not hold `old`).
pub fn update_cargo_lock(root: &Path, krate: &str, old: &str, new: &str) -> Result<bool> {
    if !locked_versions(root, krate).iter().any(|v| v == old) {
        return Ok(false);
    }
    let spec = format!("{krate}@{old}");
    super::crates::cargo(
        root,
        root,
        "update",
        &["--quiet", "-p", &spec, "--precise", new],
        &format!("moving {krate} to {new} in Cargo.lock"),
    )?;
    Ok(true)
}

// ---- Cargo's requirement syntax ---------------------------------------------------------------

type Version = (u64, u64, u64);

fn parse_version(v: &str) -> Result<Version> {
    let core = v.split(['-', '+']).next().unwrap_or(v);
    let parts: Vec<&str> = core.split('.').collect();
    let num = |s: &str| s.parse::<u64>().map_err(|_| bad_input(format!("`{v}` is not a version")));
    match parts.as_slice() {
        [a, b, c] => Ok((num(a)?, num(b)?, num(c)?)),
        _ => Err(bad_input(format!("`{v}` is not a version"))),
    }
}

/// Whether `version` satisfies Cargo requirement `req`; a malformed version or requirement is
/// bad input (the caller names the file and line it came from).
pub fn matches(req: &str, version: &str) -> Result<bool> {
    let v = parse_version(version)?;
    for comparator in req.split(',') {
        if !comparator_matches(comparator.trim(), v).with_context(|| format!("requirement `{req}`"))? {
            return Ok(false);
        }
    }
    Ok(true)
}

fn comparator_matches(c: &str, v: Version) -> Result<bool> {
    let (op, rest) = ["<=", ">=", "=", "<", ">", "^", "~"]
        .iter()
        .find_map(|op| c.strip_prefix(op).map(|r| (*op, r.trim())))
        .unwrap_or(("^", c));
    let rest = rest.split(['-', '+']).next().unwrap_or(rest);
    if rest == "*" || rest.is_empty() {
        return Ok(op == "^" || op == "=" || op == ">=" || op == "<=");
    }
    let mut parts: Vec<Option<u64>> = Vec::new();
    for p in rest.split('.') {
        parts.push(match p {
            "*" | "x" | "X" => None,
            n => Some(n.parse::<u64>().map_err(|_| bad_input(format!("`{c}` is not a comparator")))?),
        });
    }
    if parts.len() > 3 || parts.first().copied().flatten().is_none() {
        return Err(bad_input(format!("`{c}` is not a comparator")));
    }
    let (major, minor, patch) = (parts[0].unwrap(), parts.get(1).copied().flatten(), parts.get(2).copied().flatten());
    // The lowest version the comparator names and the first above its partial range.
    let low = (major, minor.unwrap_or(0), patch.unwrap_or(0));
    let above_partial = match (minor, patch) {
        (None, _) => (major + 1, 0, 0),
        (Some(mi), None) => (major, mi + 1, 0),
        (Some(mi), Some(pa)) => (major, mi, pa + 1),
    };
    Ok(match op {
        "=" => v >= low && v < above_partial,
        ">" => v >= above_partial,
        ">=" => v >= low,
        "<" => v < low,
        "<=" => v < above_partial,
        "~" => {
            let upper = match minor {
                None => (major + 1, 0, 0),
                Some(mi) => (major, mi + 1, 0),
            };
            v >= low && v < upper
        }
        _ => {
            // Caret: the leftmost non-zero part may not change.
            let upper = match (major, minor, patch) {
                (0, Some(0), Some(pa)) => (0, 0, pa + 1),
                (0, Some(mi), _) => (0, mi + 1, 0),
                _ => (major + 1, 0, 0),
            };
            v >= low && v < upper
        }
    })
}

impl Requirement {
    /// `file:line`, for messages.
    pub fn at(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requirements_match_as_cargo_matches_them() {
        let yes = [
            ("=0.19.10", "0.19.10"),
            ("0.19", "0.19.11"),
            ("0.19.10", "0.19.12"),
            ("^1.2", "1.9.0"),
            ("~1.2.3", "1.2.9"),
            ("*", "3.0.0"),
            (">=0.19, <0.20", "0.19.3"),
            ("0.0.3", "0.0.3"),
            ("0.19.*", "0.19.4"),
            ("=0.19", "0.19.4"),
        ];
        for (r, v) in yes {
            assert!(matches(r, v).unwrap(), "{r} {v}");
        }
        let no = [
            ("=0.19.10", "0.19.11"),
            ("0.19", "0.20.0"),
            ("^1.2", "2.0.0"),
            ("~1.2.3", "1.3.0"),
            ("0.0.3", "0.0.4"),
            (">=0.19, <0.20", "0.20.0"),
            ("<0.19.10", "0.19.10"),
        ];
        for (r, v) in no {
            assert!(!matches(r, v).unwrap(), "{r} {v}");
        }
        let e = matches("banana", "1.0.0").unwrap_err();
        assert!(crate::error::is_bad_input(&e), "{e:#}");
        assert_eq!(format!("{e:#}"), "requirement `banana`: `banana` is not a comparator");
    }

    fn workspace(dir: &Path, req: &str, locked: &str) {
        fs::create_dir_all(dir.join("eng")).unwrap();
        fs::write(dir.join("Cargo.toml"), "[workspace]\nmembers = [\"eng\"]\n").unwrap();
        fs::write(
            dir.join("eng/Cargo.toml"),
            format!(
                "[package]\nname = \"eng\"\n\n[dependencies]\nserde = \"1\"\nfoo = {{ version = \"{req}\", default-features = false }}\n\n[target.'cfg(unix)'.dev-dependencies]\nbar = {{ package = \"foo\", version = \"{req}\" }}\n"
            ),
        )
        .unwrap();
        fs::write(
            dir.join("Cargo.lock"),
            format!(
                "version = 4\n\n[[package]]\nname = \"foo\"\nversion = \"{locked}\"\nsource = \"registry+https://github.com/rust-lang/crates.io-index\"\n"
            ),
        )
        .unwrap();
    }

    fn manifest(dir: &Path, version: &str) -> Manifest {
        let text = format!("root = \".\"\n[sources.foo]\ncrate = \"foo\"\nversion = \"{version}\"\n");
        Manifest::parse(&dir.join("manifest.toml"), &text).unwrap()
    }

    #[test]
    fn finds_every_requirement_and_checks_the_three_pins() {
        let dir = tempfile::tempdir().unwrap();
        workspace(dir.path(), "=1.0.0", "1.0.0");
        let reqs = requirements(dir.path(), "foo").unwrap();
        let at: Vec<String> = reqs.iter().map(Requirement::at).collect();
        assert_eq!(at, ["eng/Cargo.toml:6", "eng/Cargo.toml:9"]);
        assert!(check(&manifest(dir.path(), "1.0.0")).unwrap().is_empty());

        let problems = check(&manifest(dir.path(), "1.0.1")).unwrap();
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].starts_with("eng/Cargo.toml:6: requires foo `=1.0.0`, but"), "{}", problems[0]);
        assert!(problems[2].starts_with("Cargo.lock has foo 1.0.0, but"), "{}", problems[2]);
    }

    #[test]
    fn bump_edits_exact_requirements_and_refuses_narrow_ones() {
        let dir = tempfile::tempdir().unwrap();
        workspace(dir.path(), "=1.0.0", "1.0.0");
        let edits = requirement_edits(dir.path(), "foo", "1.0.1").unwrap();
        assert_eq!(edits.len(), 1);
        let text = &edits[0].1;
        assert!(text.contains("foo = { version = \"=1.0.1\", default-features = false }"), "{text}");
        assert!(text.contains("bar = { package = \"foo\", version = \"=1.0.1\" }"), "{text}");
        assert!(text.contains("serde = \"1\""));

        workspace(dir.path(), "~1.0", "1.0.0");
        assert!(requirement_edits(dir.path(), "foo", "1.0.1").unwrap().is_empty());
        let err = requirement_edits(dir.path(), "foo", "1.1.0").unwrap_err();
        assert!(crate::error::is_bad_input(&err));
        assert!(
            err.to_string().starts_with("eng/Cargo.toml:9: the requirement foo `~1.0` does not admit 1.1.0"),
            "{err}"
        );
    }
}
