#!/usr/bin/env bash
# Runs every fuzz target (or those named) under libFuzzer for a bounded time each.
# Not part of CI or tests/run.sh: it needs a nightly toolchain and cargo-fuzz
# (`rustup toolchain install nightly`, `cargo install cargo-fuzz`), and minutes per target.
#
#   fuzz/run.sh [--seconds N] [TARGET...]      default: 180 seconds each, every target
#
# Each target starts from its seeds (fuzz/seeds/TARGET, committed) and the corpus it grew before
# (fuzz/corpus/TARGET, not committed); an input that crashes, panics or times out is written to
# fuzz/artifacts/TARGET/ and the script exits non-zero after the other targets ran. A finding is
# fixed with a regression test beside the code it broke, and noted in docs/fuzzing.md.
set -euo pipefail
cd "$(dirname "$0")"
seconds=180
if [[ "${1:-}" == --seconds ]]; then
    seconds=$2
    shift 2
fi
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    targets=(recipe safetensors_header shard oci_manifest www_authenticate sources_manifest tcp_frame arrow_ipc)
fi
# Lowest priority: the machine is shared with builds and tests.
nice_run() { nice -n 19 "$@"; }
# One build of every target first (cargo fuzz run would build each on its own).
nice_run cargo +nightly fuzz build
failed=()
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t"
    echo "== $t: ${seconds}s"
    # -timeout: one input running 10 s is a hang; -rss_limit_mb: one using 2 GiB is a finding;
    # -max_len: parsers of headers and small documents need no more than 64 KiB to be exercised.
    if ! nice_run cargo +nightly fuzz run "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1; then
        failed+=("$t")
    fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "findings in: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
echo "no findings"
