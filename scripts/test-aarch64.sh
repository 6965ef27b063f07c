#!/usr/bin/env bash
# Runs the les-core tests (the NEON GEMV kernels included) for aarch64 under QEMU
# user-mode emulation. Needs (Debian): qemu-user gcc-aarch64-linux-gnu
# libc6-dev-arm64-cross, and `rustup target add aarch64-unknown-linux-gnu`.
# Extra arguments go to `cargo test` (e.g. a test-name filter: `gemv`).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
# QEMU's default CPU ("max") has the dot-product instructions: the NeonDot kernels
# must be detected and tested too.
export LES_EXPECT_NEON_DOTPROD=1
exec cargo test -p les-core --target aarch64-unknown-linux-gnu --lib "$@"
