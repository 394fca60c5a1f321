"""The reference side of engine/tests/sentencepiece.rs: trains SentencePiece models with the
Python `sentencepiece` package on the test's corpus and writes what that package makes of it.

    python sentencepiece_reference.py DOCS.json OUT_DIR

DOCS.json is a JSON list of documents (strings). Trains every model of MODELS on those documents
(one training sentence per line), derives those of DERIVED, writes OUT_DIR/NAME.model, and OUT_DIR/reference.json:
{"version": ..., "models": {NAME: {"file", "ids": [[id, ...] per document], "pieces": [...]}}}.
"""

import json
import os
import sys
import time

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2  # needs the protobuf package

# Small vocabularies keep training to a fraction of a second each. Between them they cover both
# algorithms, the nmt_nfkc, nfkc_cf and identity normalizers, byte fallback and unknown
# characters, user-defined symbols, split_digits, add_dummy_prefix off, whitespace kept,
# treat_whitespace_as_suffix, escape_whitespaces off and `unused` pieces.
MODELS = {
    "unigram-nfkc": dict(model_type="unigram", vocab_size=2000, user_defined_symbols=["<sep>", "@@"]),
    "unigram-bytes": dict(model_type="unigram", vocab_size=2000, byte_fallback=True, character_coverage=0.995),
    "unigram-identity-digits": dict(
        model_type="unigram",
        vocab_size=1500,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
    ),
    "unigram-nfkc_cf-suffix": dict(
        model_type="unigram", vocab_size=1000, normalization_rule_name="nfkc_cf", treat_whitespace_as_suffix=True
    ),
    "unigram-no-dummy-prefix": dict(
        model_type="unigram", vocab_size=1000, add_dummy_prefix=False, byte_fallback=True, split_digits=True
    ),
    "bpe-nfkc": dict(model_type="bpe", vocab_size=2000, user_defined_symbols=["<sep>", "@@"]),
    "bpe-bytes": dict(
        model_type="bpe",
        vocab_size=2000,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=0.995,
    ),
    "bpe-suffix": dict(model_type="bpe", vocab_size=1000, treat_whitespace_as_suffix=True),
}



def no_escape(m):
    """escape_whitespaces off (the trainers refuse it): spaces stay spaces."""
    m.normalizer_spec.escape_whitespaces = False


def unused(m):
    """The normal pieces of several characters whose id is a multiple of 3 marked `unused`, as
    SentencePiece's SetVocabulary marks those left out of the vocabulary it is given."""
    for i, p in enumerate(m.pieces):
        if i % 3 == 0 and p.type == p.NORMAL and len(p.piece) > 1:
            p.type = p.UNUSED


# Models derived from a trained one by editing its protobuf, for what the trainers cannot make.
DERIVED = {
    "unigram-nfkc-no-escape": ("unigram-nfkc", no_escape),
    "bpe-suffix-no-escape": ("bpe-suffix", no_escape),
    "unigram-unused": ("unigram-nfkc", unused),
    "bpe-unused": ("bpe-nfkc", unused),
}


def main():
    docs_path, out = sys.argv[1], sys.argv[2]
    with open(docs_path, encoding="utf-8") as f:
        docs = json.load(f)
    train = os.path.join(out, "train.txt")
    with open(train, "w", encoding="utf-8") as f:
        f.write("\n".join(docs))
    result = {"version": spm.__version__, "models": {}}

    def record(name, proto):
        path = os.path.join(out, name + ".model")
        with open(path, "wb") as f:
            f.write(proto)
        sp = spm.SentencePieceProcessor(model_file=path)
        result["models"][name] = {
            "file": path,
            "ids": [sp.encode(d) for d in docs],
            "pieces": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
        }

    started = time.time()
    for name, options in MODELS.items():
        prefix = os.path.join(out, name)
        spm.SentencePieceTrainer.train(input=train, model_prefix=prefix, num_threads=1, minloglevel=2, **options)
        with open(prefix + ".model", "rb") as f:
            record(name, f.read())
    for name, (base, edit) in DERIVED.items():
        m = sentencepiece_model_pb2.ModelProto()
        with open(os.path.join(out, base + ".model"), "rb") as f:
            m.ParseFromString(f.read())
        edit(m)
        record(name, m.SerializeToString())
    result["seconds"] = time.time() - started
    with open(os.path.join(out, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
