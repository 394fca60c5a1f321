//! The resume policy: which checkpoint a run continues from, and what must not have changed
//! since it was saved (the configuration but for the resumable keys, the global batch, the data).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Result, anyhow, bail};

use super::housekeeping::latest;
use super::{Checkpoint, OPTIMIZER_FILE};
use crate::config::Config;
use crate::config::flat::flatten;

/// The keys whose values differ between a checkpoint's configuration and the current one, other
/// than those a resumed run may change ([`Config::resumable`]), as `key (checkpoint A, now B)`.
pub fn incompatible_keys(saved: &Config, now: &Config) -> Vec<String> {
    let (a, b) = (flatten(saved), flatten(now));
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| !Config::resumable(k) && a.get(*k) != b.get(*k))
        .map(|k| {
            let show = |m: &BTreeMap<String, String>| m.get(k).cloned().unwrap_or_else(|| "unset".into());
            format!("{k} (checkpoint {}, now {})", show(&a), show(&b))
        })
        .collect()
}

/// The checkpoint a run on `devices` devices resumes from: `explicit` if given, else the newest
/// complete one under `parent`; verified, and refused (naming the keys) if `config` differs in
/// what matters. The global batch (`train.batch_size` × devices) must stay the same: on another
/// device count, `train.batch_size` changes with it, and a run that would train another global
/// batch is refused, whether `batch_size` or the device count changed, with the `batch_size`
/// that keeps it.
pub fn resume_point(parent: &Path, explicit: Option<&Path>, config: &Config, devices: usize) -> Result<Checkpoint> {
    resume_point_with(parent, explicit, config, devices, false)
}

/// [`resume_point`], where `reset_optimizer` (`engine train --reset-optimizer`: the optimizer's
/// state starts afresh) lets the `[optim]` keys differ from the checkpoint's: switching
/// between AdamW and Muon, or changing their settings.
pub fn resume_point_with(
    parent: &Path,
    explicit: Option<&Path>,
    config: &Config,
    devices: usize,
    reset_optimizer: bool,
) -> Result<Checkpoint> {
    let ck = match explicit {
        Some(dir) => Checkpoint::open(dir)?,
        None => latest(parent)?
            .ok_or_else(|| anyhow!("--resume: no complete checkpoint in {} to resume from", parent.display()))?,
    };
    // First, since nothing else about it matters: a model without optimizer state (an
    // import-hf output) starts runs, it does not continue one.
    if ck.state.shards.is_none() && !ck.state.files.contains_key(OPTIMIZER_FILE) {
        bail!(
            "cannot resume from {}: it has no optimizer state (an import-hf output?), so it can start a run, not resume one; start from the Hugging Face model with --init-from-hf DIR instead of --resume",
            ck.dir.display()
        );
    }
    let saved_on = ck.state.shards.unwrap_or(1);
    let (saved, now) = (ck.config.train.batch_size * saved_on, config.train.batch_size * devices);
    let mut differ = incompatible_keys(&ck.config, config);
    // The global batch is checked below; the optimizer's keys may change with a fresh state.
    differ.retain(|k| !k.starts_with("train.batch_size ") && (!reset_optimizer || !k.starts_with("optim.")));
    if (saved.0 - now.0).abs() > 1e-9 * saved.0.max(now.0) {
        // A batch size that would keep the global batch on this many devices.
        let keep = crate::config::BatchSize(saved.0 / devices as f64);
        let on = |n: usize| if n == 1 { "1 device".to_owned() } else { format!("{n} devices") };
        differ.push(format!(
            "the global batch (checkpoint train.batch_size {} x {} = {saved} sequences, now {} x {} = {now}: the curve would change; --set train.batch_size={keep} keeps it)",
            ck.config.train.batch_size,
            on(saved_on),
            config.train.batch_size,
            on(devices),
        ));
    }
    if !differ.is_empty() {
        let optim = if differ.iter().any(|k| k.starts_with("optim.")) {
            " (or, to change the optimizer's settings, add --reset-optimizer: its state then starts afresh)"
        } else {
            ""
        };
        bail!(
            "cannot resume from {}: the configuration differs in {}; resume with the checkpoint's settings (its config.toml){optim} or start a new run",
            ck.dir.display(),
            differ.join(", ")
        );
    }
    check_data(&ck, config)?;
    Ok(ck)
}

/// A checkpoint saved on shards resumes only on the same shards: each one named as then, with
/// the header it had (its token count and content digest). A shard edited in place with its
/// header kept is refused when it is opened ([`crate::data::shard`]). Checkpoints that recorded
/// no shards (earlier engines) resume as before, on the token count alone.
fn check_data(ck: &Checkpoint, config: &Config) -> Result<()> {
    let Some(saved) = &ck.state.data_shards else { return Ok(()) };
    let now = crate::data::fingerprint(&config.data)?.unwrap_or_default();
    let d = ck.dir.display();
    let path = match config.data.mixture.is_empty() {
        true => format!("data.path = {}", config.data.path),
        false => "data.mixture".to_owned(),
    };
    let advice = "resume on the data the run trained on, or start a new run in another --run-dir";
    for (name, header) in saved {
        match now.get(name) {
            None => bail!(
                "cannot resume from {d}: shard {name}, part of the data it was saved with, is not in {path}; {advice}"
            ),
            Some(h) if h != header => bail!(
                "cannot resume from {d}: shard {name} in {path} changed since the checkpoint was saved (its header and content digest differ); {advice}"
            ),
            Some(_) => {}
        }
    }
    if let Some(extra) = now.keys().find(|n| !saved.contains_key(*n)) {
        bail!(
            "cannot resume from {d}: shard {extra} in {path} was not part of the data the checkpoint was saved with; {advice}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    use crate::checkpoint::testing::{small, snapshot};
    use crate::checkpoint::{Extras, STATE_FILE, write};

    /// docs/checkpoints.md's list of the keys that may differ is the keys declared resumable
    /// (`mesh.*` standing for every mesh key).
    #[test]
    fn docs_checkpoints_md_names_the_resumable_keys() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/checkpoints.md")).unwrap();
        let start = text.find("Keys that may differ:").expect("docs/checkpoints.md lists the keys that may differ");
        let list = &text[start..start + text[start..].find("\n- ").unwrap()];
        let mut documented = std::collections::BTreeSet::new();
        for quoted in list.split('`').skip(1).step_by(2).filter(|q| !q.contains(' ')) {
            match quoted {
                "mesh.*" => {
                    documented.extend(crate::config::MeshConfig::KEYS.iter().map(|k| format!("mesh.{}", k.name)))
                }
                key => _ = documented.insert(key.to_owned()),
            }
        }
        let declared = crate::config::SECTIONS.iter().flat_map(|(section, keys)| {
            keys.iter().filter(|k| k.resumable).map(move |k| match *section {
                "" => k.name.to_owned(),
                s => format!("{s}.{}", k.name),
            })
        });
        assert_eq!(documented, declared.collect(), "docs/checkpoints.md and the @resumable fields differ");
    }

    #[test]
    fn differing_keys_are_named_and_run_controls_may_change() {
        let a = small();
        let mut b = a.clone();
        b.train.steps += 10;
        b.train.checkpoint_every = 5;
        assert!(incompatible_keys(&a, &b).is_empty());
        b.model.d_model = 32;
        b.optim.lr = 1.0;
        let keys = incompatible_keys(&a, &b);
        assert_eq!(keys.len(), 2, "{keys:?}");
        assert!(keys[0].starts_with("model.d_model (checkpoint 16, now 32)"), "{keys:?}");
        assert!(keys[1].starts_with("optim.lr"), "{keys:?}");
    }

    #[test]
    fn a_resume_on_other_shards_is_refused_naming_the_shard() {
        use crate::data::shard::{ShardWriter, write_test_manifest};
        let data = tempfile::tempdir().unwrap();
        let shard = |name: &str, tokens: &[u32]| {
            let mut w = ShardWriter::create(&data.path().join(name), 300, 0).unwrap();
            w.push_document(tokens).unwrap();
            w.finish().unwrap();
        };
        shard("a.tok", &[1, 2, 3, 0]);
        shard("b.tok", &[4, 5, 6, 0]);
        write_test_manifest(data.path(), &["a.tok", "b.tok"], 8);
        let mut config = small();
        config.data = crate::config::DataConfig {
            source: crate::config::DataSource::Shards,
            path: data.path().display().to_string(),
            ..Default::default()
        };
        let (layout, snap) = snapshot(&config, 4);
        let runs = tempfile::tempdir().unwrap();
        let path = write(runs.path(), &config, &layout, &snap, &Extras::default(), None).unwrap();
        let recorded = Checkpoint::open(&path).unwrap().state.data_shards.unwrap();
        assert_eq!(recorded.keys().collect::<Vec<_>>(), ["a.tok", "b.tok"]);
        resume_point(runs.path(), None, &config, 1).unwrap();

        let refused = |expected: &str| {
            let e = resume_point(runs.path(), None, &config, 1).unwrap_err().to_string();
            assert!(e.contains(expected) && e.contains("start a new run"), "{expected}: {e}");
        };
        // The same length, other tokens.
        shard("b.tok", &[4, 5, 7, 0]);
        refused(&format!("shard b.tok in data.path = {} changed since the checkpoint was saved", config.data.path));
        shard("b.tok", &[4, 5, 6, 0]);
        resume_point(runs.path(), None, &config, 1).unwrap();
        shard("c.tok", &[0]);
        refused("shard c.tok in data.path");
        fs::remove_file(data.path().join("c.tok")).unwrap();
        fs::rename(data.path().join("b.tok"), data.path().join("b.old")).unwrap();
        refused("shard b.tok, part of the data it was saved with, is not in data.path");

        // An earlier engine's checkpoint records no shards: it resumes on the token count alone.
        let mut state = Checkpoint::open(&path).unwrap().state;
        state.data_shards = None;
        fs::write(path.join(STATE_FILE), state.sealed_text().unwrap()).unwrap();
        resume_point(runs.path(), None, &config, 1).unwrap();
    }

    #[test]
    fn a_model_without_optimizer_state_is_refused_as_a_resume_point() {
        let config = small();
        let (layout, mut snap) = snapshot(&config, 0);
        snap.moments = None;
        snap.data_tokens = 0;
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &config, &layout, &snap, &Extras::default(), None).unwrap();
        let mut other = config.clone();
        other.optim.lr *= 2.0;
        for now in [&config, &other] {
            let e = resume_point(dir.path(), None, now, 1).unwrap_err().to_string();
            assert!(
                e.contains("it has no optimizer state (an import-hf output?)") && e.contains("--init-from-hf"),
                "{e}"
            );
        }
    }
}
