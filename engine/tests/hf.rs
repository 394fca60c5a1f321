//! Hugging Face interoperability against transformers' own numbers (tests/fixtures/hf, made by
//! its generate.py): loss, load-balancing loss, logits and gradients of tiny Llama, Mistral,
//! Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3, GPT-OSS, Gemma 3 and GPT-2 models (GPT-2 in both spellings: transformers' `transformer.h.0...` and the
//! original hub checkpoint's `h.0...` with its mask buffers; Gemma 3 also as the text model of a
//! `Gemma3ForConditionalGeneration`); byte-exact import/export round trips; fine-tuning from a Hugging Face model;
//! clear errors for models the engine cannot read; LAMBADA accuracy.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use engine::tensors::Mapped;

/// The fixtures an import/export round trip gives back byte for byte.
const MODELS: [&str; 14] = [
    "llama",
    "mistral",
    "mixtral",
    "gpt2",
    "qwen3",
    "qwen3-tied",
    "qwen3-moe",
    "qwen3-moe-norm",
    "qwen3-moe-dense",
    "deepseek-v3",
    "deepseek-v3-plain",
    "gpt-oss",
    "gemma3",
    "gemma3-softcap",
];
/// Every fixture model: the above and GPT-2 in the hub checkpoint's spelling, which export
/// writes in transformers' (`transformer.` prefix, no mask buffers).
const ALL_MODELS: [&str; 17] = [
    "llama",
    "mistral",
    "mixtral",
    "gpt2",
    "gpt2-hub",
    "gpt2-lambada",
    "qwen3",
    "qwen3-tied",
    "qwen3-moe",
    "qwen3-moe-norm",
    "qwen3-moe-dense",
    "deepseek-v3",
    "deepseek-v3-plain",
    "gpt-oss",
    "gpt-oss-mxfp4",
    "gemma3",
    "gemma3-softcap",
];

/// Every tensor of a safetensors file (or of a model directory's weight files `model*.safetensors`):
/// dtype, shape, bytes.
fn tensors(path: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let files: Vec<std::path::PathBuf> = if path.is_dir() {
        let mut f: Vec<_> = std::fs::read_dir(path)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let name = p.file_name().unwrap().to_string_lossy();
                name.starts_with("model") && name.ends_with(".safetensors")
            })
            .collect();
        f.sort();
        f
    } else {
        vec![path.to_path_buf()]
    };
    let mut out = BTreeMap::new();
    for f in files {
        let m = Mapped::open(&f).unwrap();
        for (name, view) in m.tensors().iter() {
            out.insert(name.to_owned(), (format!("{:?}", view.dtype()), view.shape().to_vec(), view.data().to_vec()));
        }
    }
    out
}

/// Asserts two tensor maps are equal, naming the first difference (not printing megabytes).
fn assert_same(
    a: &BTreeMap<String, (String, Vec<usize>, Vec<u8>)>,
    b: &BTreeMap<String, (String, Vec<usize>, Vec<u8>)>,
    what: &str,
) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}: tensor names");
    for (name, (dtype, shape, bytes)) in a {
        let (d, sh, by) = &b[name];
        assert_eq!((dtype, shape), (d, sh), "{what}: {name}");
        assert!(bytes == by, "{what}: the bytes of {name} differ");
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

fn expected(model: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture(&format!("hf/{model}/expected.json"))).unwrap()).unwrap()
}

/// Loss within 1e-5 relative, logits within 1e-4 absolute, each parameter's gradient within
/// 1e-4 relative in norm, of transformers' eager f32 computation.
fn check_against_transformers(model: &str, source: &[&str], dir: &Path) {
    let (logits, grads) =
        (dir.join(format!("{model}-logits.safetensors")), dir.join(format!("{model}-grads.safetensors")));
    let tokens = fixture(&format!("hf/{model}/tokens.json"));
    let mut args = vec!["eval"];
    args.extend_from_slice(source);
    args.extend(["--tokens", s(&tokens), "--dump-logits", s(&logits), "--dump-grads", s(&grads)]);
    let out: serde_json::Value = serde_json::from_str(ok(&args).trim()).unwrap();
    let want = expected(model);
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    let loss = out["loss"].as_f64().unwrap();
    assert!(rel(loss, want["loss"].as_f64().unwrap()) < 1e-5, "{model}: loss {loss} vs {}", want["loss"]);
    assert!((out["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-9);
    assert_eq!(out["tokens"], 30);
    match want.get("aux_loss") {
        Some(aux) => {
            let got = out["aux_loss"].as_f64().unwrap();
            assert!(rel(got, aux.as_f64().unwrap()) < 1e-5, "{model}: aux loss {got} vs {aux}");
        }
        None => assert!(out.get("aux_loss").is_none()),
    }

    let (ours, theirs) = (tensors(&logits), tensors(&fixture(&format!("hf/{model}/logits.safetensors"))));
    assert_eq!(ours["logits"].1, theirs["logits"].1);
    let worst =
        f32s(&ours["logits"].2).iter().zip(f32s(&theirs["logits"].2)).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-4, "{model}: logits differ by up to {worst}");

    let (ours, theirs) = (tensors(&grads), tensors(&fixture(&format!("hf/{model}/grads.safetensors"))));
    assert_eq!(ours.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>(), "{model}: gradient names");
    for (name, (_, shape, bytes)) in &theirs {
        assert_eq!(&ours[name].1, shape, "{model}: {name}");
        let (a, b) = (f32s(&ours[name].2), f32s(bytes));
        let diff = a.iter().zip(&b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
        let norm = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
        if norm == 0.0 {
            // An expert no token chose (fine-grained routing over few tokens).
            assert!(diff == 0.0, "{model}: {name} has no gradient in transformers, but {diff:e} here");
            continue;
        }
        assert!(diff / norm < 1e-4, "{model}: gradient of {name} differs by {:.2e} relative", diff / norm);
    }
}

/// A token shard cut into sequences evaluates like the same tokens given as JSON.
#[test]
fn eval_reads_token_shards() {
    let dir = scratch("hf-shard");
    let tokens: Vec<Vec<u32>> =
        serde_json::from_slice(&std::fs::read(fixture("hf/llama/tokens.json")).unwrap()).unwrap();
    let shard = dir.join("tokens.tok");
    let mut w = engine::data::shard::ShardWriter::create(&shard, 512, 1).unwrap();
    w.push_document(&tokens.concat()).unwrap();
    w.push_document(&[7, 7, 7]).unwrap(); // a partial last sequence, dropped
    w.finish().unwrap();
    let llama = fixture("hf/llama");
    let from_shard = ok(&["eval", "--hf", s(&llama), "--tokens", s(&shard), "--seq-len", "16"]);
    let from_json = ok(&["eval", "--hf", s(&llama), "--tokens", s(&fixture("hf/llama/tokens.json"))]);
    assert_eq!(from_shard, from_json);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_agrees_with_transformers_for_every_architecture() {
    let dir = scratch("hf-eval");
    for model in ALL_MODELS {
        let hf = fixture(&format!("hf/{model}"));
        check_against_transformers(model, &["--hf", s(&hf)], &dir);
        // The same through an imported checkpoint.
        let ck = dir.join(format!("{model}-ckpt"));
        ok(&["import-hf", s(&hf), "--out", s(&ck)]);
        check_against_transformers(model, &["--checkpoint", s(&ck)], &dir);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Import then export gives back every tensor byte for byte, in the original dtype (f32, bf16),
/// whether the original was one file or shards, and whether the export is sharded or not.
#[test]
fn import_then_export_is_byte_exact() {
    let dir = scratch("hf-roundtrip");
    for model in MODELS {
        let hf = fixture(&format!("hf/{model}"));
        let original = tensors(&hf);
        let ck = dir.join(format!("{model}-ckpt"));
        ok(&["import-hf", s(&hf), "--out", s(&ck)]);
        for (name, shard) in [("whole", "5GB"), ("sharded", "20KB")] {
            let out = dir.join(format!("{model}-{name}"));
            ok(&["export-hf", s(&ck), "--out", s(&out), "--max-shard-size", shard]);
            assert_same(&tensors(&out), &original, &format!("{model} ({name}) round trip"));
            assert_eq!(out.join("model.safetensors.index.json").exists(), name == "sharded", "{model} {name}");
            let config: serde_json::Value =
                serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
            let source: serde_json::Value =
                serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
            for key in [
                "architectures",
                "vocab_size",
                "hidden_size",
                "num_key_value_heads",
                "bos_token_id",
                "tie_word_embeddings",
            ] {
                assert_eq!(config.get(key), source.get(key), "{model}: config.json {key}");
            }
            assert_eq!(
                config.get("rope_parameters").is_some(),
                source.get("rope_parameters").is_some(),
                "{model}: RoPE spelling"
            );
            // What comes out reads back in.
            check_against_transformers(model, &["--hf", s(&out)], &dir);
        }
    }
    let llama = dir.join("llama-whole");
    assert_eq!(
        std::fs::read(llama.join("tokenizer.json")).unwrap(),
        std::fs::read(fixture("hf/llama/tokenizer.json")).unwrap(),
        "the tokenizer travels with the model"
    );
    fails(&["export-hf", s(&dir.join("llama-ckpt")), "--out", s(&llama)], "already exists and is not empty");
    fails(&["export-hf", s(&dir.join("llama-ckpt")), "--out", s(&dir.join("x")), "--dtype", "f8"], "--dtype f8");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// GPT-OSS's experts in MXFP4 (blocks and scales, as the published checkpoints store them)
/// import as the tensors transformers' dequantizer gives, bit for bit: the export writes them
/// so (in f32, without `quantization_config`). Missing scales are named.
#[test]
fn mxfp4_experts_import_as_transformers_dequantizes_them() {
    let dir = scratch("hf-mxfp4");
    let hf = fixture("hf/gpt-oss-mxfp4");
    let ck = dir.join("ckpt");
    ok(&["import-hf", s(&hf), "--out", s(&ck)]);
    let out = dir.join("export");
    ok(&["export-hf", s(&ck), "--out", s(&out), "--dtype", "f32"]);
    let (ours, theirs) = (tensors(&out), tensors(&hf.join("dequantized.safetensors")));
    for (name, (_, shape, bytes)) in &theirs {
        assert_eq!(&ours[name].1, shape, "{name}");
        assert!(ours[name].2 == *bytes, "{name}: the import differs from transformers' dequantized tensor");
    }
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(!config.contains("quantization_config"), "the export is not MXFP4");
    // A shard without one layer's scales: renamed in its header (the same length).
    let broken = dir.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    let (from, to) = (&b"layers.1.mlp.experts.down_proj_scales"[..], &b"layers.9.mlp.experts.down_proj_scales"[..]);
    for f in std::fs::read_dir(&hf).unwrap() {
        let f = f.unwrap().path();
        let mut bytes = std::fs::read(&f).unwrap();
        if let Some(at) = bytes.windows(from.len()).position(|w| w == from) {
            bytes[at..at + to.len()].copy_from_slice(to);
        }
        std::fs::write(broken.join(f.file_name().unwrap()), bytes).unwrap();
    }
    fails(
        &["import-hf", s(&broken), "--out", s(&dir.join("x"))],
        "tensor model.layers.1.mlp.experts.down_proj_scales is missing",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The original hub spelling of GPT-2 (`h.0...`, with `attn.bias` / `attn.masked_bias` buffers)
/// exports in transformers' spelling: every weight under `transformer.` with the same bytes (the
/// `Conv1D` weights transposed twice), the buffers left out, and the same numbers as transformers'.
#[test]
fn the_gpt2_hub_spelling_exports_in_transformers_spelling() {
    let dir = scratch("hf-gpt2-hub");
    let hf = fixture("hf/gpt2-hub");
    let ck = dir.join("ckpt");
    ok(&["import-hf", s(&hf), "--out", s(&ck)]);
    let out = dir.join("out");
    ok(&["export-hf", s(&ck), "--out", s(&out)]);
    let want: BTreeMap<_, _> = tensors(&hf)
        .into_iter()
        .filter(|(name, _)| !name.ends_with(".attn.bias") && !name.ends_with(".attn.masked_bias"))
        .map(|(name, t)| (format!("transformer.{name}"), t))
        .collect();
    assert!(want.contains_key("transformer.h.2.attn.c_attn.weight") && want.len() == 3 * 12 + 4);
    assert_same(&tensors(&out), &want, "gpt2-hub export");
    check_against_transformers("gpt2-hub", &["--hf", s(&out)], &dir);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes the safetensors file `from` to `to` with each tensor renamed by `rename` (the same
/// bytes: offsets count from the end of the header).
fn rename_tensors(from: &Path, to: &Path, rename: impl Fn(&str) -> String) {
    let bytes = std::fs::read(from).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let renamed: serde_json::Map<String, serde_json::Value> =
        header.into_iter().map(|(k, v)| if k == "__metadata__" { (k, v) } else { (rename(&k), v) }).collect();
    let mut text = serde_json::to_vec(&renamed).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(to, out).unwrap();
}

/// A `Gemma3ForConditionalGeneration` (the published 4b-27b) is read as its text model: the
/// `text_config` (sparse: the rest Gemma3TextConfig's defaults) and the `language_model.model.`
/// tensors (or, as transformers' modules name them, `model.language_model.`), the vision tower
/// and projector left aside. It computes what the gemma3 fixture computes (the same text model)
/// and exports as that `Gemma3ForCausalLM`, byte for byte.
#[test]
fn gemma3_multimodal_is_read_as_its_text_model() {
    let dir = scratch("hf-gemma3-multimodal");
    let hf = fixture("hf/gemma3-multimodal");
    assert!(tensors(&hf).keys().any(|n| n.starts_with("vision_tower.")), "the fixture has a vision tower");
    check_against_transformers("gemma3", &["--hf", s(&hf)], &dir);
    let ck = dir.join("ckpt");
    ok(&["import-hf", s(&hf), "--out", s(&ck)]);
    check_against_transformers("gemma3", &["--checkpoint", s(&ck)], &dir);
    let out = dir.join("export");
    ok(&["export-hf", s(&ck), "--out", s(&out)]);
    assert_same(&tensors(&out), &tensors(&fixture("hf/gemma3")), "the text model");
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"], serde_json::json!(["Gemma3ForCausalLM"]));
    assert!(config.get("text_config").is_none() && config.get("vision_config").is_none(), "{config}");
    check_against_transformers("gemma3", &["--hf", s(&out)], &dir);

    // The modules' own names.
    let modules = dir.join("modules");
    std::fs::create_dir_all(&modules).unwrap();
    std::fs::copy(hf.join("config.json"), modules.join("config.json")).unwrap();
    rename_tensors(&hf.join("model.safetensors"), &modules.join("model.safetensors"), |n| {
        match n.strip_prefix("language_model.model.") {
            Some(rest) => format!("model.language_model.{rest}"),
            None => format!("model.{n}"),
        }
    });
    assert!(tensors(&modules).contains_key("model.language_model.layers.5.mlp.down_proj.weight"));
    check_against_transformers("gemma3", &["--hf", s(&modules)], &dir);

    // A tensor that is neither the text model's nor the vision tower's is named.
    let stray = dir.join("stray");
    std::fs::create_dir_all(&stray).unwrap();
    std::fs::copy(hf.join("config.json"), stray.join("config.json")).unwrap();
    rename_tensors(&hf.join("model.safetensors"), &stray.join("model.safetensors"), |n| {
        n.replace("multi_modal_projector.mm_soft_emb_norm", "audio_tower.norm")
    });
    fails(
        &["import-hf", s(&stray), "--out", s(&dir.join("x"))],
        "1 tensor(s) that a Gemma3ForCausalLM with this config.json does not have: audio_tower.norm.weight",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// transformers loads what the engine exports and computes the same logits (needs Python with
/// torch and transformers: ENGINE_TEST_TORCH_PYTHON; skipped without).
#[test]
fn transformers_loads_the_export() {
    let Some(python) = python_with("ENGINE_TEST_TORCH_PYTHON", "transformers", false) else { return };
    let dir = scratch("hf-transformers");
    // (the model, the fixture whose tokens and logits it computes): a multimodal Gemma 3 exports
    // its text model, gemma3's.
    let models = ALL_MODELS.iter().map(|m| (*m, *m)).chain([("gemma3-multimodal", "gemma3")]);
    for (source, model) in models {
        let ck = dir.join(format!("{source}-ckpt"));
        let out = dir.join(source);
        ok(&["import-hf", s(&fixture(&format!("hf/{source}"))), "--out", s(&ck)]);
        ok(&["export-hf", s(&ck), "--out", s(&out), "--dtype", "f32"]);
        let script = r#"
import json, sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
out, fixture = sys.argv[1], sys.argv[2]
m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
ids = torch.tensor(json.load(open(fixture + "/tokens.json")))
with torch.no_grad():
    logits = m(input_ids=ids).logits
ref = load_file(fixture + "/logits.safetensors")["logits"]
print(type(m).__name__, (logits - ref).abs().max().item())
"#;
        let run = std::process::Command::new(&python)
            .args(["-c", script, s(&out), s(&fixture(&format!("hf/{model}")))])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&run.stdout);
        assert!(run.status.success(), "{source}: {}", String::from_utf8_lossy(&run.stderr));
        let (class, diff) = text.trim().rsplit_once(' ').unwrap();
        let family = model.split('-').next().unwrap();
        assert!(class.to_lowercase().starts_with(family), "{source}: loaded as {class}");
        assert!(diff.parse::<f64>().unwrap() < 1e-4, "{source}: transformers' logits of the export differ by {diff}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train --init-from-hf` with a GPT-2: the model is the directory's (untied, exact GELU, odd
/// vocabulary), and a zero learning rate gives back its weights byte for byte (`Conv1D`
/// transposed in and out).
#[test]
fn fine_tuning_starts_from_a_gpt2() {
    let dir = scratch("hf-finetune-gpt2");
    let hf = fixture("hf/gpt2");
    let run = dir.join("run");
    #[rustfmt::skip]
    ok(&[
        "train", "--recipe", "tiny-gpt", "--init-from-hf", s(&hf), "--run-dir", s(&run), "--steps", "2",
        "--set", "train.seq_len=16", "--set", "optim.lr=0", "--set", "train.checkpoint_every=1",
        "--set", "data.source=synthetic",
    ]);
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        config.contains("family = \"gpt\"")
            && config.contains("vocab_size = 67")
            && config.contains("tie_embeddings = false")
            && config.contains("gelu = \"erf\""),
        "the model is the directory's: {config}"
    );
    let exported = dir.join("exported");
    ok(&["export-hf", s(&run.join("checkpoints/step-000002")), "--out", s(&exported)]);
    assert_same(&tensors(&exported), &tensors(&hf), "zero learning rate: the weights are the imported ones");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train --init-from-hf` with Gemma 3 (f32, and bf16 with a final softcap): the model is the
/// directory's, a zero learning rate gives back its weights byte for byte, and with a learning
/// rate the loss goes down.
#[test]
fn fine_tuning_starts_from_a_gemma3() {
    let dir = scratch("hf-finetune-gemma3");
    for model in ["gemma3", "gemma3-softcap"] {
        let hf = fixture(&format!("hf/{model}"));
        let run = dir.join(format!("{model}-run"));
        #[rustfmt::skip]
        ok(&[
            "train", "--recipe", "tiny-gemma3", "--init-from-hf", s(&hf), "--run-dir", s(&run), "--steps", "2",
            "--set", "train.seq_len=16", "--set", "optim.lr=0", "--set", "train.checkpoint_every=1",
            "--set", "data.source=synthetic",
        ]);
        let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
        assert!(
            config.contains("family = \"gemma3\"")
                && config.contains("vocab_size = 96")
                && config.contains("tie_embeddings = true"),
            "{model}: the model is the directory's: {config}"
        );
        let exported = dir.join(format!("{model}-exported"));
        ok(&["export-hf", s(&run.join("checkpoints/step-000002")), "--out", s(&exported)]);
        assert_same(&tensors(&exported), &tensors(&hf), &format!("{model}: zero learning rate"));
    }
    let run = dir.join("learning");
    #[rustfmt::skip]
    ok(&[
        "train", "--recipe", "tiny-gemma3", "--init-from-hf", s(&fixture("hf/gemma3")), "--run-dir", s(&run),
        "--steps", "6", "--set", "train.seq_len=16", "--set", "optim.lr=1e-2", "--set", "train.checkpoint_every=6",
        "--set", "data.source=synthetic",
    ]);
    let m = metrics(&run);
    assert!(m[5]["loss"].as_f64().unwrap() < m[0]["loss"].as_f64().unwrap(), "fine-tuning did not lower the loss");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train --init-from-hf`: the model and its weights come from the directory (a step with a
/// zero learning rate leaves them exactly as imported), and checkpoints carry its files.
#[test]
fn fine_tuning_starts_from_the_hugging_face_weights() {
    let dir = scratch("hf-finetune");
    let hf = fixture("hf/llama");
    let run = dir.join("run");
    let out = ok(&[
        "train",
        "--recipe",
        "tiny-llama2",
        "--init-from-hf",
        s(&hf),
        "--run-dir",
        s(&run),
        "--steps",
        "2",
        "--set",
        "train.seq_len=16",
        "--set",
        "optim.lr=0",
        "--set",
        "train.checkpoint_every=1",
    ]);
    assert!(out.contains("training tiny-llama2"), "{out}");
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        config.contains("d_model = 64")
            && config.contains("vocab_size = 512")
            && config.contains("tie_embeddings = true"),
        "the model is the directory's: {config}"
    );
    let ck = run.join("checkpoints/step-000002");
    let exported = dir.join("exported");
    ok(&["export-hf", s(&ck), "--out", s(&exported)]);
    assert_same(&tensors(&exported), &tensors(&hf), "zero learning rate: the weights are the imported ones");
    assert!(exported.join("tokenizer.json").exists());
    // With a learning rate the model moves, and the loss on the fixture tokens goes down.
    let run2 = dir.join("run2");
    ok(&[
        "train",
        "--recipe",
        "tiny-llama2",
        "--init-from-hf",
        s(&hf),
        "--run-dir",
        s(&run2),
        "--steps",
        "6",
        "--set",
        "train.seq_len=16",
        "--set",
        "optim.lr=1e-2",
        "--set",
        "train.checkpoint_every=6",
    ]);
    let m = metrics(&run2);
    assert!(m[5]["loss"].as_f64().unwrap() < m[0]["loss"].as_f64().unwrap(), "fine-tuning did not lower the loss");
    fails(
        &[
            "train",
            "--recipe",
            "tiny-llama2",
            "--init-from-hf",
            s(&hf),
            "--run-dir",
            s(&dir.join("r3")),
            "--set",
            "model.d_model=8",
        ],
        "conflicts with --init-from-hf",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model directory the engine cannot read gets one line naming what is wrong.
#[test]
fn unreadable_models_are_named() {
    let dir = scratch("hf-errors");
    // A copy of fixture `model` named `name`, its config.json edited.
    let copy_of = |model: &str, name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in ["model.safetensors", "tokenizer.json"] {
            if fixture(&format!("hf/{model}")).join(f).exists() {
                std::fs::copy(fixture(&format!("hf/{model}")).join(f), d.join(f)).unwrap();
            }
        }
        let mut c: serde_json::Value =
            serde_json::from_slice(&std::fs::read(fixture(&format!("hf/{model}/config.json"))).unwrap()).unwrap();
        edit(&mut c);
        std::fs::write(d.join("config.json"), serde_json::to_vec(&c).unwrap()).unwrap();
        d
    };
    let copy = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| copy_of("llama", name, edit);
    let gemma3 = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| copy_of("gemma3", name, edit);
    let cases: Vec<(std::path::PathBuf, &str)> = vec![
        (
            copy("neox", &|c| c["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"])),
            "architecture `GPTNeoXForCausalLM` is not supported",
        ),
        (
            // Llama's weights under a GPT-2 config.json.
            copy("gpt2", &|c| c["architectures"] = serde_json::json!(["GPT2LMHeadModel"])),
            "tensor transformer.wte.weight is missing",
        ),
        (
            copy("relu", &|c| {
                c["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
                c["activation_function"] = "relu".into();
            }),
            "activation_function = \"relu\" is not supported",
        ),
        (
            copy("deeper", &|c| c["num_hidden_layers"] = 3.into()),
            "tensor model.layers.2.input_layernorm.weight is missing",
        ),
        (
            copy("wider", &|c| c["intermediate_size"] = 100.into()),
            "tensor model.layers.0.mlp.gate_proj.weight has shape [96, 64], config.json implies [100, 64]",
        ),
        (
            copy("shallower", &|c| c["num_hidden_layers"] = 1.into()),
            "tensor(s) that a LlamaForCausalLM with this config.json does not have: model.layers.1.",
        ),
        (
            copy("longrope", &|c| c["rope_scaling"] = serde_json::json!({"rope_type": "longrope", "factor": 4.0})),
            "rope_scaling.rope_type = \"longrope\" is not supported",
        ),
        (gemma3("gemma3-window0", &|c| c["sliding_window"] = 0.into()), "sliding_window = 0 is not supported"),
        (gemma3("gemma3-window-1", &|c| c["sliding_window"] = (-1).into()), "sliding_window = -1 is not supported"),
        (
            gemma3("gemma3-types", &|c| c["layer_types"] = serde_json::json!(vec!["full_attention"; 5])),
            "layer_types lists 5 layers but num_hidden_layers = 6",
        ),
        (
            gemma3("gemma3-bidirectional", &|c| c["use_bidirectional_attention"] = true.into()),
            "use_bidirectional_attention = true is not supported",
        ),
        (
            gemma3("gemma3-gelu", &|c| c["hidden_activation"] = "gelu".into()),
            "hidden_activation = \"gelu\" is not supported",
        ),
        (
            gemma3("gemma3-yarn", &|c| c["rope_parameters"]["full_attention"]["rope_type"] = "yarn".into()),
            "rope_parameters.full_attention.rope_type = \"yarn\" is not supported",
        ),
        (
            copy_of("gemma3-multimodal", "gemma3-multimodal-window0", &|c| {
                c["text_config"]["sliding_window"] = 0.into()
            }),
            "text_config.sliding_window = 0 is not supported",
        ),
        (
            // The text model's weights under a multimodal config.json that is deeper.
            copy_of("gemma3-multimodal", "gemma3-multimodal-deeper", &|c| {
                c["text_config"]["num_hidden_layers"] = 7.into()
            }),
            "tensor language_model.model.layers.6.input_layernorm.weight is missing",
        ),
        (dir.join("nothing"), "cannot read"),
        (
            {
                // A sharded model whose index points outside its directory.
                let d = copy("escape", &|_| ());
                std::fs::rename(d.join("model.safetensors"), dir.join("outside.safetensors")).unwrap();
                let index = serde_json::json!({"weight_map": {"model.embed_tokens.weight": "../outside.safetensors"}});
                std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
                d
            },
            "weight_map names ../outside.safetensors, which is not a file of",
        ),
    ];
    let ck = dir.join("ck");
    for (model, expected) in &cases {
        fails(&["import-hf", s(model), "--out", s(&ck)], expected);
        assert!(!ck.exists(), "a failed import left {}", ck.display());
        fails(&["eval", "--hf", s(model), "--tokens", s(&fixture("hf/llama/tokens.json"))], expected);
    }
    // DeepSeek-V3's multi-token prediction module lies past the last layer in hub checkpoints
    // (`model.layers.61.*`): here the fixture's last layer, under a config.json one layer shorter.
    let mtp = dir.join("mtp");
    std::fs::create_dir_all(&mtp).unwrap();
    std::fs::copy(fixture("hf/deepseek-v3/model.safetensors"), mtp.join("model.safetensors")).unwrap();
    let mut c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("hf/deepseek-v3/config.json")).unwrap()).unwrap();
    c["num_hidden_layers"] = 2.into();
    std::fs::write(mtp.join("config.json"), serde_json::to_vec(&c).unwrap()).unwrap();
    fails(&["import-hf", s(&mtp), "--out", s(&ck)], "is a multi-token prediction layer (num_nextn_predict_layers)");
    assert!(!ck.exists(), "a failed import left {}", ck.display());
    let bad_tokens = dir.join("tokens.json");
    std::fs::write(&bad_tokens, "[[1, 2, 3], [4, 5]]").unwrap();
    fails(
        &["eval", "--hf", s(&fixture("hf/llama")), "--tokens", s(&bad_tokens)],
        "sequence 1 has 2 tokens, sequence 0 has 3",
    );
    std::fs::write(&bad_tokens, "[[1, 2, 3], [4, 5, 600]]").unwrap();
    fails(
        &["eval", "--hf", s(&fixture("hf/llama")), "--tokens", s(&bad_tokens)],
        "token 600 (sequence 1, position 2) is outside the vocabulary of 512",
    );

    // export-hf names a path it cannot write; what killed exports left is cleaned.
    ok(&["import-hf", s(&fixture("hf/llama")), "--out", s(&ck)]);
    fails(&["export-hf", s(&ck), "--out", "/proc/engine-export"], "cannot create /proc/.engine-export.tmp-");
    let stale = dir.join(".export.tmp-4194305"); // above Linux's pid_max: no such process
    std::fs::create_dir_all(stale.join("part")).unwrap();
    ok(&["export-hf", s(&ck), "--out", s(&dir.join("export"))]);
    assert!(!stale.exists(), "the killed export's temporary directory was not removed");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `eval --task lambada` on a GPT checkpoint (a GPT-2 imported with `import-hf`): the verdict of
/// every passage is transformers' (tests/fixtures/lambada-gpt2, made by generate.py).
#[test]
fn lambada_on_a_gpt_checkpoint_agrees_with_transformers() {
    let want: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("lambada-gpt2/expected.json")).unwrap()).unwrap();
    let dir = scratch("lambada-gpt2");
    let ck = dir.join("ck");
    ok(&["import-hf", s(&fixture("hf/gpt2-lambada")), "--out", s(&ck)]);
    let (data, tokenizer) = (fixture("lambada-gpt2/lambada.jsonl"), fixture("tokenizers/bytelevel-bpe.json"));
    let args = ["eval", "--checkpoint", s(&ck), "--task", "lambada", "--data", s(&data), "--tokenizer", s(&tokenizer)];
    let got: serde_json::Value = serde_json::from_str(ok(&args).trim()).unwrap();
    assert_eq!(got["per_example"], want["per_example"]);
    assert_eq!(got["correct"].as_u64(), want["correct"].as_u64());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn lambada_accuracy_agrees_with_transformers() {
    let want: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("lambada/expected.json")).unwrap()).unwrap();
    let (data, llama, tokenizer) =
        (fixture("lambada/lambada.jsonl"), fixture("hf/llama"), fixture("tokenizers/bytelevel-bpe.json"));
    // The tokenizer comes from the model directory, or is named.
    for extra in [vec![], vec!["--tokenizer", s(&tokenizer)]] {
        let mut args = vec!["eval", "--hf", s(&llama), "--task", "lambada", "--data", s(&data)];
        args.extend(extra);
        let got: serde_json::Value = serde_json::from_str(ok(&args).trim()).unwrap();
        assert_eq!(got["per_example"], want["per_example"]);
        assert_eq!(
            (got["correct"].as_u64(), got["examples"].as_u64()),
            (want["correct"].as_u64(), want["examples"].as_u64())
        );
        assert!((got["accuracy"].as_f64().unwrap() - 0.5).abs() < 1e-12);
    }
    let dir = scratch("lambada");
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"a b\"}\n{\"text\": \"nospace\"}\n").unwrap();
    fails(
        &["eval", "--hf", s(&fixture("hf/llama")), "--task", "lambada", "--data", s(&bad)],
        "bad.jsonl:2: the text has no space",
    );
    // A last word that shows nothing is refused, not scored as a miss.
    for word in ["\\u200b", "\\u0000", "\\ufeff\\u00ad"] {
        std::fs::write(&bad, format!("{{\"text\": \"a b\"}}\n{{\"text\": \"a {word}\"}}\n")).unwrap();
        fails(
            &["eval", "--hf", s(&fixture("hf/llama")), "--task", "lambada", "--data", s(&bad)],
            "bad.jsonl:2: the last word (after the last space) shows no character",
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Files reach a checkpoint and an export only from inside the directories they belong to:
/// import-hf refuses a model file that leads outside the model directory (an absolute symbolic
/// link, or a relative one that climbs out) and reads a Hugging Face cache snapshot, whose files
/// are relative links into the repository's `blobs/`; export-hf refuses a checkpoint whose
/// `state.json` lists a name outside it, even resealed; a NaN weight is refused at import,
/// naming its tensor; an imported model is refused as a resume point for what it is.
#[test]
fn model_and_checkpoint_files_stay_inside_their_directories() {
    let dir = scratch("hf-confined");
    let llama = fixture("hf/llama");
    let files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"];

    // A Hugging Face cache: snapshots/REV/NAME -> ../../blobs/HASH.
    let repo = dir.join("hub/models--t--llama");
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("snapshots/rev")).unwrap();
    for (i, f) in files.iter().enumerate() {
        std::fs::copy(llama.join(f), repo.join(format!("blobs/{i:040}"))).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{i:040}"), repo.join("snapshots/rev").join(f)).unwrap();
    }
    let ck = dir.join("ck");
    ok(&["import-hf", s(&repo.join("snapshots/rev")), "--out", s(&ck)]);
    assert_eq!(
        std::fs::read(ck.join("hf/tokenizer.json")).unwrap(),
        std::fs::read(llama.join("tokenizer.json")).unwrap()
    );

    // A plain model directory with one file linked out of it, absolutely or relatively.
    let outside = dir.join("outside.json");
    std::fs::write(&outside, "{\"secret\": true}").unwrap();
    for (name, target) in [("absolute", outside.clone()), ("relative", "../outside.json".into())] {
        let m = dir.join(name);
        std::fs::create_dir_all(&m).unwrap();
        for f in files {
            std::fs::copy(llama.join(f), m.join(f)).unwrap();
        }
        std::fs::remove_file(m.join("tokenizer.json")).unwrap();
        std::os::unix::fs::symlink(&target, m.join("tokenizer.json")).unwrap();
        let out = dir.join(format!("ck-{name}"));
        fails(&["import-hf", s(&m), "--out", s(&out)], "tokenizer.json leads outside");
        assert!(!out.exists());
    }

    // A NaN weight is named at import.
    let nan = dir.join("nan");
    std::fs::create_dir_all(&nan).unwrap();
    for f in files {
        std::fs::copy(llama.join(f), nan.join(f)).unwrap();
    }
    let mut weights = std::fs::read(nan.join("model.safetensors")).unwrap();
    let header = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let meta: serde_json::Value = serde_json::from_slice(&weights[8..8 + header]).unwrap();
    let at = meta["model.norm.weight"]["data_offsets"][0].as_u64().unwrap() as usize + 8 + header;
    weights[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(nan.join("model.safetensors"), weights).unwrap();
    fails(
        &["import-hf", s(&nan), "--out", s(&dir.join("ck-nan"))],
        "tensor model.norm.weight holds a non-finite weight (NaN or infinite)",
    );
    assert!(!dir.join("ck-nan").exists());

    // The imported model cannot be resumed, whatever its data says.
    let run = dir.join("run");
    fails(
        &["train", "--recipe", s(&ck.join("config.toml")), "--resume", s(&ck), "--run-dir", s(&run)],
        "has no optimizer state (an import-hf output?), so it can start a run, not resume one",
    );

    // state.json lists `hf//ABS/x/PWNED` under a recomputed seal: export-hf must not write there.
    let pwned = dir.join("x/PWNED");
    let planted = ck.join(format!("hf/{}", pwned.display()));
    std::fs::create_dir_all(planted.parent().unwrap()).unwrap();
    std::fs::write(&planted, "pwned").unwrap();
    let mut state: engine::checkpoint::State =
        serde_json::from_slice(&std::fs::read(ck.join("state.json")).unwrap()).unwrap();
    let sum = engine::checkpoint::FileSum { bytes: 5, sha256: engine::digest::sha256_hex(b"pwned") };
    state.files.insert(format!("hf/{}", pwned.display()), sum);
    std::fs::write(ck.join("state.json"), state.sealed_text().unwrap()).unwrap();
    fails(
        &["export-hf", s(&ck), "--out", s(&dir.join("export"))],
        "which is not a name inside the checkpoint directory",
    );
    assert!(!pwned.exists() && !dir.join("export").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
