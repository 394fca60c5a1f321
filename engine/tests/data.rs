//! `engine data prepare` as a user runs it: shards hold exactly what the reference tokenizer
//! libraries make of the documents, each closed by the end-of-sequence token; training reads
//! them; bad input gets one line naming the file and line, and leaves no shards behind.

mod common;

use std::path::Path;

use common::*;
use engine::data::shard::{Shard, Shards};
use engine::data::{TokenSource, prepare::PrepareReport};

fn expected() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture("tokenizers/expected.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect()
}

fn report(out: &Path) -> PrepareReport {
    serde_json::from_slice(&std::fs::read(out.join("prepare.json")).unwrap()).unwrap()
}

/// Every fixture tokenizer (tokenizer.json; SentencePiece Unigram and BPE), JSONL input: the
/// shard is the reference encodings of the non-empty documents, each followed by the EOS id.
#[test]
fn shards_hold_the_reference_tokenization() {
    let dir = scratch("prepare");
    let want = expected();
    for name in ["bytelevel-bpe.json", "spm-unigram.model", "spm-bpe.model", "spm-bpe-nfkc.model"] {
        let e = &want[name];
        let jsonl = dir.join(format!("{name}.jsonl"));
        let texts = e["texts"].as_array().unwrap();
        let lines: Vec<String> = texts.iter().map(|t| serde_json::json!({"text": t, "id": 1}).to_string()).collect();
        std::fs::write(&jsonl, lines.join("\n") + "\n\n").unwrap();
        let out = dir.join(format!("{name}-shards"));
        let stdout = ok(&[
            "data",
            "prepare",
            "--tokenizer",
            s(&fixture(&format!("tokenizers/{name}"))),
            "--input",
            s(&jsonl),
            "--out",
            s(&out),
        ]);
        let eos = e["eos_id"].as_u64().unwrap() as u32;
        let mut stream = Vec::new();
        let mut documents = 0;
        for (text, reference) in texts.iter().zip(e["ids"].as_array().unwrap()) {
            if text.as_str().unwrap().is_empty() {
                continue; // an empty document is no document
            }
            stream.extend(ids(reference));
            stream.push(eos);
            documents += 1;
        }
        let shards = Shards::open(&out).unwrap();
        let mut got = vec![0; shards.len()];
        shards.read(0, &mut got);
        assert_eq!(got, stream, "{name}");
        let r = report(&out);
        assert_eq!((r.documents, r.tokens, r.eos_id), (documents, stream.len() as u64, eos), "{name}");
        assert!(stdout.contains(&format!("prepared {documents} documents, {} tokens", stream.len())), "{stdout}");
        assert!(stdout.contains("tokens/s"), "the report gives the throughput: {stdout}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Plain text: one document per file, or documents between separator lines; directories are
/// read in name order; shards are cut at the size asked for and read back as one stream.
#[test]
fn text_files_directories_and_shard_sizes() {
    let dir = scratch("prepare-text");
    let tokenizer = fixture("tokenizers/spm-bpe.model");
    let corpus = dir.join("corpus");
    std::fs::create_dir_all(corpus.join("b")).unwrap();
    std::fs::write(corpus.join("a.txt"), "First file.\nSecond line.\n").unwrap();
    std::fs::write(corpus.join("b/c.txt"), "one\n===\ntwo\nlines\n===\n\n===\nthree").unwrap();
    let out = dir.join("shards");
    ok(&[
        "data",
        "prepare",
        "--tokenizer",
        s(&tokenizer),
        "--input",
        s(&corpus),
        "--out",
        s(&out),
        "--separator",
        "===",
        "--shard-tokens",
        "8",
    ]);
    let r = report(&out);
    assert_eq!(r.inputs.len(), 2);
    assert!(r.inputs[0].ends_with("a.txt") && r.inputs[1].ends_with("c.txt"));
    assert_eq!(r.documents, 5, "a.txt, then one / two lines / (blank line) / three");
    assert!(r.shards.len() > 1, "{:?}", r.shards);
    let first = Shard::open(&out.join(&r.shards[0])).unwrap();
    assert!(first.len() >= 8 && first.header.documents >= 1);
    // The documents, tokenized one by one with the same tokenizer, make up the stream.
    let t = engine::data::tokenizer::TextTokenizer::open(&tokenizer).unwrap();
    let mut want = Vec::new();
    for doc in ["First file.\nSecond line.\n", "one\n", "two\nlines\n", "\n", "three"] {
        want.extend(t.encode(doc).unwrap());
        want.push(2);
    }
    let shards = Shards::open(&out).unwrap();
    let mut got = vec![0; shards.len()];
    shards.read(0, &mut got);
    assert_eq!(got, want);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run trains on prepared shards (and the loss goes down).
#[test]
fn training_reads_prepared_shards() {
    let dir = scratch("prepare-train");
    let out = dir.join("shards");
    assert!(prepare_shakespeare(&out, &[]).status.success());
    let run = dir.join("run");
    let path = format!("data.path={}", out.display());
    ok(&[
        "train",
        "--recipe",
        "tiny-llama2",
        "--run-dir",
        s(&run),
        "--steps",
        "12",
        "--set",
        "data.source=shards",
        "--set",
        &path,
        "--set",
        "model.vocab_size=512",
        "--set",
        "model.d_model=64",
        "--set",
        "model.mlp_dim=128",
        "--set",
        "model.n_heads=4",
        "--set",
        "model.head_dim=16",
        "--set",
        "model.n_kv_heads=2",
        "--set",
        "train.batch_size=4",
        "--set",
        "optim.lr=3e-3",
    ]);
    let m = metrics(&run);
    assert!(m[11]["loss"].as_f64().unwrap() < 0.9 * m[0]["loss"].as_f64().unwrap(), "{m:?}");
    let e = fails(
        &[
            "train",
            "--recipe",
            "tiny-llama2",
            "--run-dir",
            s(&dir.join("r2")),
            "--set",
            "data.source=shards",
            "--set",
            &path,
            "--set",
            "model.vocab_size=300",
        ],
        "a tokenizer of 512 tokens, more than model.vocab_size = 300",
    );
    assert!(e.contains(&out.display().to_string()));
    fails(
        &["train", "--recipe", "tiny-llama2", "--run-dir", s(&dir.join("r3")), "--set", "data.source=shards"],
        "needs data.path",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Bad input: one line naming the file (and line), exit code 2, and no shard left behind.
#[test]
fn bad_input_is_named_with_file_and_line() {
    let dir = scratch("prepare-errors");
    let tok = fixture("tokenizers/spm-unigram.model");
    let good = dir.join("good.jsonl");
    std::fs::write(&good, "{\"text\": \"fine\"}\n".repeat(3)).unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let small = write("small.toml", b"extends = \"tiny-llama2\"\n[model]\nvocab_size = 500\n");
    let cases: Vec<(Vec<String>, String)> = vec![
        (
            vec![s(&dir.join("missing.txt")).into()],
            "input ".to_string() + s(&dir.join("missing.txt")) + ": No such file",
        ),
        (
            vec![s(&good).into(), s(&write("utf8.jsonl", b"{\"text\": \"ok\"}\n{\"text\": \"caf\xe9\"}\n")).into()],
            "utf8.jsonl:2: not valid UTF-8".into(),
        ),
        (vec![s(&write("latin1.txt", b"line one\nline \xff two\n")).into()], "latin1.txt:2: not valid UTF-8".into()),
        (
            vec![s(&write("json.jsonl", b"{\"text\": \"ok\"}\n\n{\"text\": \"unclosed}\n")).into()],
            "json.jsonl:3: EOF while parsing".into(),
        ),
        (
            vec![s(&write("field.jsonl", b"{\"content\": \"x\"}\n")).into()],
            "field.jsonl:1: the object has no `text` field".into(),
        ),
        (
            vec![s(&write("type.jsonl", b"{\"text\": 5}\n")).into()],
            "type.jsonl:1: invalid type: integer `5`, expected a string".into(),
        ),
    ];
    for (i, (inputs, expected)) in cases.iter().enumerate() {
        let out = dir.join(format!("out-{i}"));
        let mut args = vec!["data", "prepare", "--tokenizer", s(&tok), "--out", s(&out)];
        for input in inputs {
            args.extend(["--input", input.as_str()]);
        }
        fails(&args, expected);
        assert!(!out.exists(), "{expected}: {} was left behind", out.display());
    }
    let out = dir.join("out");
    fails(
        &["data", "prepare", "--tokenizer", s(&tok), "--input", s(&good), "--out", s(&out), "--recipe", s(&small)],
        "has a vocabulary of 600 tokens, more than model.vocab_size = 500 of recipe `small`",
    );
    fails(
        &["data", "prepare", "--tokenizer", s(&dir.join("nope.json")), "--input", s(&good), "--out", s(&out)],
        "cannot read tokenizer",
    );
    fails(
        &["data", "prepare", "--tokenizer", s(&good), "--input", s(&good), "--out", s(&out)],
        "good.jsonl is not a valid tokenizer.json",
    );
    let garbage = write("garbage.model", &[0xff, 0x00, 0x13, 0x37]);
    fails(
        &["data", "prepare", "--tokenizer", s(&garbage), "--input", s(&good), "--out", s(&out)],
        "neither a tokenizer.json nor a SentencePiece .model file",
    );
    fails(
        &["data", "prepare", "--tokenizer", s(&tok), "--input", s(&good), "--out", s(&out), "--eos", "<nope>"],
        "--eos <nope>: no such token",
    );
    ok(&["data", "prepare", "--tokenizer", s(&tok), "--input", s(&good), "--out", s(&out)]);
    fails(&["data", "prepare", "--tokenizer", s(&tok), "--input", s(&good), "--out", s(&out)], "already holds shards");
    // A truncated shard is refused by name when training reads it.
    let shard = out.join("shard-00000.tok");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 2]).unwrap();
    let path = format!("data.path={}", out.display());
    fails(
        &[
            "train",
            "--recipe",
            "tiny-llama2",
            "--run-dir",
            s(&dir.join("run")),
            "--set",
            "data.source=shards",
            "--set",
            &path,
        ],
        "shard-00000.tok is",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// What a killed `engine data prepare` leaves (some final-named shards, a temporary file, no
/// `prepare.json`) is reported when training reads it, and cleaned by the next prepare into
/// the same directory; a shard missing from, or added to, a complete preparation is named; a
/// token outside its shard's vocabulary, or a vocabulary of 0, is refused with the shard, the
/// position and the value, before any training.
#[test]
fn interrupted_or_damaged_preparations_never_train() {
    let dir = scratch("prepare-damaged");
    let out = dir.join("shards");
    let prepare = |out: &Path| prepare_shakespeare(out, &["--shard-tokens", "2000", "--separator", ""]);
    assert!(prepare(&out).status.success());
    let shards = report(&out).shards;
    assert!(shards.len() >= 3, "{shards:?}");
    let path = format!("data.path={}", out.display());
    let train = |run: &str| {
        vec![
            "train".to_string(),
            "--recipe".into(),
            "tiny-llama2".into(),
            "--steps".into(),
            "1".into(),
            "--run-dir".into(),
            dir.join(run).display().to_string(),
            "--set".into(),
            "data.source=shards".into(),
            "--set".into(),
            path.clone(),
            "--set".into(),
            "model.vocab_size=512".into(),
        ]
    };

    fn args(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }

    // A complete preparation with a shard removed, then with an extra one.
    let last = out.join(shards.last().unwrap());
    let kept = std::fs::read(&last).unwrap();
    std::fs::remove_file(&last).unwrap();
    fails(&args(&train("r1")), &format!("shard {}, listed in prepare.json, is missing", shards.last().unwrap()));
    std::fs::write(&last, &kept).unwrap();
    std::fs::write(out.join("shard-99999.tok"), &kept).unwrap();
    fails(&args(&train("r2")), "shard-99999.tok is not listed in prepare.json");
    std::fs::remove_file(out.join("shard-99999.tok")).unwrap();

    // What a kill leaves: the first shards, a temporary one, no manifest.
    std::fs::remove_file(out.join("prepare.json")).unwrap();
    std::fs::remove_file(&last).unwrap();
    std::fs::write(out.join(format!(".{}.tmp-12345", shards.last().unwrap())), b"partial").unwrap();
    let e = fails(&args(&train("r3")), "did not finish");
    assert!(e.contains("no prepare.json"), "{e}");
    let again = prepare(&out);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert!(String::from_utf8_lossy(&again.stderr).contains("left in"), "the cleanup is reported");
    assert!(!std::fs::read_dir(&out).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().contains(".tmp-")));
    ok(&args(&train("r4")));

    // A token outside the header's vocabulary (2-byte tokens: 60000 >= 512), then a vocabulary of 0.
    let first = out.join(&shards[0]);
    let mut bytes = std::fs::read(&first).unwrap();
    let at = 64 + 2 * 7;
    bytes[at..at + 2].copy_from_slice(&60000u16.to_le_bytes());
    std::fs::write(&first, &bytes).unwrap();
    let e = fails(&args(&train("r5")), "token 60000 at position 7 is outside the vocabulary of 512");
    assert!(e.contains(&shards[0]), "{e}");
    bytes[32..36].copy_from_slice(&0u32.to_le_bytes());
    std::fs::write(&first, &bytes).unwrap();
    fails(&args(&train("r6")), "declares a vocabulary of 0 tokens");
    assert!(!dir.join("r5").exists() && !dir.join("r6").exists(), "a refused run leaves no run directory");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run resumes only on the data it trained on, even when a shard keeps its length: a shard
/// prepared again (a new header digest) is refused at the resume naming it, one edited in place
/// (the header kept) when it is opened. Before the data record, both resumed on other tokens.
#[test]
fn a_resumed_run_whose_shards_changed_content_is_refused() {
    let dir = scratch("resume-changed");
    let out = dir.join("shards");
    assert!(prepare_shakespeare(&out, &["--shard-tokens", "2000", "--separator", ""]).status.success());
    let shards = report(&out).shards;
    let path = format!("data.path={}", out.display());
    let run = dir.join("run");
    let train = |steps: &'static str, resume: bool| {
        let mut a = vec!["train", "--recipe", "tiny-llama2", "--steps", steps, "--run-dir", s(&run)];
        a.extend(["--set", "data.source=shards", "--set", &path, "--set", "model.vocab_size=512"]);
        a.extend(["--set", "train.checkpoint_every=2"]);
        if resume {
            a.push("--resume");
        }
        a.into_iter().map(String::from).collect::<Vec<String>>()
    };
    fn args(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    ok(&args(&train("2", false)));

    // The same length, other tokens, and a header that says so: a shard prepared again.
    let second = out.join(&shards[1]);
    let original = std::fs::read(&second).unwrap();
    let mut bytes = original.clone();
    let token = u16::from_le_bytes([bytes[64], bytes[65]]);
    bytes[64..66].copy_from_slice(&((token + 1) % 256).to_le_bytes());
    let digest = engine::data::shard::content_digest(&bytes[64..]);
    bytes[40..64].copy_from_slice(&digest);
    std::fs::write(&second, &bytes).unwrap();
    let e = fails(&args(&train("4", true)), &format!("shard {} in data.path = {}", shards[1], out.display()));
    assert!(e.contains("changed since the checkpoint was saved"), "{e}");

    // The same edit with the old header kept: the shard no longer matches its digest.
    bytes[40..64].copy_from_slice(&original[40..64]);
    std::fs::write(&second, &bytes).unwrap();
    let e = fails(&args(&train("4", true)), "do not match the content digest in its header");
    assert!(e.contains(&shards[1]), "{e}");

    // The data put back, the run resumes.
    std::fs::write(&second, &original).unwrap();
    let resumed = ok(&args(&train("4", true)));
    assert!(resumed.contains("resuming after step 2"), "{resumed}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Pax's path on a GPT: a SentencePiece vocabulary (the unigram model of the fixtures, 600
/// pieces), the corpus prepared with it, tiny-gpt trained on the shards (the loss falls), and the
/// trained checkpoint scored on LAMBADA passages with the same tokenizer.
#[test]
fn a_gpt_trains_on_a_sentencepiece_vocabulary_and_runs_lambada() {
    let dir = scratch("prepare-gpt-spm");
    let out = dir.join("shards");
    let tokenizer = fixture("tokenizers/spm-unigram.model");
    let text = concat!(env!("CARGO_MANIFEST_DIR"), "/data/shakespeare.txt");
    ok(&["data", "prepare", "--tokenizer", s(&tokenizer), "--input", text, "--out", s(&out)]);
    let run = dir.join("run");
    let path = format!("data.path={}", out.display());
    #[rustfmt::skip]
    ok(&[
        "train", "--recipe", "tiny-gpt", "--run-dir", s(&run), "--steps", "12",
        "--set", "data.source=shards", "--set", &path, "--set", "model.vocab_size=600",
        "--set", "train.batch_size=4", "--set", "optim.lr=3e-3", "--set", "train.checkpoint_every=12",
    ]);
    let m = metrics(&run);
    assert!(m[11]["loss"].as_f64().unwrap() < 0.9 * m[0]["loss"].as_f64().unwrap(), "{m:?}");
    let ck = run.join("checkpoints/step-000012");
    let lambada = fixture("lambada/lambada.jsonl");
    let result: serde_json::Value = serde_json::from_str(
        ok(&["eval", "--checkpoint", s(&ck), "--task", "lambada", "--data", s(&lambada), "--tokenizer", s(&tokenizer)])
            .trim(),
    )
    .unwrap();
    let lines = std::fs::read_to_string(&lambada).unwrap().lines().count() as u64;
    assert_eq!(result["examples"].as_u64(), Some(lines), "{result}");
    assert_eq!(result["per_example"].as_array().unwrap().len() as u64, lines);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The documents of `tests/fixtures/corpus/make.py`, which wrote the Arrow and Parquet fixtures
/// with pyarrow as Hugging Face `datasets` writes them (stream-format `.arrow`, dictionary-encoded
/// snappy Parquet).
const DOCS: [&str; 6] = [
    "The first document.\nIt has two lines.",
    "Zweites Dokument: café, naïve, 日本語, 🦀.",
    "  leading spaces and trailing  ",
    "",
    "{\"json\": \"inside\"}\ttabs\tand \\ backslashes",
    "last",
];

fn jsonl_of(docs: &[&str], field: &str) -> String {
    docs.iter().enumerate().map(|(i, d)| format!("{}\n", serde_json::json!({"id": i, field: d}))).collect()
}

/// A Parquet file written by the parquet crate: an id column, then the text (optional when some
/// cells are `None`).
fn write_parquet(path: &Path, docs: &[Option<&str>]) {
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::{properties::WriterProperties, writer::SerializedFileWriter};
    let nullable = docs.iter().any(Option::is_none);
    let schema = format!(
        "message m {{ required int64 id; {} binary text (UTF8); }}",
        if nullable { "optional" } else { "required" }
    );
    let schema = std::sync::Arc::new(parquet::schema::parser::parse_message_type(&schema).unwrap());
    let props = std::sync::Arc::new(WriterProperties::builder().build());
    let mut w = SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, props).unwrap();
    let mut group = w.next_row_group().unwrap();
    let ids: Vec<i64> = (0..docs.len() as i64).collect();
    let mut id = group.next_column().unwrap().unwrap();
    id.typed::<Int64Type>().write_batch(&ids, None, None).unwrap();
    id.close().unwrap();
    let mut text = group.next_column().unwrap().unwrap();
    let values: Vec<ByteArray> = docs.iter().flatten().map(|d| ByteArray::from(*d)).collect();
    let defs: Vec<i16> = docs.iter().map(|d| d.is_some() as i16).collect();
    text.typed::<ByteArrayType>().write_batch(&values, nullable.then_some(&defs[..]), None).unwrap();
    text.close().unwrap();
    group.close().unwrap();
    w.close().unwrap();
}

fn shard_tokens(out: &Path) -> Vec<u32> {
    let shards = Shards::open(out).unwrap();
    let mut got = vec![0; shards.len()];
    shards.read(0, &mut got);
    got
}

/// Issue 25: the same documents as JSON lines, gzip (`.json.gz`, C4's form), zstd (`.jsonl.zst`,
/// the Pile's), bzip2, Parquet (the parquet crate's and pyarrow's) and Arrow IPC (Hugging Face's
/// stream cache files, an IPC file with a `large_string` column named by `--text-field`) give the
/// same shards; a directory of all of them gives the same shards on 1 thread and on 2.
#[test]
fn every_published_form_of_a_corpus_gives_the_same_shards() {
    use std::io::Write;
    let dir = scratch("prepare-forms");
    let tok = fixture("tokenizers/bytelevel-bpe.json");
    let corpus = dir.join("corpus");
    std::fs::create_dir_all(&corpus).unwrap();
    let jsonl = jsonl_of(&DOCS, "text");
    std::fs::write(corpus.join("a.jsonl"), &jsonl).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(jsonl.as_bytes()).unwrap();
    std::fs::write(corpus.join("b.json.gz"), gz.finish().unwrap()).unwrap();
    // Two zstd frames, as zstd -T and pzstd write them.
    let half = jsonl.find("\n{").unwrap() + 1;
    let mut zst =
        ruzstd::encoding::compress_to_vec(&jsonl.as_bytes()[..half], ruzstd::encoding::CompressionLevel::Fastest);
    zst.extend(ruzstd::encoding::compress_to_vec(
        &jsonl.as_bytes()[half..],
        ruzstd::encoding::CompressionLevel::Fastest,
    ));
    std::fs::write(corpus.join("c.jsonl.zst"), zst).unwrap();
    let mut bz = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::fast());
    bz.write_all(jsonl.as_bytes()).unwrap();
    std::fs::write(corpus.join("d.jsonl.bz2"), bz.finish().unwrap()).unwrap();
    write_parquet(&corpus.join("e.parquet"), &DOCS.map(Some));
    std::fs::copy(fixture("corpus/docs.parquet"), corpus.join("f.parquet")).unwrap();
    std::fs::copy(fixture("corpus/docs.arrow"), corpus.join("g.arrow")).unwrap();

    let prepare = |input: &Path, out: &str, extra: &[&str]| {
        let out = dir.join(out);
        let mut args = vec!["data", "prepare", "--tokenizer", s(&tok), "--input", s(input), "--out", s(&out)];
        args.extend_from_slice(extra);
        ok(&args);
        (shard_tokens(&out), report(&out))
    };
    let (want, r) = prepare(&corpus.join("a.jsonl"), "a", &[]);
    assert_eq!(r.documents, 5, "the empty document is no document");
    let t = engine::data::tokenizer::TextTokenizer::open(&tok).unwrap();
    let reference: Vec<u32> =
        DOCS.iter().filter(|d| !d.is_empty()).flat_map(|d| t.encode(d).unwrap().into_iter().chain([1])).collect();
    assert_eq!(want, reference);
    for name in ["b.json.gz", "c.jsonl.zst", "d.jsonl.bz2", "e.parquet", "f.parquet", "g.arrow"] {
        let (got, r) = prepare(&corpus.join(name), name, &[]);
        assert_eq!(got, want, "{name}");
        assert_eq!(r.text_bytes, DOCS.iter().map(|d| d.len() as u64).sum::<u64>(), "{name}");
    }
    let (got, _) = prepare(&fixture("corpus/docs-file.arrow"), "file.arrow", &["--text-field", "content"]);
    assert_eq!(got, want, "an IPC file with a large_string column");
    std::fs::write(dir.join("content.jsonl"), jsonl_of(&DOCS, "content")).unwrap();
    let (got, _) = prepare(&dir.join("content.jsonl"), "content", &["--text-field", "content"]);
    assert_eq!(got, want, "--text-field in JSON lines");

    let all = |threads: &str, out: &str| {
        let out = dir.join(out);
        let args =
            ["--threads", threads, "data", "prepare", "--tokenizer", s(&tok), "--input", s(&corpus), "--out", s(&out)];
        ok(&args);
        shard_tokens(&out)
    };
    let one = all("1", "all-1");
    assert_eq!(one, want.repeat(7), "seven files, in name order");
    assert_eq!(all("2", "all-2"), one);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 25: a damaged or unreadable corpus gets one line naming the file (and the line or row),
/// exit code 2, and leaves no output directory.
#[test]
fn damaged_corpora_are_named_and_leave_nothing() {
    use std::io::Write;
    let dir = scratch("prepare-damaged-forms");
    let tok = fixture("tokenizers/spm-unigram.model");
    let jsonl: String =
        (0..2000).map(|i| format!("{{\"text\": \"document {i} of the corpus, some words\"}}\n")).collect();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(jsonl.as_bytes()).unwrap();
    let gz = gz.finish().unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let truncated = write("c4-train.json.gz", &gz[..gz.len() / 2]);
    let mut zst = ruzstd::encoding::compress_to_vec(jsonl.as_bytes(), ruzstd::encoding::CompressionLevel::Fastest);
    let mid = zst.len() / 2;
    zst[mid..mid + 64].fill(0x55);
    let garbage = write("00.jsonl.zst", &zst);
    let parquet = dir.join("docs.parquet");
    write_parquet(&parquet, &DOCS.map(Some));
    let nulls = dir.join("nulls.parquet");
    write_parquet(&nulls, &[Some("a"), None, Some("c")]);
    let not_ipc = write("data-00000-of-00001.arrow", jsonl.as_bytes());
    let arrow = fixture("corpus/docs.arrow");
    // Issue 37's crafted Arrow streams, as the fuzz target's seeds keep them: a row count whose
    // offsets' size wrapped around (a panic), a schema nested 3,000 levels deep (300,000
    // overflowed the stack, leaving --out holding a .lock).
    let seed =
        |name: &str| std::fs::read(format!("{}/../fuzz/seeds/arrow_ipc/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let wrapped = write("wrapped.arrow", &seed("rows-wrap"));
    let deep = write("deep.arrow", &seed("deep-schema"));
    let cases: Vec<(&Path, &str, String)> = vec![
        (&truncated, "text", format!("{}: cannot decompress after line", s(&truncated))),
        (&garbage, "text", format!("{}: cannot decompress after line", s(&garbage))),
        (&parquet, "body", format!("{}: no column `body` (the columns: id, text)", s(&parquet))),
        (&parquet, "id", format!("{}: column `id` holds INT64, not strings", s(&parquet))),
        (&nulls, "text", format!("{}: row 2: the `text` cell is null", s(&nulls))),
        (&arrow, "id", format!("{}: column `id` holds int, not strings", s(&arrow))),
        (&arrow, "body", "no column `body` (the columns: id, meta, text)".into()),
        (&not_ipc, "text", format!("{}: not an Arrow IPC stream", s(&not_ipc))),
        (&wrapped, "text", format!("{}: a record batch declares 4611686018427387903 rows", s(&wrapped))),
        (&deep, "text", format!("{}: the schema nests fields more than 64 levels deep", s(&deep))),
    ];
    for (i, (input, field, expected)) in cases.iter().enumerate() {
        let out = dir.join(format!("out-{i}"));
        #[rustfmt::skip]
        fails(&["data", "prepare", "--tokenizer", s(&tok), "--input", s(input), "--out", s(&out), "--text-field", field], expected);
        assert!(!out.exists(), "{expected}: {} was left behind", out.display());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 28, item 4: a preparation holds `--out`'s lock for its life; a second one into the
/// same directory is refused instead of deleting the first one's shards as leftovers. The lock
/// file is never opened through a symbolic link.
#[test]
fn a_second_prepare_into_the_same_out_is_refused() {
    let dir = scratch("prepare-lock");
    let out = dir.join("shards");
    std::fs::create_dir_all(&out).unwrap();
    let held = engine::fsutil::DirLock::acquire(&out, "test", "").unwrap();
    let e = fails(
        &[
            "data",
            "prepare",
            "--tokenizer",
            s(&fixture("tokenizers/bytelevel-bpe.json")),
            "--input",
            s(&fixture("corpus/docs.arrow")),
            "--out",
            s(&out),
        ],
        &format!("--out {} is in use by process {}", s(&out), std::process::id()),
    );
    assert!(e.contains("engine data prepare"), "{e}");
    drop(held);
    assert!(prepare_shakespeare(&out, &[]).status.success());
    let victim = dir.join("victim");
    std::fs::write(&victim, "keep").unwrap();
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::os::unix::fs::symlink(&victim, other.join(".lock")).unwrap();
    assert!(!prepare_shakespeare(&other, &[]).status.success(), "a symbolic link as the lock is refused");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 28, item 5: an `--out` inside an `--input` is refused, and the outputs of earlier
/// preparations found inside an input directory (a `prepare.json` directory, stray shards) are
/// not read as text.
#[test]
fn outputs_of_preparations_are_never_inputs() {
    let dir = scratch("prepare-nested");
    let tok = fixture("tokenizers/bytelevel-bpe.json");
    let corpus = dir.join("c");
    std::fs::create_dir_all(&corpus).unwrap();
    std::fs::write(corpus.join("a.jsonl"), jsonl_of(&DOCS, "text")).unwrap();
    let inside = corpus.join("shards");
    #[rustfmt::skip]
    fails(&["data", "prepare", "--tokenizer", s(&tok), "--input", s(&corpus), "--out", s(&inside)], "is inside --input");
    assert!(!inside.exists());
    let out = dir.join("out");
    ok(&["data", "prepare", "--tokenizer", s(&tok), "--input", s(&corpus), "--out", s(&out)]);
    let want = shard_tokens(&out);
    // An earlier preparation moved into the corpus, and a stray shard.
    std::fs::rename(&out, &inside).unwrap();
    std::fs::copy(inside.join("shard-00000.tok"), corpus.join("stray.tok")).unwrap();
    let again = dir.join("again");
    ok(&["data", "prepare", "--tokenizer", s(&tok), "--input", s(&corpus), "--out", s(&again)]);
    assert_eq!(shard_tokens(&again), want);
    assert_eq!(report(&again).inputs.len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 28, item 6: a large document (a plain text file without separators) is tokenized in
/// parts, so memory follows the part size and the thread count, not the document (a 4 MB one
/// took 800 MB before); the parts are cut where tokens do not change.
#[test]
#[allow(clippy::zombie_processes)] // waited for by wait4, which gives its peak memory
fn a_large_document_is_tokenized_in_bounded_memory() {
    let dir = scratch("prepare-large");
    let tok = fixture("tokenizers/bytelevel-bpe.json");
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/data/shakespeare.txt")).unwrap();
    let big = dir.join("big.txt");
    std::fs::write(&big, text.repeat(32)).unwrap(); // 4 MB, one document
    let out = dir.join("out");
    let mut cmd = engine_cmd(&["data", "prepare", "--tokenizer", s(&tok), "--input", s(&big), "--out", s(&out)]);
    let child = cmd.env("ENGINE_THREADS", "2").stdout(std::process::Stdio::null()).spawn().unwrap();
    let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
    // SAFETY: waiting for our own child, with pointers to locals.
    assert_eq!(unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) }, child.id() as i32);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    let peak_mb = usage.ru_maxrss / 1024;
    assert!(peak_mb < 400, "a 4 MB document took {peak_mb} MB");
    assert_eq!(report(&out).documents, 1);
    // Where a tokenizer's seams are checked to keep tokens, parts give the whole's tokens: on a
    // text cut into 4 KB parts. The byte-level BPE is one of them.
    let sample = &text[..64 << 10];
    for name in ["bytelevel-bpe.json", "spm-unigram.model", "spm-bpe.model", "spm-bpe-nfkc.model"] {
        let t = engine::data::tokenizer::TextTokenizer::open(&fixture(&format!("tokenizers/{name}"))).unwrap();
        let splits = engine::data::prepare::seams_keep_tokens(&t).unwrap();
        assert!(splits || name != "bytelevel-bpe.json");
        if !splits {
            continue;
        }
        let (mut parts, mut rest) = (Vec::new(), sample);
        while rest.len() > 4096 {
            let cut = engine::data::readers::seam(rest, 4096);
            parts.extend(t.encode(&rest[..cut]).unwrap());
            rest = &rest[cut..];
        }
        parts.extend(t.encode(rest).unwrap());
        assert_eq!(parts, t.encode(sample).unwrap(), "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 28, item 6: out of memory in `engine data prepare` (a 4 MB document with a
/// SentencePiece model, which tokenizes documents whole, under a 150 MB address space) is one
/// line with advice for preparing data, not for training.
#[test]
fn out_of_memory_in_a_preparation_advises_on_preparing() {
    use std::os::unix::process::CommandExt;
    let dir = scratch("prepare-oom");
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/data/shakespeare.txt")).unwrap();
    let big = dir.join("big.txt");
    std::fs::write(&big, text.repeat(32)).unwrap();
    let tok = fixture("tokenizers/spm-unigram.model");
    let out = dir.join("out");
    let mut cmd = engine_cmd(&[
        "--threads",
        "1",
        "data",
        "prepare",
        "--tokenizer",
        s(&tok),
        "--input",
        s(&big),
        "--out",
        s(&out),
    ]);
    // SAFETY: setrlimit is async-signal-safe; the closure allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 150 << 20, rlim_max: 150 << 20 };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("out of memory") && stderr.contains("--threads"), "{stderr}");
    assert!(!stderr.contains("train.batch_size"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 25's mixtures: 0.75/0.25 over 200 steps of a tiny model trains within 5 % of those
/// shares (`tokens_by_source` in the metrics and the summary), a second run is bitwise the
/// same, and one stopped halfway and resumed ends on the uninterrupted curve. A validation set of
/// its own gives `eval_loss`; bad mixtures and missing datasets are one line each.
#[test]
fn a_mixture_trains_on_its_shares_and_resumes_on_the_same_curve() {
    let dir = scratch("mixture");
    let (prose, lists) = (dir.join("prose"), dir.join("lists"));
    assert!(prepare_shakespeare(&prose, &[]).status.success());
    let numbers: String = (0..3000).map(|i| format!("{i} {} {}\n", i * 7 % 1000, i * 13 % 100)).collect();
    std::fs::write(dir.join("lists.txt"), numbers).unwrap();
    let tok = fixture("tokenizers/bytelevel-bpe.json");
    let o =
        engine(&["data", "prepare", "--tokenizer", s(&tok), "--input", s(&dir.join("lists.txt")), "--out", s(&lists)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mixture = format!(
        "data.mixture=[{{path=\"{}\",weight=0.75}},{{path=\"{}\",weight=0.25,name=\"lists\"}}]",
        s(&prose),
        s(&lists)
    );
    let train = |run: &Path, steps: &str, extra: &[&str]| -> Vec<String> {
        let mut a = vec!["train", "--recipe", "tiny-llama2", "--run-dir", s(run), "--steps", steps];
        for set in [
            "model.vocab_size=512",
            "model.d_model=32",
            "model.mlp_dim=64",
            "model.n_heads=2",
            "model.n_kv_heads=2",
            "model.head_dim=16",
            "train.seq_len=16",
            "train.batch_size=2",
            "train.peak_tflops=1",
            "optim.decay_steps=200",
            "data.source=shards",
        ] {
            a.extend(["--set", set]);
        }
        a.extend(extra);
        a.into_iter().map(String::from).collect()
    };
    fn args(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    fn losses(run: &Path) -> Vec<f64> {
        metrics(run).iter().map(|m| m["loss"].as_f64().unwrap()).collect()
    }
    let mix = ["--set", mixture.as_str()];

    let whole = dir.join("whole");
    let printed = ok(&args(&train(&whole, "200", &mix)));
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(whole.join("summary.json")).unwrap()).unwrap();
    let by_source = &summary["tokens_by_source"];
    let (p, l) = (by_source[s(&prose)].as_u64().unwrap(), by_source["lists"].as_u64().unwrap());
    assert_eq!(p + l, 200 * 2 * 16, "{summary}");
    for (tokens, share) in [(p, 0.75), (l, 0.25)] {
        let got = tokens as f64 / (p + l) as f64;
        assert!((got - share).abs() <= 0.05 * share, "{got} of the tokens where {share} was asked: {summary}");
    }
    let shares = |a: u64, b: u64| (100.0 * a as f64 / (a + b) as f64, 100.0 * b as f64 / (a + b) as f64);
    let (ls, ps) = shares(l, p);
    // By name: the absolute path of prose before lists.
    let line = format!("tokens by source: {} {p} ({ps:.1}%), lists {l} ({ls:.1}%)", s(&prose));
    assert!(printed.contains(&line), "{printed}");
    let m = metrics(&whole);
    assert_eq!(m[199]["tokens_by_source"], *by_source);
    assert_eq!(m[0]["tokens_by_source"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum::<u64>(), 32);

    let again = dir.join("again");
    ok(&args(&train(&again, "200", &mix)));
    assert_eq!(losses(&again), losses(&whole), "two runs of the same mixture differ");

    let halves = dir.join("halves");
    let every = ["--set", "train.checkpoint_every=100"];
    ok(&args(&train(&halves, "100", &[&mix[..], &every[..]].concat())));
    let resumed = ok(&args(&train(&halves, "200", &[&mix[..], &every[..], &["--resume"]].concat())));
    assert!(resumed.contains("resuming after step 100"), "{resumed}");
    assert_eq!(losses(&halves), losses(&whole), "the resumed run left the uninterrupted curve");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(halves.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["tokens_by_source"], *by_source);

    // Two data-parallel devices, as threads and as processes (a global batch of two sequences,
    // one each): every rank draws the same decisions, so each step reads the same sources, and
    // the curve is the single device's up to the order of the gradient sums.
    let one_each = ["--set", "train.batch_size=1", "--set", mixture.as_str()];
    let threads = dir.join("threads");
    ok(&args(&[&train(&threads, "200", &one_each)[..], &["--devices".into(), "2".into()]].concat()));
    let processes = dir.join("processes");
    let launch: Vec<String> = ["launch", "--nproc", "2", "--"].map(String::from).to_vec();
    ok(&args(&[&launch[..], &train(&processes, "200", &one_each)].concat()));
    assert_eq!(losses(&processes), losses(&threads), "two processes left two virtual devices' curve");
    let by_step = |run: &Path| metrics(run).iter().map(|m| m["tokens_by_source"].clone()).collect::<Vec<_>>();
    assert_eq!(by_step(&processes), by_step(&whole));
    for (step, (a, b)) in losses(&processes).iter().zip(losses(&whole)).enumerate() {
        assert!((a - b).abs() <= 1e-4 * b, "step {}: loss {a} on two ranks, {b} on one", step + 1);
    }

    // data.validation_path: eval_loss on that set; no tail of the training data is held out
    // then, so two runs evaluating on two sets train alike, and the run on the tail does not.
    // The second set is text the model never trains on, but like its own: Shakespeare's lines
    // with their words in reverse order (the training data itself is refused, below).
    let verse = dir.join("verse");
    let reversed: String = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/data/shakespeare.txt"))
        .unwrap()
        .lines()
        .map(|l| l.split(' ').rev().collect::<Vec<_>>().join(" ") + "\n")
        .collect();
    std::fs::write(dir.join("verse.txt"), reversed).unwrap();
    let o =
        engine(&["data", "prepare", "--tokenizer", s(&tok), "--input", s(&dir.join("verse.txt")), "--out", s(&verse)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let eval = |name: &str, extra: &[&str]| {
        let run = dir.join(name);
        let mut e = vec!["--set", "train.eval_every=50", "--set", "train.eval_steps=4", "--set", "optim.lr=3e-3"];
        e.extend(extra);
        ok(&args(&train(&run, "50", &e)));
        (losses(&run), metrics(&run)[49]["eval_loss"].as_f64().unwrap())
    };
    let path = format!("data.path={}", s(&prose));
    let on = |set: &Path| format!("data.validation_path={}", s(set));
    let (on_lists, on_verse) = (on(&lists), on(&verse));
    let (trained, lists_eval) = eval("on-lists", &["--set", &path, "--set", &on_lists]);
    let (same, verse_eval) = eval("on-verse", &["--set", &path, "--set", &on_verse]);
    let (tail_trained, _) = eval("on-tail", &["--set", &path]);
    assert_eq!(trained, same, "the validation set changed the training");
    assert_ne!(trained, tail_trained, "a tail was held out beside the validation set");
    assert!((lists_eval - verse_eval).abs() > 0.05, "eval loss {lists_eval} on lists, {verse_eval} on verse");

    // Bad input: one line naming the entry, exit code 2.
    let bad = |set: &str, expected: &str| {
        fails(&args(&train(&dir.join("bad"), "1", &["--set", set])), expected);
    };
    let mut negative = mixture.replace("weight=0.25", "weight=-0.5");
    bad(&negative, "data.mixture[1].weight = -0.5 (lists) must be a positive number");
    negative = mixture.replace("weight=0.25", "weight=0");
    bad(&negative, "data.mixture[1].weight = 0 (lists) must be a positive number");
    let missing = mixture.replace(s(&lists), s(&dir.join("nowhere")));
    bad(&missing, &format!("data.mixture[1] (path = {})", s(&dir.join("nowhere"))));
    let nowhere = on(&dir.join("nowhere"));
    fails(&args(&train(&dir.join("bad"), "1", &["--set", &path, "--set", &nowhere])), "data.validation_path = ");
    // The training data as its own validation set: eval_loss would be measured on what it trains.
    let itself =
        format!("data.validation_path = {0} shares shards with the training data of data.path = {0}: ", s(&prose));
    fails(&args(&train(&dir.join("bad"), "1", &["--set", &path, "--set", &on(&prose)])), &itself);
    let both = train(&dir.join("bad"), "1", &["--set", &mixture, "--set", &path]);
    fails(&args(&both), "and data.mixture are both set");
    std::fs::remove_dir_all(&dir).unwrap();
}
