//! The engine's SentencePiece encoder against the reference, the Python `sentencepiece`
//! package: models trained by that package in the test (Unigram and BPE; `nmt_nfkc`, `nfkc_cf`
//! and identity normalization; byte fallback; user-defined symbols; `split_digits`; no dummy
//! prefix; whitespace kept; whitespace as suffix; `escape_whitespaces` off; `unused` pieces),
//! every one asked to encode the same corpus of over 100 KB: the bundled Shakespeare text and
//! generated lines of accented, CJK, other-script, emoji and compatibility characters, digits,
//! the user-defined symbols, control pieces written as text, and whitespace runs (leading,
//! trailing, several spaces, tabs, newlines, no-break and ideographic spaces). Every token must
//! agree. `sentencepiece_reference.py` (beside this file) is the reference side.
//!
//! The package comes from the test venv that tests/run.sh installs (`ENGINE_TEST_PYTHON`); the
//! test is skipped without it, unless `ENGINE_TEST_REQUIRE_PYTHON=1` (CI), where it fails.

mod common;

use std::process::Command;
use std::time::Instant;

use common::*;
use engine::data::tokenizer::TextTokenizer;

/// A small deterministic generator (a 64-bit LCG, high bits out), so the corpus is the same on
/// every machine without a dependency.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len())]
    }
}

/// The test's documents: Shakespeare's paragraphs (their internal newlines kept), then generated
/// lines mixing its words with what English text lacks, then edge cases, then the whole text.
fn corpus() -> Vec<String> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/data/shakespeare.txt")).unwrap();
    let mut docs: Vec<String> = text.split("\n\n").map(str::to_owned).collect();
    let words: Vec<&str> = text.split_whitespace().collect();
    let unicode = [
        "café",
        "naïve",
        "Straße",
        "façade",
        "résumé",
        "Ångström",
        "Œuvre",
        "coöperate",
        "São Paulo",
        "Dvořák",
        "Łódź",
        "e\u{301}té",
        "A\u{30a}",
        "日本語",
        "東京タワー",
        "中文字符",
        "한국어",
        "ひらがな",
        "カタカナ",
        "ﾊﾝｶｸ",
        "Ελληνικά",
        "русский",
        "עברית",
        "العربية",
        "हिन्दी",
        "ไทย",
        "🙂",
        "🙂🙂",
        "👍🏽",
        "👨\u{200d}👩\u{200d}👧",
        "🇫🇷",
        "❤\u{fe0f}",
        "🤖!",
        "ﬁne",
        "ﬂow",
        "ＡＢＣ",
        "ｆｕｌｌ",
        "①②",
        "½",
        "™",
        "Ⅻ",
        "㎏",
        "𝔘𝔫𝔦",
        "☃",
        "⚡⚡",
        "☄",
        "\u{200b}",
        "x\u{feff}y",
        "\u{ad}",
        "Ǆ",
        "ﷺ",
        "<sep>",
        "@@",
        "a<sep>b",
        "<s>",
        "</s>",
        "<unk>",
        "<0x41>",
        "<pad>",
        "▁",
        "▁▁x",
    ];
    let digits = [
        "0",
        "7",
        "42",
        "1234567890",
        "3.14159",
        "1,234,567",
        "2024-01-15",
        "０１２",
        "１９８４",
        "٣٤",
        "99%",
        "v2.0.1",
    ];
    let gaps = [" ", " ", " ", " ", "  ", "   ", "\t", " \t ", "\n", "\r\n", "\n\n", "\u{a0}", "\u{3000}", "\u{2009}"];
    let edges = ["", " ", "   ", "\t", "\n", "\n\n", "x", " x ", "\t\tx\t\t", "▁", "<sep>", " <sep> "];
    let mut rng = Lcg(15);
    for _ in 0..600 {
        let mut line = String::new();
        for _ in 0..rng.below(3) {
            line.push_str(rng.pick(&gaps));
        }
        for w in 0..3 + rng.below(14) {
            if w > 0 {
                line.push_str(rng.pick(&gaps));
            }
            let word = match rng.below(6) {
                0 | 1 => rng.pick(&words).to_owned(),
                2 | 3 => rng.pick(&unicode).to_owned(),
                4 => rng.pick(&digits).to_owned(),
                _ => {
                    let n = rng.next().to_string();
                    docs.push(n.clone()); // also a document of its own: digits alone
                    n
                }
            };
            line.push_str(&word);
        }
        for _ in 0..rng.below(3) {
            line.push_str(rng.pick(&gaps));
        }
        docs.push(line);
    }
    docs.extend(edges.iter().map(|s| s.to_string()));
    // One document of the whole text: Unigram's best scores pass ±100000 on the way, where the
    // 0.2.3 encoder shifts them back to 0.
    docs.push(text);
    docs
}

/// How many tokens of a document differ: those between the common prefix and the common suffix
/// of the two encodings, on the longer side (coarse: one difference early in a long document
/// counts the rest of it).
fn differing(want: &[u32], got: &[u32]) -> usize {
    let prefix = want.iter().zip(got).take_while(|(a, b)| a == b).count();
    let rest = (&want[prefix..], &got[prefix..]);
    let suffix = rest.0.iter().rev().zip(rest.1.iter().rev()).take_while(|(a, b)| a == b).count();
    rest.0.len().max(rest.1.len()) - suffix
}

#[test]
fn encodings_match_the_sentencepiece_package() {
    let Some(python) = python_with("ENGINE_TEST_PYTHON", "sentencepiece.sentencepiece_model_pb2", true) else { return };
    let started = Instant::now();
    let dir = scratch("sentencepiece");
    let docs = corpus();
    let bytes: usize = docs.iter().map(String::len).sum();
    assert!(bytes >= 100_000, "the corpus has {bytes} bytes");
    std::fs::write(dir.join("docs.json"), serde_json::to_vec(&docs).unwrap()).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sentencepiece_reference.py");
    let out = Command::new(&python).args([script, s(&dir.join("docs.json")), s(&dir)]).output().unwrap();
    assert!(out.status.success(), "{script} failed: {}", String::from_utf8_lossy(&out.stderr));
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let reference_s = started.elapsed().as_secs_f64();

    let mut report = Vec::new();
    let mut failures = Vec::new();
    for (name, m) in reference["models"].as_object().unwrap() {
        let pieces: Vec<&str> = m["pieces"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        let show = |ids: &[u32]| ids.iter().map(|&i| pieces[i as usize]).collect::<Vec<_>>().join("|");
        let t = match TextTokenizer::open(std::path::Path::new(m["file"].as_str().unwrap())) {
            Ok(t) => t,
            Err(e) => {
                report.push(format!("{name}: refused ({e:#})"));
                failures.push(format!("{name}: refused: {e:#}"));
                continue;
            }
        };
        assert_eq!(t.vocab_size, pieces.len(), "{name}");
        let (mut total, mut wrong, mut examples) = (0, 0, Vec::new());
        for (doc, ids) in docs.iter().zip(m["ids"].as_array().unwrap()) {
            let want: Vec<u32> = ids.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect();
            let got = t.encode(doc).unwrap();
            total += want.len();
            let d = differing(&want, &got);
            wrong += d;
            if d > 0 && examples.len() < 5 {
                examples.push(format!("  {doc:?}\n    want {}\n    got  {}", show(&want), show(&got)));
            }
        }
        report.push(format!("{name}: {wrong} of {total} tokens differ"));
        if wrong > 0 {
            failures.push(format!("{name}: {wrong} of {total} tokens differ, e.g.\n{}", examples.join("\n")));
        }
    }
    eprintln!(
        "sentencepiece {} on {} documents, {bytes} bytes (reference {reference_s:.1} s, in all {:.1} s):\n{}",
        reference["version"].as_str().unwrap(),
        docs.len(),
        started.elapsed().as_secs_f64(),
        report.join("\n")
    );
    let version = reference["version"].as_str().unwrap();
    assert!(
        failures.is_empty(),
        "against sentencepiece {version} (the engine follows 0.2.3):\n{}",
        failures.join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model the reference library would refuse to load (here: a second unknown piece, appended as
/// one more protobuf `pieces` field) is refused in one line naming the file, exit code 2.
#[test]
fn a_model_the_reference_refuses_is_refused_in_one_line() {
    let dir = scratch("sentencepiece-refused");
    let mut bytes = std::fs::read(fixture("tokenizers/spm-unigram.model")).unwrap();
    let piece = [&[0x0a, 0x06][..], b"<unk2>", &[0x18, 0x02]].concat(); // piece "<unk2>", type UNKNOWN
    bytes.extend([0x0a, piece.len() as u8]);
    bytes.extend(piece);
    let model = dir.join("two-unknowns.model");
    std::fs::write(&model, &bytes).unwrap();
    let input = dir.join("in.txt");
    std::fs::write(&input, "some text").unwrap();
    let out = dir.join("out");
    let line = fails(
        &["data", "prepare", "--tokenizer", s(&model), "--input", s(&input), "--out", s(&out)],
        "two unknown pieces (ids 0 and ",
    );
    assert!(line.contains("two-unknowns.model"), "{line}");
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&dir);
}
