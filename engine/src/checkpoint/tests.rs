use super::*;
use crate::config::{Override, resolve};
use crate::model::{Model, init};

fn small() -> Config {
    let set = |t: &str| Override { text: t.into(), origin: "--set".into() };
    resolve(
        "tiny-llama2",
        &[
            set("model.vocab_size=300"),
            set("model.d_model=16"),
            set("model.mlp_dim=32"),
            set("model.n_heads=2"),
            set("model.n_kv_heads=1"),
            set("model.head_dim=8"),
        ],
    )
    .unwrap()
    .config
}

fn snapshot(config: &Config, step: u64) -> (Layout, Snapshot) {
    let model = Model::new(&config.model);
    let params = init::params(&model, 3);
    let m: Vec<f32> = params.iter().map(|x| x * 0.5).collect();
    let v: Vec<f32> = params.iter().map(|x| x * x).collect();
    let position = Position { epoch: 1, index: 7, ..Position::default() };
    let snap = Snapshot { step, position, data_tokens: 1000, params, moments: Some((m, v)) };
    (model.layout, snap)
}

#[test]
fn a_checkpoint_reads_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let config = small();
    let (layout, snap) = snapshot(&config, 12);
    let extras = Extras { files: vec![("hf/config.json".into(), b"{}".to_vec())], hf_dtype: Some("bfloat16".into()) };
    let path = write(dir.path(), &config, &layout, &snap, &extras, None).unwrap();
    assert_eq!(path, dir.path().join("step-000012"));
    let ck = Checkpoint::open(&path).unwrap();
    assert_eq!(ck.config, config);
    assert_eq!((ck.state.step, ck.state.seed, ck.state.hf_dtype.as_deref()), (12, config.train.seed, Some("bfloat16")));
    assert_eq!(ck.snapshot(&layout).unwrap(), snap);
    assert_eq!(ck.hf_files().unwrap(), extras.files);
    // No temporary directory is left behind.
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn damage_is_detected_and_named() {
    let config = small();
    let (layout, snap) = snapshot(&config, 3);
    type Damage = fn(&Path);
    let cases: [(&str, Damage); 4] = [
        ("model.safetensors is", |d| {
            let p = d.join(MODEL_FILE);
            let b = fs::read(&p).unwrap();
            fs::write(&p, &b[..b.len() / 2]).unwrap();
        }),
        ("optimizer.safetensors does not match its SHA-256", |d| {
            let p = d.join(OPTIMIZER_FILE);
            let mut b = fs::read(&p).unwrap();
            let n = b.len() - 5;
            b[n] ^= 1;
            fs::write(&p, b).unwrap();
        }),
        ("config.toml is missing", |d| fs::remove_file(d.join(CONFIG_FILE)).unwrap()),
        ("state.json is not a valid checkpoint state", |d| fs::write(d.join(STATE_FILE), "{\"step\":").unwrap()),
    ];
    for (expected, damage) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), &config, &layout, &snap, &Extras::default(), None).unwrap();
        damage(&path);
        let e = format!("{:#}", Checkpoint::open(&path).unwrap_err());
        assert!(e.contains("is damaged") && e.contains(expected), "{expected}: {e}");
    }
}

#[test]
fn the_newest_complete_checkpoint_is_found_and_old_ones_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let config = small();
    let (layout, mut snap) = snapshot(&config, 0);
    for step in [1, 2, 4, 6] {
        snap.step = step;
        write(dir.path(), &config, &layout, &snap, &Extras::default(), None).unwrap();
    }
    // What a save killed in the middle leaves: ignored, then removed.
    fs::create_dir(dir.path().join(".tmp-step-000008-99")).unwrap();
    let steps = |dir: &Path| list(dir).unwrap().iter().map(|(s, _)| *s).collect::<Vec<_>>();
    assert_eq!(steps(dir.path()), [1, 2, 4, 6]);
    assert_eq!(latest(dir.path()).unwrap().unwrap().state.step, 6);
    assert_eq!(remove_temporaries(dir.path()).unwrap().len(), 1);
    // keep_every_n_steps = 2 keeps step 2 for good; keep_last = 2 keeps 4 and 6.
    prune(dir.path(), 2, 2).unwrap();
    assert_eq!(steps(dir.path()), [2, 4, 6]);
    prune(dir.path(), 2, 0).unwrap();
    assert_eq!(steps(dir.path()), [4, 6]);
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
    // A damaged newest checkpoint is an error that points at the previous one.
    fs::remove_file(dir.path().join("step-000006").join(MODEL_FILE)).unwrap();
    let e = format!("{:#}", latest(dir.path()).unwrap_err());
    assert!(e.contains("model.safetensors is missing") && e.contains("step-000004"), "{e}");
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

/// A checkpoint of a run on shards records each shard's header; a resume on shards changed since
/// (another content digest, one missing, one added) is refused naming the shard, and a checkpoint
/// without the record (an earlier engine's) still resumes.
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

/// `state.json`'s names become paths: one that is absolute, climbs with `..`, or leads out of
/// the directory through a symbolic link is refused even under a recomputed seal, and nothing
/// outside the checkpoint is read or written.
#[test]
fn names_that_leave_the_checkpoint_are_refused_under_a_valid_seal() {
    let config = small();
    let (layout, snap) = snapshot(&config, 2);
    let outside = tempfile::tempdir().unwrap();
    let secret = outside.path().join("secret");
    fs::write(&secret, b"not the checkpoint's").unwrap();
    let sum = FileSum { bytes: 20, sha256: sha256_hex(b"not the checkpoint's") };
    type Tamper = fn(&Path, &Path) -> String;
    let cases: [(Tamper, &str); 4] = [
        (|_, secret| format!("hf/{}", secret.display()), "which is not a name inside the checkpoint directory"),
        (|_, secret| format!("../{}", secret.file_name().unwrap().to_str().unwrap()), "not a name inside"),
        (
            |d, secret| {
                std::os::unix::fs::symlink(secret, d.join("hf/tokenizer.json")).unwrap();
                "hf/tokenizer.json".into()
            },
            "leads outside",
        ),
        (
            |d, secret| {
                fs::create_dir_all(d.join("hf/sub")).unwrap();
                fs::copy(secret, d.join("hf/sub/x")).unwrap();
                "hf/sub/x".into()
            },
            "the hf/ files are plain names directly under hf/",
        ),
    ];
    for (tamper, expected) in cases {
        let dir = tempfile::tempdir().unwrap();
        let extras = Extras { files: vec![("hf/config.json".into(), b"{}".to_vec())], hf_dtype: None };
        let path = write(dir.path(), &config, &layout, &snap, &extras, None).unwrap();
        let mut state = Checkpoint::open(&path).unwrap().state;
        state.files.insert(tamper(&path, &secret), sum.clone());
        fs::write(path.join(STATE_FILE), state.sealed_text().unwrap()).unwrap();
        let e = Checkpoint::open(&path).and_then(|ck| ck.hf_files().map(|_| ())).unwrap_err();
        assert!(format!("{e:#}").contains(expected), "{expected}: {e:#}");
    }
    assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 1);
}

/// A checkpoint without optimizer state (what import-hf writes) is refused for what it is,
/// before its data or configuration are compared.
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
        assert!(e.contains("it has no optimizer state (an import-hf output?)") && e.contains("--init-from-hf"), "{e}");
    }
}

/// What a killed `write_dir` (import-hf) left beside its output is removed by the next write
/// there; a temporary of a live process, or of another name, is kept.
#[test]
fn temporaries_of_killed_imports_are_removed_by_the_next() {
    let config = small();
    let (layout, snap) = snapshot(&config, 0);
    let dir = tempfile::tempdir().unwrap();
    // PID 2^22 + 1 is above Linux's pid_max: no such process can exist.
    let dead = dir.path().join(".tmp-ck-4194305");
    let live = dir.path().join(".tmp-ck-1"); // init
    let other = dir.path().join(".tmp-ck-2-4194305");
    for d in [&dead, &live, &other] {
        fs::create_dir_all(d.join("part")).unwrap();
    }
    write_dir(&dir.path().join("ck"), &config, &layout, &snap, &Extras::default(), None).unwrap();
    assert!(!dead.exists() && live.exists() && other.exists());
    write_dir(&dir.path().join("ck-2"), &config, &layout, &snap, &Extras::default(), None).unwrap();
    assert!(!other.exists());
}
