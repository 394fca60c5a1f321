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

section "format"
cargo fmt --all -- --check

section "lints"
cargo clippy --release --workspace --all-targets --locked -- -D warnings

section "python tools for the tests"
# TensorBoard's own reader opens the engine's event files (engine/tests/metrics.rs); the test
# fails rather than skips when ENGINE_TEST_REQUIRE_PYTHON=1.
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
export ENGINE_TEST_PYTHON="$PWD/$venv/bin/python" ENGINE_TEST_REQUIRE_PYTHON=1

section "unit and integration tests"
cargo test --release --workspace --locked

for script in tests/e2e/*.sh; do
    [ -e "$script" ] || continue
    section "end to end: $script"
    bash "$script"
done

section "all tests passed"
