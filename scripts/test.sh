#!/usr/bin/env bash
# Installs what the tests need on a fresh machine, then runs every test.
# This is the README's test command; .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*" >&2; }

# One clean build: incremental caches would only double the disk it takes.
export CARGO_INCREMENTAL=0
df -h . 2>/dev/null | awk 'NR == 2 { print "disk: " $4 " free of " $2 }' >&2 || true

step "installing test dependencies"
if ! python3 -c "import gguf, numpy" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check gguf numpy
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true
if ! rustup target list --installed | grep -qx thumbv7em-none-eabihf; then
    rustup target add thumbv7em-none-eabihf
fi
# The firmware test runs in QEMU; the fuzz targets build with cargo-fuzz.
if ! command -v qemu-system-arm >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends qemu-system-arm >/dev/null
fi
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked --quiet
fi
# Miri needs a nightly toolchain with the miri component (checked below).
miri=""
if rustup toolchain list | grep -q '^nightly' \
    || rustup toolchain install nightly --profile minimal >/dev/null 2>&1; then
    if rustup component add miri rust-src --toolchain nightly >/dev/null 2>&1; then
        miri="yes"
    fi
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
cargo fmt --manifest-path fuzz/Cargo.toml -- --check
cargo fmt --manifest-path tests/firmware/Cargo.toml -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy --manifest-path fuzz/Cargo.toml --all-targets --locked -- -D warnings

step "unit, property and integration tests"
cargo test --workspace --locked

step "les-core builds for a Cortex-M4F (no_std, no allocator)"
cargo build -p les-core --target thumbv7em-none-eabihf --locked

step "les-core (NEON kernels included) on aarch64 under QEMU"
./scripts/test-aarch64.sh --locked

step "firmware: les-core on a Cortex-M4F in QEMU (mps2-an386), tokens equal the host's"
tests/firmware/run.sh

step "fuzz targets, 8 s each (longer runs: see README)"
fuzz/run.sh 8

step "miri: the slot table, the simulated device and the scheduler"
if [ -n "$miri" ]; then
    # Deterministic floats: the scheduler tests compare offloaded and resident
    # outputs bit for bit; isolation off: proptest reads its regression file.
    export MIRIFLAGS="-Zmiri-disable-isolation -Zmiri-deterministic-floats"
    cargo +nightly miri test --locked -p les-core --lib -- slots:: blockdev:: layout::
    cargo +nightly miri test --locked -p les-core --test scheduler_props
    unset MIRIFLAGS
else
    echo "SKIPPED: miri needs a nightly toolchain with the miri component, which" \
        "could not be installed on this machine" >&2
fi

step "docs build without warnings"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet

step "all tests passed"
