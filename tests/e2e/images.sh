#!/usr/bin/env bash
# End-to-end test of `distro build|push|load|run` against real parts: a Docker engine (Debian
# docker.io), two OCI registries (Debian docker-registry, one with htpasswd auth), skopeo and
# umoci as independent validators, qemu-user-static for arm64, and a small multi-arch Debian
# base (debootstrap) served from the local registry in place of the CUDA base. Then the
# dashboard: a second date pushed, test-all's summaries attached, `distro report`'s site checked
# against the registry and loaded in headless Chromium. Then signing: `distro sign`, `distro
# verify --key`, the signature read back with curl and verified by openssl.
#
# Idempotent: installs what is missing, starts dockerd only if none runs, starts its own
# registries on loopback, and stops what it started. Caches debootstrap output under $WORK.
#
#   tests/e2e/images.sh            # needs root (apt, dockerd, binfmt_misc)
#
# Environment: DISTRO_E2E_WORK (work dir, default target/e2e-images), DISTRO_E2E_PORT (first of
# two registry ports, which must be free; default the first free pair from 5701), DEBIAN_MIRROR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${DISTRO_E2E_WORK:-$ROOT/target/e2e-images}
DATE=2026-01-02
DATE2=2026-01-03 # the dashboard's second date
mkdir -p "$WORK"
# shellcheck source=tests/e2e/lib/images-common.sh
source "$ROOT/tests/e2e/lib/images-common.sh"
# The two registries' ports: DISTRO_E2E_PORT and the next, which must be free; unset, the first
# free pair from 5701 (another registry, or a run still going, may hold 5701).
port_holder() { # the listener on TCP port $1 (any address), empty when none
    command -v ss >/dev/null || return 0
    ss -Hltnp "sport = :$1" 2>/dev/null | head -1 | awk '{print $4, $6}'
}
if [ -n "${DISTRO_E2E_PORT:-}" ]; then
    PORT=$DISTRO_E2E_PORT
    for p in "$PORT" $((PORT + 1)); do
        holder=$(port_holder "$p")
        [ -z "$holder" ] || die "DISTRO_E2E_PORT=$PORT: port $p is taken ($holder); free it or set DISTRO_E2E_PORT to another pair"
    done
else
    PORT=5701
    while [ -n "$(port_holder "$PORT")$(port_holder $((PORT + 1)))" ]; do
        PORT=$((PORT + 2))
        [ "$PORT" -lt 5800 ] || die "no two free consecutive ports in 5701-5800 for the registries (ss -ltnp shows who holds them); set DISTRO_E2E_PORT"
    done
fi
PLAIN=127.0.0.1:$PORT
AUTH=127.0.0.1:$((PORT + 1))
[ "$(id -u)" = 0 ] || die "tests/e2e/images.sh needs root: it installs Debian packages, starts dockerd and registers qemu with binfmt_misc"

T0=$(date +%s)
phase() { log "[$(($(date +%s) - T0))s] $*"; }
cleanup() {
    local rc=$?
    docker rmi -f "$PLAIN/distro:engine-$DATE" distro:engine "distro:engine-$DATE" distro:engine-$DATE-arm64 >/dev/null 2>&1 || true
    e2e_cleanup
    [ $rc = 0 ] && log "PASS: images e2e in $(($(date +%s) - T0))s" || log "FAILED (rc=$rc); logs under $WORK; disk: $(df -h "$WORK" | tail -1)"
}
trap cleanup EXIT


phase "setup: packages, binfmt, dockerd, registries"
e2e_install
e2e_binfmt
e2e_dockerd
rm -rf "$WORK/registry-plain" "$WORK/registry-auth"
htpasswd -Bbc "$WORK/htpasswd" e2euser e2epass 2>/dev/null
e2e_registry registry-plain "$PORT"
e2e_registry registry-auth "$((PORT + 1))" "$WORK/htpasswd"

phase "base image: debootstrap amd64+arm64, umoci, skopeo -> $PLAIN/debian:bookworm"
BASE_DIGEST=$(e2e_base "$PLAIN" debian)
BASE="$PLAIN/debian:bookworm@$BASE_DIGEST"

phase "building distro"
cargo build --release --locked -p distro --manifest-path "$ROOT/Cargo.toml" >&2
DISTRO=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps | jq -r .target_directory)/release/distro

phase "bad input: one line, exit code 2"
(cd "$ROOT" && expect_fail 2 "YYYY-MM-DD" "$DISTRO" build --date 2026-13-01 --base "$BASE")
(cd "$ROOT" && expect_fail 2 "linux/s390x" "$DISTRO" build --platform linux/s390x --base "$BASE")
(cd "$ROOT" && expect_fail 2 "not an OCI image layout" "$DISTRO" push "$WORK/nope" "$PLAIN/x")

phase "build A in the checkout ($ROOT)"
A_OUT="$WORK/oci-a"
(cd "$ROOT" && "$DISTRO" build --base "$BASE" --date "$DATE" --output "$A_OUT" >"$WORK/a.digest" 2>"$WORK/a.log") \
    || die "build A failed: $(tail -5 "$WORK/a.log")"
A=$(tail -1 "$WORK/a.digest")
[[ $A == sha256:* ]] || die "the last line of stdout is not a digest: $A"

phase "build B: another directory, another process and cache, random SOURCE_DATE_EPOCH (arm64)"
# B builds the cross-compiled platform only, to hold the suite's time (a second engine build for
# both platforms cost about 400 s): arm64 goes through every mechanism amd64 does (the rustc
# wrapper's remaps on every crate, host artifacts under --target, the C flags' prefix maps) plus
# the cross linker and C compiler. Its platform manifest, which names every layer and the config,
# must equal A's byte for byte.
B_SRC="$WORK/src-b"
rm -rf "$B_SRC"
git clone -q "$ROOT" "$B_SRC"
git -C "$B_SRC" checkout -q "$(git -C "$ROOT" rev-parse HEAD)"
# The checkout's uncommitted changes to tracked files, so both build the same content.
git -C "$ROOT" diff HEAD --binary | git -C "$B_SRC" apply --allow-empty
(cd "$B_SRC" && SOURCE_DATE_EPOCH=$((RANDOM * RANDOM)) "$DISTRO" build --base "$BASE" --date "$DATE" \
    --platform linux/arm64/v8 --output "$WORK/oci-b" >"$WORK/b.digest" 2>"$WORK/b.log") || die "build B failed: $(tail -5 "$WORK/b.log")"
ma=$(skopeo inspect --raw "oci:$A_OUT:engine-$DATE-arm64" | sha256sum | cut -d' ' -f1)
mb=$(skopeo inspect --raw "oci:$WORK/oci-b:engine-$DATE-arm64" | sha256sum | cut -d' ' -f1)
if [ "$ma" != "$mb" ]; then
    la=$(skopeo inspect --raw "oci:$A_OUT:engine-$DATE-arm64" | jq -c '[.config.digest, .layers[].digest]')
    lb=$(skopeo inspect --raw "oci:$WORK/oci-b:engine-$DATE-arm64" | jq -c '[.config.digest, .layers[].digest]')
    die "not reproducible: arm64 manifest sha256:$ma (in $ROOT) != sha256:$mb (in $B_SRC); config and layers: $la vs $lb"
fi
log "same arm64 manifest from both directories: sha256:$ma"
# The second checkout and its build cache (about 1 GB) have served; CI's disk is not large.
rm -rf "$B_SRC"

phase "no-op rebuild"
S=$(date +%s%N)
(cd "$ROOT" && "$DISTRO" build --base "$BASE" --date "$DATE" --output "$A_OUT" >"$WORK/a2.digest" 2>"$WORK/a2.log")
log "no-op build: $(((($(date +%s%N) - S)) / 1000000)) ms"
[ "$(tail -1 "$WORK/a2.digest")" = "$A" ] || die "a no-op rebuild changed the digest"

phase "--patch: the lock and the annotations change"
rm -rf "$WORK/patch"
(cd "$ROOT" && "$DISTRO" fetch --out "$WORK/patch/fetch" >/dev/null 2>"$WORK/fetch.log") || die "distro fetch failed: $(cat "$WORK/fetch.log")"
SRC=$(ls "$WORK/patch/fetch" | head -1)
[ -n "$SRC" ] || die "images/manifest.toml has no source to patch"
(
    cd "$WORK/patch/fetch/$SRC"
    g() { git -c user.name=e2e -c user.email=e2e@example.invalid -c commit.gpgsign=false "$@"; }
    g init -q && g add -A && g commit -qm base
    echo "e2e test patch" >E2E-PATCH && g add E2E-PATCH && g commit -qm "e2e: a test patch"
    g format-patch -q -1 -o "$WORK/patch"
)
PATCH=$(ls "$WORK/patch"/*.patch)
(cd "$ROOT" && "$DISTRO" build --base "$BASE" --date "$DATE" --platform linux/amd64 --patch "$SRC=$PATCH" \
    --output "$WORK/oci-patch" >"$WORK/patch.digest" 2>"$WORK/patch.log") || die "build --patch failed: $(tail -5 "$WORK/patch.log")"
ann() { skopeo inspect --raw "oci:$1:engine-$DATE" | jq -r --arg k "io.github.llm-distro.source.$SRC.$2" '.annotations[$k]'; }
[ "$(ann "$A_OUT" patches)" != "$(ann "$WORK/oci-patch" patches)" ] || die "the patch count annotation did not change"
[ "$(ann "$A_OUT" tree)" != "$(ann "$WORK/oci-patch" tree)" ] || die "the tree annotation did not change"
rm -rf "$WORK/bundle-patch"
umoci unpack --image "$WORK/oci-patch:engine-$DATE-amd64" "$WORK/bundle-patch" >&2
grep -q 'extra = true' "$WORK/bundle-patch/rootfs/opt/distro/manifest.lock" || die "the image's lock does not record the extra patch"
cmp "$PATCH" "$WORK/bundle-patch/rootfs/opt/distro/patches/$SRC/$(basename "$PATCH")" || die "the applied patch is not in /opt/distro/patches"

phase "validators: skopeo inspect, umoci unpack"
skopeo inspect --raw "oci:$A_OUT:engine-$DATE" | jq -e '.mediaType == "application/vnd.oci.image.index.v1+json" and (.manifests | length) == 2' >/dev/null \
    || die "skopeo: the index is not a two-platform OCI index"
skopeo inspect --raw "oci:$A_OUT:engine-$DATE" | jq -e '.manifests[] | select(.platform.architecture == "arm64") | .platform.variant == "v8"' >/dev/null \
    || die "arm64 has no v8 variant in the index"
skopeo inspect "oci:$A_OUT:engine-$DATE" | jq -e --arg d "$A" '.Digest == $d and .Labels["org.opencontainers.image.base.name"] != null' >/dev/null \
    || die "skopeo inspect of the layout disagrees"
skopeo inspect --config "oci:$A_OUT:engine-$DATE-arm64" | jq -e '.variant == "v8" and .architecture == "arm64"' >/dev/null \
    || die "arm64 config has no v8 variant"
INDEX_JSON=$(skopeo inspect --raw "oci:$A_OUT:engine-$DATE")
case "$INDEX_JSON" in *application/vnd.docker*) die "Docker media types in the index" ;; esac
for m in $(printf '%s' "$INDEX_JSON" | jq -r '.manifests[].digest'); do
    case "$(cat "$A_OUT/blobs/sha256/${m#sha256:}")" in *application/vnd.docker*) die "Docker media types in manifest $m" ;; esac
done
for arch in amd64 arm64; do
    rm -rf "$WORK/bundle-$arch"
    umoci unpack --image "$A_OUT:engine-$DATE-$arch" "$WORK/bundle-$arch" >&2 || die "umoci unpack $arch failed"
    R="$WORK/bundle-$arch/rootfs"
    for f in usr/local/bin/engine usr/local/bin/test-all opt/engine/recipes/tiny-llama2.toml opt/distro/sbom.spdx.json opt/distro/Cargo.lock; do
        [ -e "$R/$f" ] || die "$arch image lacks /$f"
    done
    [ -x "$R/usr/local/bin/test-all" ] || die "test-all is not executable"
    jq -e '.spdxVersion == "SPDX-2.3" and ([.packages[].name] | index("cudarc")) != null' "$R/opt/distro/sbom.spdx.json" >/dev/null \
        || die "$arch SBOM is not SPDX 2.3 with the engine's crates"
    jq -e '.process.env | index("CUDA_MODULE_LOADING=EAGER") != null' "$WORK/bundle-$arch/config.json" >/dev/null \
        || die "$arch image lacks the baked-in flags"
done
file "$WORK/bundle-arm64/rootfs/usr/local/bin/engine" | grep -q aarch64 || die "the arm64 engine is not an aarch64 binary"
rm -rf "$WORK/bundle-amd64" "$WORK/bundle-arm64" "$WORK/bundle-patch"

phase "push: without credentials (must fail clearly), with, again (no blob bytes), chunked, with mounts"
expect_fail 1 "no credentials found for $AUTH" env -u DISTRO_REGISTRY_USER -u DISTRO_REGISTRY_PASSWORD DOCKER_CONFIG="$WORK/no-docker-config" \
    "$DISTRO" push "$A_OUT" "$AUTH/distro"
expect_fail 1 "rejected the credentials" env DISTRO_REGISTRY_USER=e2euser DISTRO_REGISTRY_PASSWORD=wrong DOCKER_CONFIG="$WORK/no-docker-config" \
    "$DISTRO" push "$A_OUT" "$AUTH/distro"
if grep -q wrong "$WORK/err.txt"; then die "a password was printed"; fi
S=$(date +%s%N)
DISTRO_REGISTRY_USER=e2euser DISTRO_REGISTRY_PASSWORD=e2epass DOCKER_CONFIG="$WORK/no-docker-config" \
    "$DISTRO" push "$A_OUT" "$AUTH/distro" >"$WORK/push1.out" 2>"$WORK/push1.log"
log "push: $(((($(date +%s%N) - S)) / 1000000)) ms, $(grep -o 'blob bytes sent: [0-9]*' "$WORK/push1.log")"
# Credentials from a docker config file this time (the `docker login` path).
mkdir -p "$WORK/docker-config"
printf '{"auths":{"%s":{"auth":"%s"}}}' "$AUTH" "$(printf e2euser:e2epass | base64)" >"$WORK/docker-config/config.json"
DOCKER_CONFIG="$WORK/docker-config" "$DISTRO" push "$A_OUT" "$AUTH/distro" >"$WORK/push2.out" 2>"$WORK/push2.log"
grep -q 'blob bytes sent: 0;' "$WORK/push2.log" || die "re-push sent blob bytes: $(grep 'blob bytes' "$WORK/push2.log")"
skopeo inspect --creds e2euser:e2epass --tls-verify=false "docker://$AUTH/distro:engine-$DATE" | jq -e --arg d "$A" '.Digest == $d' >/dev/null \
    || die "the authenticated registry does not serve the pushed index"
"$DISTRO" push "$A_OUT" "$PLAIN/chunked:engine-$DATE" --chunk-size 3000000 >/dev/null 2>"$WORK/push3.log"
skopeo inspect --tls-verify=false "docker://$PLAIN/chunked:engine-$DATE" | jq -e --arg d "$A" '.Digest == $d' >/dev/null \
    || die "chunked upload did not produce the same index"
(cd "$ROOT" && "$DISTRO" build --base "$BASE" --date "$DATE" --push "$PLAIN/distro" >"$WORK/push4.out" 2>"$WORK/push4.log")
[ "$(tail -1 "$WORK/push4.out")" = "$A" ] || die "build --push printed another digest"
grep -q ' 2 mounted' "$WORK/push4.log" || die "base layers were not mounted from the base repository: $(grep blobs: "$WORK/push4.log")"

phase "docker pull + run, amd64 and arm64 (qemu)"
docker pull -q "$PLAIN/distro:engine-$DATE" >&2
docker run --rm "$PLAIN/distro:engine-$DATE" >"$WORK/info.txt" 2>&1 || die "engine info (default command) failed"
grep -q "$(git -C "$ROOT" rev-parse HEAD)" "$WORK/info.txt" || die "engine info does not show the revision: $(head -3 "$WORK/info.txt")"
grep -q "CUDA_MODULE_LOADING=EAGER" "$WORK/info.txt" || die "engine info does not show the baked flags"
# Set by the engine on Hopper only, so not baked: engine info says why it is not set here.
grep -q "CUDA_DEVICE_MAX_CONNECTIONS  *not set: no CUDA device" "$WORK/info.txt" || die "engine info does not give its decision on CUDA_DEVICE_MAX_CONNECTIONS"
docker run --rm "$PLAIN/distro:engine-$DATE" engine train --recipe tiny-llama2 --steps 5 >"$WORK/train-amd64.txt" 2>&1 \
    || die "amd64 training failed: $(tail -3 "$WORK/train-amd64.txt")"
grep -q '^done: loss' "$WORK/train-amd64.txt" || die "amd64 training did not finish"
# The in-image test suite against the baselines the image ships, reports on a bind mount.
check_test_all() { # check_test_all ARCH MIN_PASSED: the report of a test-all run in $WORK/test-all-ARCH
    local dir="$WORK/test-all-$1"
    jq -e --argjson n "$2" '.failed == 0 and .passed >= $n and (.checks | length) == .passed + .skipped' "$dir/summary.json" >/dev/null \
        || die "$1 test-all summary: $(cat "$dir/summary.json")"
    python3 -c 'import sys, xml.etree.ElementTree as ET; r = ET.parse(sys.argv[1]).getroot(); assert r.tag == "testsuites" and r.find("testsuite").get("failures") == "0", r.attrib' \
        "$dir/junit.xml" || die "$1 test-all junit.xml is not well-formed JUnit with no failures"
}
rm -rf "$WORK/test-all-amd64" && mkdir -p "$WORK/test-all-amd64"
docker run --rm -v "$WORK/test-all-amd64:/report" "$PLAIN/distro:engine-$DATE" test-all --quick --report /report \
    >"$WORK/test-all-amd64.txt" 2>&1 || die "amd64 test-all --quick failed: $(grep -E '^(FAILED|error)' "$WORK/test-all-amd64.txt")"
check_test_all amd64 7
# From the report, not the console: docker relays stdout and stderr apart, so their lines
# interleave in any order there.
jq -e '.checks[] | select(.name == "tiny-llama2") | .status == "pass" and (.detail | startswith("cpu baseline:"))' \
    "$WORK/test-all-amd64/summary.json" >/dev/null \
    || die "amd64 test-all did not compare tiny-llama2 with the image's baselines: $(jq -c '.checks[0]' "$WORK/test-all-amd64/summary.json")"
# Under emulation the full tiny-llama2 takes ~10 minutes on 2 cores, so arm64 trains the same
# recipe shrunk through ENGINE_FLAGS (which also shows user flags adding to the image's).
SMALL="model.d_model=128 model.n_heads=2 model.n_kv_heads=2 model.head_dim=64 model.mlp_dim=256 model.vocab_size=512"
docker rmi -f "$PLAIN/distro:engine-$DATE" >/dev/null
docker pull -q --platform linux/arm64 "$PLAIN/distro:engine-$DATE" >&2
[ "$(docker image inspect "$PLAIN/distro:engine-$DATE" --format '{{.Architecture}}')" = arm64 ] || die "docker pulled the wrong platform"
docker run --rm --platform linux/arm64 -e ENGINE_FLAGS="$SMALL" "$PLAIN/distro:engine-$DATE" \
    engine train --recipe tiny-llama2 --steps 5 >"$WORK/train-arm64.txt" 2>&1 || die "arm64 training failed: $(tail -3 "$WORK/train-arm64.txt")"
grep -q '^done: loss' "$WORK/train-arm64.txt" || die "arm64 training did not finish"
[ "$(docker run --rm --platform linux/arm64 "$PLAIN/distro:engine-$DATE" uname -m)" = aarch64 ] || die "not an arm64 container"
# Under emulation the loss curves (100M-parameter models) would take many minutes: arm64 runs
# the checks of small models, which need no baselines (about 20 s under qemu on 2 cores).
rm -rf "$WORK/test-all-arm64" && mkdir -p "$WORK/test-all-arm64"
docker run --rm --platform linux/arm64 -v "$WORK/test-all-arm64:/report" "$PLAIN/distro:engine-$DATE" \
    test-all --quick --filter data-prepare --filter hf-roundtrip --filter checkpoint-resume --report /report \
    >"$WORK/test-all-arm64.txt" 2>&1 || die "arm64 test-all failed: $(grep -E '^(FAILED|error)' "$WORK/test-all-arm64.txt")"
check_test_all arm64 3
log "amd64: $(grep '^done' "$WORK/train-amd64.txt")"
log "arm64: $(grep '^done' "$WORK/train-arm64.txt")"
log "test-all amd64: $(grep -E '^[0-9]+ passed' "$WORK/test-all-amd64.txt"); arm64: $(grep -E '^[0-9]+ passed' "$WORK/test-all-arm64.txt")"

phase "dashboard: a second date, the test summaries attached, distro report, checked in Chromium"
# The second date reuses every layer but /opt/distro (the same commit, so the same binaries).
(cd "$ROOT" && "$DISTRO" build --base "$BASE" --date "$DATE2" --push "$PLAIN/distro" >"$WORK/push-date2.out" 2>"$WORK/push-date2.log") \
    || die "build --date $DATE2 --push failed: $(tail -5 "$WORK/push-date2.log")"
e2e_dashboard "$DISTRO" "$PLAIN/distro" engine "$WORK/site" "linux/amd64=$WORK/test-all-amd64/summary.json" \
    "linux/arm64/v8=$WORK/test-all-arm64/summary.json" -- "$DATE" "$DATE2"

phase "signing: distro sign, distro verify --key, cosign's layout read back and checked with openssl"
e2e_signing "$DISTRO" "$PLAIN" distro "engine-$DATE" "engine-$DATE2"

phase "distro load (bollard) + distro run; load tar for docker load"
docker rmi -f "$PLAIN/distro:engine-$DATE" >/dev/null  # the pulled image has served; keep Docker's disk small
"$DISTRO" load "$A_OUT" --ref engine >"$WORK/load.out" 2>"$WORK/load.log" || die "distro load failed: $(cat "$WORK/load.log")"
grep -qx "distro:engine" "$WORK/load.out" || die "distro load did not report distro:engine"
"$DISTRO" run distro:engine -e ENGINE_FLAGS=train.steps=2 -- engine train --recipe tiny-llama2 >"$WORK/run.txt" 2>&1 \
    || die "distro run failed: $(tail -3 "$WORK/run.txt")"
grep -q '^step 2/2' "$WORK/run.txt" || die "distro run did not stream the engine's output (or ENGINE_FLAGS was not applied)"
rc=0; "$DISTRO" run distro:engine -- sh -c 'exit 3' >/dev/null 2>&1 || rc=$?
[ "$rc" = 3 ] || die "distro run returned $rc, not the container's exit code 3"
"$DISTRO" load "$A_OUT" --ref "engine-$DATE" --platform linux/arm64 --output "$WORK/engine-arm64.tar" >/dev/null 2>&1
docker rmi -f distro:engine >/dev/null
docker load -i "$WORK/engine-arm64.tar" >&2
rm -f "$WORK/engine-arm64.tar"
[ "$(docker image inspect "distro:engine-$DATE" --format '{{.Architecture}}')" = arm64 ] || die "docker load of the arm64 tar gave another platform"

phase "tampered base blob on pull is rejected"
LAYER=$(skopeo inspect --raw --tls-verify=false "docker://$PLAIN/debian:bookworm-amd64" | jq -r '.layers[0].digest')
DATA="$WORK/registry-plain/storage/docker/registry/v2/blobs/sha256/${LAYER:7:2}/${LAYER:7}/data"
[ -f "$DATA" ] || die "cannot find the base layer in the registry's storage"
cp "$DATA" "$WORK/layer.orig"
printf 'tampered' | dd of="$DATA" bs=1 seek=1000 conv=notrunc 2>/dev/null
(cd "$ROOT" && expect_fail 1 "does not match its digest" env DISTRO_TARGET_DIR="$WORK/tamper-cache" \
    "$DISTRO" build --base "$BASE" --date "$DATE" --platform linux/amd64 --output "$WORK/oci-tamper")
[ ! -e "$WORK/oci-tamper/index.json" ] || die "a layout was written from a tampered base"
cp "$WORK/layer.orig" "$DATA"
rm -rf "$WORK/tamper-cache"
