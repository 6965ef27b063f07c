#!/usr/bin/env bash
# The main command: a multimodal decode on built-in synthetic models, no
# downloads. Builds `les` (release), synthesizes a small qwen3moe language model
# and a matching MiniCPM-V 4.6 style vision projector (cached under
# target/demo/), then asks about the bundled test image with the experts
# streamed from the model file through a few slots (the `les` schedule).
#
#   ./scripts/demo.sh              # the demo
#   ./scripts/demo.sh --json       # extra arguments go to `les run`
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== building les (release)" >&2
cargo build --release -p les --bin les --quiet
LES=target/release/les
DEMO=target/demo
mkdir -p "$DEMO"
LM="$DEMO/lm.gguf"
MMPROJ="$DEMO/mmproj.gguf"

# Re-synthesize when missing or older than the binary (the generator may change).
if [[ ! -s "$LM" || ! -s "$MMPROJ" || "$LES" -nt "$LM" || "$LES" -nt "$MMPROJ" ]]; then
    echo "== synthesizing $LM and $MMPROJ" >&2
    "$LES" synth --arch qwen3moe --preset tiny --vocab 4096 --seed 7 --quiet -o "$LM" \
        --mmproj-out "$MMPROJ" --projector minicpmv4_6 >&2
fi

echo "== les run: assets/test-image.png + \"Describe the image.\" (experts streamed)" >&2
"$LES" run -m "$LM" --mmproj "$MMPROJ" --image assets/test-image.png \
    -p "Describe the image." --chat --expert-mem 64KiB -n 48 --temp 0 "$@"
