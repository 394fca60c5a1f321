# The engine image, for people who build with docker buildx:
#
#   docker buildx build --platform linux/amd64,linux/arm64 \
#     --build-arg REVISION=$(git rev-parse HEAD) --build-arg DATE=$(date -u +%F) -t REPO:engine .
#
# It produces the layout, environment and entry of the native build (`distro build`, see
# docs/images.md): /usr/local/bin/{engine,test-all}, /opt/engine/{recipes,baselines},
# /opt/distro/{Cargo.lock,manifest.lock,patches,sbom.spdx.json}, the flags of docs/flags.md,
# `engine info` as the default command, the base's entrypoint. Differences, by nature: its
# layers are not bit-for-bit reproducible (BuildKit timestamps), it builds the committed
# Cargo.lock without the patched crates of images/manifest.lock (use `distro build` for that),
# and the SBOM names the base by the digest of BASE (the multi-arch index).
#
# Cross-compilation, not emulation: the Rust stages run on the build machine's platform
# (BUILDPLATFORM) and compile for TARGETARCH with Debian's cross gcc; the runtime stage only
# copies files, so no RUN executes under qemu.

ARG RUST_IMAGE=docker.io/library/rust:1.95.0-bookworm
ARG BASE=docker.io/nvidia/cuda:13.0.3-cudnn-runtime-ubuntu24.04@sha256:14f6d08d1cd4a96effbfe3101d0b56326f552c199d05e4979ee0bd616df5811b

# Toolchain for every target: cargo-chef, the Rust targets, Debian's cross linkers.
FROM --platform=$BUILDPLATFORM ${RUST_IMAGE} AS chef
ARG BUILDARCH
ARG CARGO_CHEF_VERSION=0.1.78
# The other architecture's cross gcc (the native one is the image's own gcc).
RUN case "$BUILDARCH" in amd64) cross="gcc-aarch64-linux-gnu libc6-dev-arm64-cross" ;; \
      arm64) cross="gcc-x86-64-linux-gnu libc6-dev-amd64-cross" ;; *) echo "unsupported BUILDARCH $BUILDARCH" >&2; exit 2 ;; esac \
 && apt-get update && apt-get install -y --no-install-recommends $cross && rm -rf /var/lib/apt/lists/*
WORKDIR /build
COPY rust-toolchain.toml ./
RUN rustup target add x86_64-unknown-linux-gnu aarch64-unknown-linux-gnu \
 && cargo install --locked cargo-chef --version ${CARGO_CHEF_VERSION}
ENV CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER=x86_64-linux-gnu-gcc

# The dependency recipe: changes only when manifests or the lock do.
FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

# Dependencies of the engine for the target, cached across source changes.
FROM chef AS cook
ARG TARGETARCH
COPY --from=planner /build/recipe.json recipe.json
# engine's build script embeds recipes/: it needs them even for a dependency-only build.
COPY recipes recipes
RUN case "$TARGETARCH" in amd64) t=x86_64-unknown-linux-gnu ;; arm64) t=aarch64-unknown-linux-gnu ;; \
      *) echo "unsupported TARGETARCH $TARGETARCH" >&2; exit 2 ;; esac \
 && cargo chef cook --release --locked --target "$t" -p engine --recipe-path recipe.json

# The engine, and the image's files under /out (the same tree `distro build` assembles).
FROM cook AS build
ARG TARGETARCH
ARG REVISION=unknown
COPY . .
RUN case "$TARGETARCH" in amd64) t=x86_64-unknown-linux-gnu ;; arm64) t=aarch64-unknown-linux-gnu ;; esac \
 && ENGINE_REVISION="$REVISION" cargo build --release --locked -p engine --bin engine --target "$t" \
 && install -D -m 755 "target/$t/release/engine" /out/usr/local/bin/engine \
 && printf '#!/bin/sh\n# The in-image test suite: `test-all` on PATH, implemented by the engine.\nexec engine test-all "$@"\n' >/out/usr/local/bin/test-all \
 && chmod 755 /out/usr/local/bin/test-all \
 && mkdir -p /out/opt/engine/recipes /out/opt/engine/baselines /out/opt/distro/patches \
 && cp -R recipes/. /out/opt/engine/recipes/ \
 && if [ -d tests/baselines ]; then cp -R tests/baselines/. /out/opt/engine/baselines/; fi \
 && cp Cargo.lock /out/opt/distro/Cargo.lock \
 && if [ -f images/manifest.lock ]; then cp images/manifest.lock /out/opt/distro/; fi \
 && if [ -d patches ]; then cp -R patches/. /out/opt/distro/patches/; fi \
 && chmod -R u=rwX,go=rX /out/opt

# The SBOM, written by distro itself (built for the build machine, dependencies cached too).
FROM chef AS sbom-cook
COPY --from=planner /build/recipe.json recipe.json
COPY recipes recipes
RUN cargo chef cook --release --locked -p distro --recipe-path recipe.json

FROM sbom-cook AS sbom
ARG TARGETPLATFORM
ARG BASE
ARG REVISION=unknown
ARG DATE
# The SBOM's creation time (default 0: pass the commit time for a meaningful one).
ARG SOURCE_DATE_EPOCH=0
COPY . .
RUN cargo build --release --locked -p distro \
 && target/release/distro sbom --platform "$TARGETPLATFORM" --base "$BASE" --revision "$REVISION" \
      ${DATE:+--date "$DATE"} --output /sbom.spdx.json

FROM ${BASE} AS runtime
ARG REVISION=unknown
ARG DATE
ARG BASE
COPY --from=build /out/ /
COPY --from=sbom /sbom.spdx.json /opt/distro/sbom.spdx.json
# The flags of docs/flags.md (a test keeps this list equal to images/engine.toml).
ENV CUDA_MODULE_LOADING=EAGER \
    ENGINE_DEFAULT_FLAGS="" \
    NCCL_DEBUG=WARN \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_VISIBLE_DEVICES=all
LABEL org.opencontainers.image.title="engine" \
      org.opencontainers.image.description="Training engine for Llama, Mistral and Mixtral style models, with tuned runtime flags" \
      org.opencontainers.image.source="https://github.com/llm-distro/llm-distro" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.documentation="docs/images.md" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.version="engine-${DATE}" \
      org.opencontainers.image.base.name="${BASE}"
WORKDIR /opt/engine
CMD ["engine", "info"]
