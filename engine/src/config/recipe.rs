//! Recipes: TOML layers merged into a [`Config`].
//!
//! Layers apply in this order, a later one winning key by key:
//! defaults, the `extends` chain (base first), the recipe itself, then overrides
//! (`ENGINE_DEFAULT_FLAGS`, `ENGINE_FLAGS`, the command line's `--set` and `--steps`).
//! Each layer is checked on its own before merging, so an unknown or ill-typed key is reported
//! where it was written: `file:line:column` for files, the flag text for overrides.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use toml::{Table, Value};

use super::Config;

mod builtin {
    include!(concat!(env!("OUT_DIR"), "/recipes.rs"));
}

/// The recipes compiled into the binary: (name, TOML text), sorted by name.
pub fn builtin() -> &'static [(&'static str, &'static str)] {
    builtin::BUILTIN
}

/// One `key=value` override and where it came from (`--set`, `ENGINE_FLAGS`, ...).
#[derive(Debug, Clone)]
pub struct Override {
    /// Dotted key and value, e.g. `model.d_model=2048`.
    pub text: String,
    /// Where it was given, for error messages.
    pub origin: String,
}

impl Override {
    /// Splits a whitespace-separated list of `key=value` overrides (the `ENGINE_FLAGS` form).
    pub fn from_list(list: &str, origin: &str) -> Vec<Override> {
        list.split_whitespace().map(|text| Override { text: text.to_owned(), origin: origin.to_owned() }).collect()
    }
}

/// Where a key's value was set: the layer that wrote it last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A built-in recipe, by name: the one resolved or one it extends.
    Builtin(String),
    /// A recipe file, by its path.
    File(PathBuf),
    /// An override.
    Override {
        /// Where it was given: `--set`, `ENGINE_FLAGS`, ...
        from: String,
        /// Its `key=value` text.
        text: String,
    },
}

impl Origin {
    /// Whether a recipe (built-in or file) set the value, rather than an override.
    pub fn is_recipe(&self) -> bool {
        !matches!(self, Origin::Override { .. })
    }
}

/// As messages name it: `recipe NAME`, `recipe PATH`, `--set key=value`.
impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Builtin(name) => write!(f, "recipe {name}"),
            Origin::File(path) => write!(f, "recipe {}", path.display()),
            Origin::Override { from, text } => write!(f, "{from} {text}"),
        }
    }
}

/// A recipe resolved into a validated configuration.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The recipe's name: a built-in name, or the file stem.
    pub name: String,
    /// The merged, validated configuration.
    pub config: Config,
    /// For every key set by some layer (dotted), the layer that set it last.
    pub provenance: BTreeMap<String, Origin>,
}

/// Resolves a recipe (built-in name or TOML file path) with overrides, and validates the result.
pub fn resolve(recipe: &str, overrides: &[Override]) -> Result<Resolved> {
    let (name, source) = locate(recipe, None)?;
    let mut layers = Vec::new();
    load_chain(source, &mut layers, &mut Vec::new())?;
    for o in overrides {
        let origin = Origin::Override { from: o.origin.clone(), text: o.text.clone() };
        let table = override_table(&o.text).with_context(|| origin.to_string())?;
        check_layer_table(&table).with_context(|| origin.to_string())?;
        layers.push((origin, table));
    }

    let mut merged = Table::new();
    let mut provenance = BTreeMap::new();
    for (origin, table) in &layers {
        merge(&mut merged, table, "", origin, &mut provenance);
    }
    let config = Config::deserialize(Value::Table(merged)).map_err(|e| anyhow!("recipe `{name}`: {}", e.message()))?;
    config.validate().map_err(|message| {
        // Say where the keys the message names were set, when an override set them.
        let message = message.to_string();
        let mut origins: Vec<String> = provenance
            .iter()
            .filter(|(key, origin)| message.contains(key.as_str()) && !origin.is_recipe())
            .map(|(key, origin)| format!("{key} from {origin}"))
            .collect();
        origins.dedup();
        let suffix = if origins.is_empty() { String::new() } else { format!(" ({})", origins.join("; ")) };
        anyhow!("recipe `{name}`: {message}{suffix}")
    })?;
    Ok(Resolved { name, config, provenance })
}

/// Where a recipe's text comes from.
enum Source {
    Builtin { name: String, text: &'static str },
    File(PathBuf),
}

/// Finds a recipe: a path to a TOML file (relative to `base_dir` for `extends`), or a built-in name.
fn locate(reference: &str, base_dir: Option<&Path>) -> Result<(String, Source)> {
    let looks_like_path = reference.ends_with(".toml") || reference.contains('/');
    if looks_like_path {
        let path = match base_dir {
            Some(dir) => dir.join(reference),
            None => PathBuf::from(reference),
        };
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or(reference).to_owned();
        return Ok((name, Source::File(path)));
    }
    match builtin().iter().find(|(name, _)| *name == reference) {
        Some((name, text)) => Ok((name.to_string(), Source::Builtin { name: name.to_string(), text })),
        None => {
            let hint = closest(reference).map(|n| format!(" (did you mean `{n}`?)")).unwrap_or_default();
            bail!(
                "unknown recipe `{reference}`{hint}; `engine recipes list` shows the {} built-in recipes, or pass a path to a .toml file",
                builtin().len()
            )
        }
    }
}

/// The built-in recipe name closest to `name` by edit distance, if it is close enough to be a typo.
fn closest(name: &str) -> Option<&'static str> {
    let distance = |a: &str, b: &str| {
        let b: Vec<char> = b.chars().collect();
        let mut row: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut prev = row[0];
            row[0] = i + 1;
            for j in 0..b.len() {
                let cur = row[j + 1];
                row[j + 1] = (prev + usize::from(ca != b[j])).min(row[j] + 1).min(cur + 1);
                prev = cur;
            }
        }
        row[b.len()]
    };
    builtin()
        .iter()
        .map(|(n, _)| (distance(name, n), *n))
        .filter(|(d, n)| *d <= 3.max(n.len() / 4))
        .min()
        .map(|(_, n)| n)
}

/// Loads a recipe and, first, the recipes it extends; pushes their layers base first.
fn load_chain(source: Source, layers: &mut Vec<(Origin, Table)>, seen: &mut Vec<Origin>) -> Result<()> {
    let (origin, where_, text, dir) = match source {
        Source::Builtin { name, text } => (Origin::Builtin(name.clone()), name, text.to_owned(), None),
        Source::File(path) => {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read recipe file {}", path.display()))?;
            let dir = path.parent().map(Path::to_path_buf);
            (Origin::File(path.clone()), path.display().to_string(), text, dir)
        }
    };
    if seen.contains(&origin) {
        let chain: Vec<String> = seen.iter().map(Origin::to_string).collect();
        bail!("{origin}: `extends` forms a cycle: {} -> {origin}", chain.join(" -> "));
    }
    seen.push(origin.clone());
    let table = parse_layer(&text, &where_)?;
    if let Some(parent) = table.get("extends").and_then(Value::as_str) {
        let (_, parent_source) = locate(parent, dir.as_deref()).with_context(|| format!("{where_}: extends"))?;
        load_chain(parent_source, layers, seen)?;
    }
    layers.push((origin, table));
    Ok(())
}

/// Parses one TOML layer (of recipe `where_`, a name or a path) and checks its keys and types;
/// errors read `where_:line:column: message`.
fn parse_layer(text: &str, where_: &str) -> Result<Table> {
    let located = |e: toml::de::Error| {
        let (line, column) = match e.span() {
            Some(span) => line_column(text, span.start),
            None => (1, 1),
        };
        anyhow!("{where_}:{line}:{column}: {}", e.message())
    };
    toml::from_str::<Config>(text).map_err(located)?;
    text.parse::<Table>().map_err(located)
}

/// 1-based line and column of a byte offset.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// Checks that a table holds only known keys of the right types.
fn check_layer_table(table: &Table) -> Result<()> {
    Config::deserialize(Value::Table(table.clone())).map(|_| ()).map_err(|e| anyhow!("{}", e.message()))
}

/// Turns `a.b.c=value` into the table `{a = {b = {c = value}}}`. The value is read as TOML
/// (numbers, booleans, arrays, quoted strings); anything else is taken as a bare string, so that
/// `optim.schedule=constant` needs no quotes.
fn override_table(text: &str) -> Result<Table> {
    let (key, raw) = text.split_once('=').ok_or_else(|| anyhow!("expected key=value"))?;
    let key = key.trim();
    let valid =
        |part: &str| !part.is_empty() && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !key.split('.').all(valid) {
        bail!("`{key}` is not a dotted key like model.d_model");
    }
    let raw = raw.trim();
    let value = match format!("v = {raw}").parse::<Table>() {
        Ok(mut t) if !raw.is_empty() => t.remove("v").expect("parsed key"),
        _ => Value::String(raw.to_owned()),
    };
    let mut parts: Vec<&str> = key.split('.').collect();
    let leaf = parts.pop().expect("non-empty key");
    let mut table = Table::new();
    table.insert(leaf.to_owned(), value);
    for part in parts.into_iter().rev() {
        let mut outer = Table::new();
        outer.insert(part.to_owned(), Value::Table(table));
        table = outer;
    }
    Ok(table)
}

/// Deep-merges `layer` into `into`: tables merge key by key, any other value replaces.
fn merge(into: &mut Table, layer: &Table, prefix: &str, origin: &Origin, provenance: &mut BTreeMap<String, Origin>) {
    for (key, value) in layer {
        let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        match (into.get_mut(key), value) {
            (Some(Value::Table(existing)), Value::Table(incoming)) => {
                merge(existing, incoming, &path, origin, provenance)
            }
            _ => {
                if let Value::Table(incoming) = value {
                    let mut fresh = Table::new();
                    merge(&mut fresh, incoming, &path, origin, provenance);
                    into.insert(key.clone(), Value::Table(fresh));
                } else {
                    provenance.insert(path, origin.clone());
                    into.insert(key.clone(), value.clone());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(text: &str) -> Override {
        Override { text: text.into(), origin: "--set".into() }
    }

    #[test]
    fn every_builtin_recipe_resolves() {
        assert!(builtin().len() >= 3);
        for (name, _) in builtin() {
            let resolved = resolve(name, &[]).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert_eq!(resolved.name, *name);
        }
    }

    #[test]
    fn overrides_win_and_are_typed() {
        let r = resolve("tiny-llama2", &[set("model.n_layers=3"), set("optim.schedule=constant")]).unwrap();
        assert_eq!(r.config.model.n_layers, 3);
        assert_eq!(r.config.optim.schedule, crate::config::Schedule::Constant);
        let origin = &r.provenance["model.n_layers"];
        assert_eq!(*origin, Origin::Override { from: "--set".into(), text: "model.n_layers=3".into() });
        assert_eq!(origin.to_string(), "--set model.n_layers=3");
        assert_eq!(r.provenance["model.d_model"], Origin::Builtin("tiny-llama2".into()));
    }

    #[test]
    fn errors_name_the_problem_and_its_source() {
        let err = |recipe: &str, o: &[Override]| format!("{:#}", resolve(recipe, o).unwrap_err());
        assert!(err("tiny-lama2", &[]).contains("did you mean `tiny-llama2`"));
        assert!(err("tiny-llama2", &[set("model.d_modl=3")]).contains("--set model.d_modl=3: unknown field `d_modl`"));
        assert!(err("tiny-llama2", &[set("model.d_model=big")]).contains("--set model.d_model=big: invalid type"));
        let e = err("tiny-llama2", &[set("model.n_kv_heads=3")]);
        assert!(e.contains("not divisible") && e.contains("model.n_kv_heads from --set"), "{e}");
        assert!(err("tiny-llama2", &[set("model.moe.top_k=9")]).contains("mixtral"));
        assert!(err("tiny-mixtral", &[set("model.moe.top_k=9")]).contains("top_k = 9 is larger"));
        for bad in ["0", "-1", "nan", "inf"] {
            let e = err("tiny-mixtral", &[set(&format!("model.moe.capacity_factor={bad}"))]);
            assert!(e.contains("model.moe.capacity_factor") && e.contains("must be a positive number"), "{e}");
        }
        assert!(err("tiny-llama2", &[set("train.seq_len=100000")]).contains("longer than model.max_seq_len"));
        assert!(err("tiny-llama2", &[set("model.d_model=0")]).contains("model.d_model must be greater than 0"));
        assert!(err("tiny-llama2", &[set("nonsense")]).contains("expected key=value"));
        let e = err("tiny-llama2", &[set("train.precision=fp16")]);
        assert!(e.contains("--set train.precision=fp16: unknown variant `fp16`, expected `bf16` or `fp8`"), "{e}");
        assert!(err("tiny-llama2", &[set("train.fp8.recipe=rowwise")]).contains("unknown variant `rowwise`"));
        let e = err("tiny-llama2", &[set("train.fp8.amax_history=0")]);
        assert!(e.contains("train.fp8.amax_history must be greater than 0"), "{e}");
        assert!(err("tiny-llama2", &[set("train.fp8.margin=100")]).contains("train.fp8.margin"));
    }

    /// The straggler detector's window is allocated up front: 2^63 - 1 steps overflowed a
    /// capacity (a panic), 10^9 asked for 24 GB. It is bounded as the flight recorder is.
    #[test]
    fn diagnostics_windows_are_bounded() {
        let err = |o: &str| format!("{:#}", resolve("tiny-llama2", &[set(o)]).unwrap_err());
        for n in ["9223372036854775807", "1000000000", "65537"] {
            let e = err(&format!("train.diagnostics.straggler_window={n}"));
            let want =
                format!("train.diagnostics.straggler_window = {n} is more than this engine trains (at most 65536)");
            assert!(e.contains(&want), "{e}");
        }
        let e = err("train.diagnostics.flight_recorder=65537");
        assert!(e.contains("train.diagnostics.flight_recorder = 65537 is more than"), "{e}");
        resolve("tiny-llama2", &[set("train.diagnostics.straggler_window=65536")]).unwrap();
    }

    #[test]
    fn file_errors_give_line_and_column() {
        let dir = std::env::temp_dir().join(format!("engine-recipe-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "extends = \"tiny-llama2\"\n[model]\nd_model = 64\nheads = 4\n").unwrap();
        let e = format!("{:#}", resolve(bad.to_str().unwrap(), &[]).unwrap_err());
        assert!(e.contains("bad.toml:4:1: unknown field `heads`"), "{e}");
        let good = dir.join("good.toml");
        std::fs::write(&good, "extends = \"tiny-llama2\"\n[model]\nn_layers = 2\n").unwrap();
        let r = resolve(good.to_str().unwrap(), &[]).unwrap();
        assert_eq!((r.config.model.n_layers, r.config.model.d_model), (2, 1024));
        let e = format!("{:#}", resolve(dir.join("missing.toml").to_str().unwrap(), &[]).unwrap_err());
        assert!(e.contains("cannot read recipe file") && e.contains("missing.toml"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
