#!/usr/bin/env bash
# Builds the root Dockerfile with BuildKit, offline, for one platform (default linux/arm64, the
# cross-compiled one), and checks the result against the native build's layout, env and entry.
#
# Opt-in and slow (~15-20 minutes cold on 2 cores): it lives in manual/ so that tests/run.sh,
# which runs tests/e2e/*.sh, does not pick it up. Needs
# root. Without network access to Docker Hub, `rust:1.95.0-bookworm` is replaced by a local
# stand-in built from the debootstrap base plus this machine's pinned toolchain (and gcc from
# Debian); the CUDA base by the local Debian base. buildx is not needed: Docker's embedded
# BuildKit builds one platform per run (multi-platform in one run needs buildx).
#
#   tests/e2e/manual/dockerfile.sh [PLATFORM]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
WORK=${DISTRO_E2E_WORK:-$ROOT/target/e2e-images}
PORT=${DISTRO_E2E_DOCKERFILE_PORT:-5711}
PLATFORM=${1:-linux/arm64}
ARCH=${PLATFORM#linux/}
REGISTRY=127.0.0.1:$PORT
DATE=2026-01-02
mkdir -p "$WORK"
# shellcheck source=tests/e2e/lib/images-common.sh
source "$ROOT/tests/e2e/lib/images-common.sh"
T0=$(date +%s)
phase() { log "[$(($(date +%s) - T0))s] $*"; }
trap e2e_cleanup EXIT

phase "setup"
e2e_install
e2e_binfmt
e2e_dockerd
rm -rf "$WORK/registry-df"
e2e_registry registry-df "$PORT"
BASE="$REGISTRY/debian:bookworm@$(e2e_base "$REGISTRY" debian)"

TOOLCHAIN=$(rustup which rustc --toolchain "$(sed -n 's/^channel *= *"\(.*\)"/\1/p' "$ROOT/rust-toolchain.toml")" | xargs dirname | xargs dirname)
CHANNEL=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' "$ROOT/rust-toolchain.toml")
BUILDER=local/rust:$CHANNEL-bookworm
if ! docker image inspect "$BUILDER" >/dev/null 2>&1; then
    phase "stand-in for rust:$CHANNEL-bookworm from $TOOLCHAIN"
    CTX="$WORK/builder-ctx"
    rm -rf "$CTX" && mkdir -p "$CTX/toolchain" "$CTX/ca"
    docker import "$(e2e_rootfs amd64)" local/debian-rootfs:bookworm >/dev/null
    cp -a "$TOOLCHAIN/bin" "$TOOLCHAIN/lib" "$TOOLCHAIN/libexec" "$TOOLCHAIN/etc" "$CTX/toolchain/"
    cp "$(command -v rustup)" "$CTX/rustup"
    # A TLS-intercepting proxy's CA, when this machine has one (crates.io through it).
    cp /usr/local/share/ca-certificates/*.crt "$CTX/ca/" 2>/dev/null || true
    cat >"$CTX/Dockerfile" <<DOCKERFILE
FROM local/debian-rootfs:bookworm
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates && rm -rf /var/lib/apt/lists/*
COPY ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
COPY toolchain /usr/local/rustup/toolchains/$CHANNEL-x86_64-unknown-linux-gnu
COPY rustup /usr/local/cargo/bin/rustup
RUN for p in cargo rustc rustdoc cargo-clippy cargo-fmt rustfmt clippy-driver; do ln -s rustup /usr/local/cargo/bin/\$p; done \
 && rustup default $CHANNEL-x86_64-unknown-linux-gnu && cargo --version
DOCKERFILE
    DOCKER_BUILDKIT=1 /usr/bin/docker build -q -t "$BUILDER" "$CTX" >&2
    rm -rf "$CTX"
fi

phase "docker build (BuildKit) --platform $PLATFORM"
S=$(date +%s)
DOCKER_BUILDKIT=1 /usr/bin/docker build --platform "$PLATFORM" -f "$ROOT/Dockerfile" \
    --build-arg RUST_IMAGE="$BUILDER" --build-arg BASE="$BASE" \
    --build-arg REVISION="$(git -C "$ROOT" rev-parse HEAD)" --build-arg DATE="$DATE" \
    --build-arg SOURCE_DATE_EPOCH="$(git -C "$ROOT" log -1 --format=%ct)" \
    -t "distro-dockerfile:engine-$ARCH" "$ROOT" >"$WORK/dockerfile-build.log" 2>&1 \
    || die "docker build failed: $(tail -20 "$WORK/dockerfile-build.log")"
log "docker build: $(($(date +%s) - S)) s"

phase "checks: platform, files, env, entry, a training run"
IMG="distro-dockerfile:engine-$ARCH"
[ "$(docker image inspect "$IMG" --format '{{.Architecture}}')" = "$ARCH" ] || die "wrong architecture"
docker run --rm --platform "$PLATFORM" "$IMG" sh -c \
    'test -x /usr/local/bin/engine && test -x /usr/local/bin/test-all && test -f /opt/engine/recipes/tiny-llama2.toml && test -f /opt/distro/sbom.spdx.json && test -f /opt/distro/Cargo.lock' \
    || die "the image lacks files of the native layout"
[ "$(docker image inspect "$IMG" --format '{{json .Config.Cmd}} {{.Config.WorkingDir}}')" = '["engine","info"] /opt/engine' ] \
    || die "command or working dir differ"
ENV_JSON=$(docker image inspect "$IMG" --format '{{json .Config.Env}}')
while read -r kv; do
    printf '%s' "$ENV_JSON" | jq -e --arg kv "$kv" 'index($kv) != null' >/dev/null || die "the image lacks $kv"
done < <(awk '/^\[env\./ { n = $0; sub(/^\[env\./, "", n); sub(/\]$/, "", n) }
              /^value = / { v = $0; sub(/^value = "/, "", v); sub(/"$/, "", v); print n "=" v }' "$ROOT/images/engine.toml")
SMALL="model.d_model=128 model.n_heads=2 model.n_kv_heads=2 model.head_dim=64 model.mlp_dim=256 model.vocab_size=512"
docker run --rm --platform "$PLATFORM" -e ENGINE_FLAGS="$SMALL" "$IMG" engine train --recipe tiny-llama2 --steps 2 \
    >"$WORK/dockerfile-train.txt" 2>&1 || die "training in the Dockerfile image failed: $(tail -3 "$WORK/dockerfile-train.txt")"
grep -q '^done: loss' "$WORK/dockerfile-train.txt" || die "training did not finish"
docker run --rm --platform "$PLATFORM" "$IMG" engine info >"$WORK/dockerfile-info.txt" 2>&1 || die "engine info failed"
grep -q "$(git -C "$ROOT" rev-parse HEAD)" "$WORK/dockerfile-info.txt" || die "engine info lacks the revision"
log "PASS: Dockerfile build for $PLATFORM in $(($(date +%s) - T0))s"
