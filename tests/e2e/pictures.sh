#!/usr/bin/env bash
# End-to-end test of the pictures people look at, in a real browser: test-all's report.html of a
# passing and of a failing run, and an `engine plot` SVG, each loaded in headless Chromium
# (Debian's `chromium`, installed when missing) by tests/e2e/lib/browser_check.py, which fails
# on any console message and on any request of the page that is not file://, and keeps a
# screenshot of each page in the output directory. A page made to fail (a console error and a
# request to a TEST-NET address) must fail the check, so that the check is known to bite.
#
#   tests/e2e/pictures.sh          # needs root for apt when chromium is missing; ~30 s
#
# Environment: PICTURES_E2E_WORK (work and output dir, default target/e2e-pictures).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${PICTURES_E2E_WORK:-$ROOT/target/e2e-pictures}
SHOTS=$WORK/screenshots
CHECK="python3 $ROOT/tests/e2e/lib/browser_check.py"
rm -rf "$WORK" && mkdir -p "$WORK" "$SHOTS"

if ! command -v chromium >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq chromium
fi

cargo build --release --locked -p engine --quiet
ENGINE="$ROOT/target/release/engine"
export -n ENGINE_FLAGS ENGINE_DEFAULT_FLAGS ENGINE_TEST_CURVE_OVERRIDES

# A failing baseline: tiny-gpt's step 3 and 6 moved outside their 0.1% (tiny-gpt trains fastest).
mkdir -p "$WORK/baselines/cpu"
python3 - "$ROOT/tests/baselines/cpu/quick.json" "$WORK/baselines/cpu/quick.json" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))
loss = v["recipes"]["tiny-gpt"]["loss"]
loss[2] *= 1.05
loss[5] *= 0.96
json.dump(v, open(sys.argv[2], "w"), indent=1)
PY
"$ENGINE" --device cpu test-all --quick --filter tiny-gpt --baselines "$ROOT/tests/baselines" \
    --report "$WORK/pass" --image e2e.local/llm@sha256:pass > "$WORK/pass.log" 2>&1
rc=0
"$ENGINE" --device cpu test-all --quick --filter tiny-gpt --baselines "$WORK/baselines" \
    --report "$WORK/fail" > "$WORK/fail.log" 2>&1 || rc=$?
[ "$rc" = 1 ] || { cat "$WORK/fail.log"; echo "FAIL: test-all against a broken baseline exited $rc, not 1"; exit 1; }
python3 - "$WORK/fail/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
steps = s["checks"][0]["curve"]["failing_steps"]
assert steps == [3, 6], f"failing steps {steps}, expected [3, 6]"
PY
cp "$WORK/pass/report.html" "$WORK/report-pass.html"
cp "$WORK/fail/report.html" "$WORK/report-fail.html"

# Two short runs overlaid.
small=(--set model.d_model=32 --set model.n_heads=2 --set model.head_dim=16 --set model.n_kv_heads=1
    --set model.mlp_dim=48 --set model.vocab_size=256 --set train.seq_len=32 --set train.batch_size=2)
"$ENGINE" --device cpu train --recipe tiny-llama2 --run-dir "$WORK/runs/lr-0.01" --steps 6 "${small[@]}" --set optim.lr=0.01 > /dev/null
"$ENGINE" --device cpu train --recipe tiny-llama2 --run-dir "$WORK/runs/lr-0.002" --steps 6 "${small[@]}" --set optim.lr=0.002 > /dev/null
"$ENGINE" plot "$WORK/runs/lr-0.01" "$WORK/runs/lr-0.002" --title "tiny-llama2 at two learning rates" --out "$WORK/plot.svg"

$CHECK "$SHOTS" "$WORK/report-pass.html" "$WORK/report-fail.html" "$WORK/plot.svg"

# The check bites: a page with a console error and a request off the machine fails it.
cat > "$WORK/bad.html" <<'HTML'
<!DOCTYPE html><html><body><img src="http://192.0.2.1/x.png" alt=""><script>console.error("from the page")</script></body></html>
HTML
if $CHECK "$SHOTS" "$WORK/bad.html" > "$WORK/bad.log"; then
    cat "$WORK/bad.log"; echo "FAIL: the browser check passed a page with a console error and a remote request"; exit 1
fi
for fault in 'console: "from the page"' 'requested http://192.0.2.1/x.png'; do
    grep -qF "$fault" "$WORK/bad.log" || { cat "$WORK/bad.log"; echo "FAIL: the browser check did not report: $fault"; exit 1; }
done
echo "pictures e2e: passed; screenshots in $SHOTS"
