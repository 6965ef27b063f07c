#!/usr/bin/env bash
# Installs what the tests need on a fresh machine, then runs every test.
# This is the README's test command; .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*" >&2; }

step "installing test dependencies"
if ! python3 -c "import gguf, numpy" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check gguf numpy
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true
if ! rustup target list --installed | grep -qx thumbv7em-none-eabihf; then
    rustup target add thumbv7em-none-eabihf
fi

# NEON kernels run under QEMU user-mode emulation.
if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
    sudo_cmd=""
    if [ "$(id -u)" -ne 0 ]; then sudo_cmd="sudo"; fi
    $sudo_cmd apt-get update -qq
    $sudo_cmd apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null
fi
if ! rustup target list --installed | grep -qx aarch64-unknown-linux-gnu; then
    rustup target add aarch64-unknown-linux-gnu
fi

step "format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings

step "unit, property and integration tests"
cargo test --workspace --locked

step "les-core builds for a Cortex-M4F (no_std, no allocator)"
cargo build -p les-core --target thumbv7em-none-eabihf --locked

step "les-core (NEON kernels included) on aarch64 under QEMU"
./scripts/test-aarch64.sh --locked

step "docs build without warnings"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet

step "all tests passed"
