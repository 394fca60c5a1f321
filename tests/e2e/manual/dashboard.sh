#!/usr/bin/env bash
# The dashboard (`distro attach-test`, `distro report`) in under a minute, without Docker or an
# engine build: two tiny dated two-platform images (layouts written below, layers annotated as
# `distro build` annotates them: base, engine, cuda) are pushed with `distro push` to a local
# docker-registry, a test summary is attached to each platform of each, and the site is checked
# against the registry and loaded in headless Chromium (tests/e2e/lib/images-common.sh's
# e2e_dashboard, which tests/e2e/images.sh runs on the images it builds).
#
# For working on the dashboard: tests/e2e/images.sh covers the same on real images in the
# suite, so this lives in manual/. Needs root when docker-registry or chromium is missing.
#
#   tests/e2e/manual/dashboard.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
WORK=${DISTRO_E2E_WORK:-$ROOT/target/e2e-dashboard}
PORT=${DISTRO_E2E_DASHBOARD_PORT:-5721}
REPO=127.0.0.1:$PORT/distro
mkdir -p "$WORK"
# shellcheck source=tests/e2e/lib/images-common.sh
source "$ROOT/tests/e2e/lib/images-common.sh"
T0=$(date +%s)
trap e2e_cleanup EXIT

e2e_install docker-registry chromium curl
rm -rf "$WORK/registry-dashboard"
e2e_registry registry-dashboard "$PORT"
cargo build --release --locked -p distro --manifest-path "$ROOT/Cargo.toml" >&2
DISTRO=$ROOT/target/release/distro

# Two dates; the second's engine layer is larger, so the sizes and the diff differ.
for date in 2026-01-02 2026-01-03; do
    rm -rf "$WORK/oci-$date"
    python3 - "$WORK/oci-$date" "$date" <<'PY'
import gzip, hashlib, io, json, os, sys, tarfile
out, date = sys.argv[1], sys.argv[2]
os.makedirs(f"{out}/blobs/sha256")
def put(data):
    d = hashlib.sha256(data).hexdigest()
    open(f"{out}/blobs/sha256/{d}", "wb").write(data)
    return {"digest": "sha256:" + d, "size": len(data)}
def layer(files):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1767225600
            t.addfile(info, io.BytesIO(data))
    return raw.getvalue()
extra = 4096 if date.endswith("03") else 0
manifests = []
for arch in ("amd64", "arm64"):
    parts = [  # (group or None for the base, files)
        (None, {"etc/os-release": f"base {arch}\n".encode() * 50}),
        ("engine", {"usr/local/bin/engine": os.urandom(2000 + extra)}),
        ("cuda", {"usr/local/lib/cuda/libcublas.so": f"cuda {arch}\n".encode() * 300}),
        ("engine", {"opt/distro/date": f"{date}\n".encode()}),
    ]
    layers, diff_ids = [], []
    for group, files in parts:
        tar = layer(files)
        diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
        d = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **put(gzip.compress(tar, mtime=0))}
        if group:
            d["annotations"] = {"io.github.llm-distro.layer-group": group}
        layers.append(d)
    config = {"architecture": arch, "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids},
              "config": {"Env": [f"DATE={date}"]},
              "history": [{"created_by": "base"}] + [{"created_by": "distro build: part"}] * 3}
    if arch == "arm64":
        config["variant"] = "v8"
    c = {"mediaType": "application/vnd.oci.image.config.v1+json", **put(json.dumps(config).encode())}
    m = put(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "config": c, "layers": layers}).encode())
    platform = {"architecture": arch, "os": "linux", **({"variant": "v8"} if arch == "arm64" else {})}
    manifests.append({"mediaType": "application/vnd.oci.image.manifest.v1+json", **m, "platform": platform})
index = put(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": manifests,
                        "annotations": {"org.opencontainers.image.created": f"{date}T00:00:00Z"}}).encode())
ref = {"mediaType": "application/vnd.oci.image.index.v1+json", **index,
       "annotations": {"org.opencontainers.image.ref.name": f"engine-{date}"}}
json.dump({"schemaVersion": 2, "manifests": [ref]}, open(f"{out}/index.json", "w"))
json.dump({"imageLayoutVersion": "1.0.0"}, open(f"{out}/oci-layout", "w"))
PY
    "$DISTRO" push "$WORK/oci-$date" "$REPO" >/dev/null 2>"$WORK/push-$date.log" || die "distro push failed: $(tail -3 "$WORK/push-$date.log")"
done

# The summaries test-all writes (docs/test-all.md): amd64 with a throughput figure, arm64 without.
summary() { # summary FILE DEVICE_CLASS PASSED FAILED CHECKS_JSON
    printf '{"format":"engine-test-all-summary","engine_version":"0.1.0","revision":"e2e","image":null,"report":"report.html","mode":"quick","device_class":"%s","device":"e2e","baselines":null,"started":"2026-01-03T02:00:00Z","seconds":1.0,"passed":%s,"failed":%s,"skipped":0,"checks":%s}\n' \
        "$2" "$3" "$4" "$5" >"$1"
}
summary "$WORK/amd64.json" cpu 2 0 '[{"name":"tiny-llama2","status":"pass","seconds":1,"detail":""},{"name":"throughput","status":"pass","seconds":1,"detail":"","measures":[{"name":"tiny-llama2","value":1234.5,"unit":"tokens/s","baseline":1000,"ok":true}]}]'
summary "$WORK/arm64.json" cpu 0 1 '[{"name":"data-prepare","status":"fail","seconds":1,"detail":"e2e"}]'
expect_fail 2 "not a test-all summary.json" "$DISTRO" attach-test "$REPO:engine-2026-01-02" "$WORK/oci-2026-01-02/oci-layout" --platform linux/amd64
expect_fail 2 "platform \"linux/s390x\" is not supported" "$DISTRO" attach-test "$REPO:engine-2026-01-02" "$WORK/arm64.json" --platform linux/s390x

e2e_dashboard "$DISTRO" "$REPO" engine "$WORK/site" "linux/amd64=$WORK/amd64.json" "linux/arm64/v8=$WORK/arm64.json" \
    -- 2026-01-02 2026-01-03
grep -q 'tokens/s' "$WORK/site/index.html" || die "the throughput trend is not drawn"
log "PASS: dashboard e2e in $(($(date +%s) - T0))s; site and screenshots in $WORK/site"
