#!/usr/bin/env bash
# Builds the firmware for a tiny packed model and runs it in QEMU (mps2-an386,
# Cortex-M4F); checks that the tokens it decodes equal `les run --schedule
# resident` on the host for the same model and prompt, and that its experts
# really streamed through fewer slots than experts. The model is packed with two
# expert types (LES_FW_EXPERT_TYPES), so the slots come in two sizes. Prints
# the firmware's size.
#
# Needs: qemu-system-arm, the thumbv7em-none-eabihf target, python3.
# LES=path/to/les uses that binary instead of building one (test profile).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

prompt="${LES_FW_PROMPT_TEXT:-Once upon a time}"
n="${LES_FW_N:-8}"
slots="${LES_FW_SLOTS:-4}"
expert_types="${LES_FW_EXPERT_TYPES:-0-1:q8_0,2-:q4_0}"

if [ -z "${LES:-}" ]; then
    cargo build --locked --quiet --profile test -p les --bin les
    LES="$root/target/debug/les"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$LES" synth --arch qwen3moe --preset tiny -o "$work/tiny.gguf" >/dev/null
# Mixed precision per layer, so the experts come in two sizes and the firmware
# sizes its slots per size (les-core's slot classes).
"$LES" pack --quiet "$work/tiny.gguf" -o "$work/tiny.packed.gguf" --expert-types "$expert_types"
"$LES" mcu-index "$work/tiny.packed.gguf" -o "$work/tiny.lesm" >/dev/null
"$LES" run -m "$work/tiny.packed.gguf" -p "$prompt" -n "$n" --temp 0 \
    --schedule resident --json -t 1 >"$work/host.json" 2>/dev/null
prompt_ids="$(python3 -c 'import json,sys; print(",".join(map(str, json.load(open(sys.argv[1]))["prompt_tokens"])))' "$work/host.json")"

echo "firmware: building for $(wc -c <"$work/tiny.packed.gguf") bytes of model, prompt [$prompt_ids], $slots slots"
(
    cd "$here"
    LES_FW_MODEL="$work/tiny.packed.gguf" LES_FW_INDEX="$work/tiny.lesm" \
        LES_FW_PROMPT="$prompt_ids" LES_FW_N="$n" LES_FW_SLOTS="$slots" \
        cargo build --locked --quiet --release
)
elf="$here/target/thumbv7em-none-eabihf/release/les-firmware"

set +e
timeout 300 qemu-system-arm -machine mps2-an386 -cpu cortex-m4 -nographic \
    -monitor none -serial none -semihosting-config enable=on,target=native \
    -kernel "$elf" >"$work/fw.out" 2>&1
rc=$?
set -e
sed 's/^/  qemu| /' "$work/fw.out"
if [ "$rc" -ne 0 ]; then
    echo "firmware: FAILED, exit code $rc" >&2
    exit 1
fi

python3 - "$work/host.json" "$work/fw.out" "$slots" "$expert_types" <<'PY'
import json, re, sys
host = json.load(open(sys.argv[1]))
out = open(sys.argv[2]).read()
slots = int(sys.argv[3])
n_types = len({t.split(":")[1] for t in sys.argv[4].split(",")})
m = re.search(r"^tokens:((?: \d+)*)$", out, re.M)
assert m, "the firmware printed no tokens line"
fw = [int(t) for t in m.group(1).split()]
want = host["tokens"]
# The host stops at an end-of-generation token (not listed); the firmware
# decodes a fixed count, so it may go on after it.
if host["stats"]["stop"] == "eog":
    fw = fw[: len(want)]
if fw != want:
    sys.exit(f"firmware tokens {fw} != host resident tokens {want}")
stats = dict(re.findall(r"(\w+) (\d+)", out.split("scheduler:", 1)[1].splitlines()[0]))
dev = dict(re.findall(r"(\w+) (\d+)", out.split("device:", 1)[1].splitlines()[0]))
misses, reads = int(stats["misses"]), int(dev["reads"])
m = re.search(r"^les-firmware: .* slots \(([^)]*)\)", out, re.M)
assert m, "the firmware printed no slot classes"
classes = [(int(n), int(b)) for n, b in re.findall(r"(\d+) of (\d+) bytes", m.group(1))]
if sum(n for n, _ in classes) != slots or len(classes) != n_types:
    sys.exit(f"slot classes {classes}: not {slots} slots of {n_types} sizes")
if misses == 0 or reads <= slots:
    sys.exit(f"experts did not stream: {misses} misses, {reads} reads into {slots} slots")
print(f"firmware: tokens {fw} equal the host's; {reads} expert reads into {slots} slots "
      f"of {len(classes)} sizes {[b for _, b in classes]} "
      f"({stats['hits']} hits, {misses} misses, {stats['useful_prefetches']} useful prefetches)")
PY

# Sizes: flash (text + data) and RAM (data + bss), the model's bytes apart.
model_bytes=$(( $(wc -c <"$work/tiny.packed.gguf") + $(wc -c <"$work/tiny.lesm") ))
sizes="$(size "$elf" 2>/dev/null | tail -n 1 || true)"
if [ -n "$sizes" ]; then
    read -r text data bss _ <<<"$sizes"
    echo "firmware: flash $((text + data)) bytes ($((text + data - model_bytes)) code and constants + $model_bytes model and index), RAM $((data + bss)) bytes static + the stack (see above)"
fi
echo "firmware: ok"
