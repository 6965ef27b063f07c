#!/usr/bin/env bash
# Runs every fuzz target (or the ones named) for SECONDS each, from the checked-in
# seed corpus; new inputs go to a scratch directory, crashes to fuzz/artifacts/.
#
#   fuzz/run.sh 8                   # what scripts/test.sh does: a quick check
#   fuzz/run.sh 600 scheduler gguf  # longer, chosen targets
#
# The quick check builds without a sanitizer and unoptimized (`--dev -s none`),
# which works on a stable toolchain and builds fast. For long runs, AddressSanitizer
# and optimizations (nightly, or RUSTC_BOOTSTRAP=1 on stable) find more per hour:
#
#   FUZZ_FLAGS="-O -s address" RUSTC_BOOTSTRAP=1 fuzz/run.sh 3600 scheduler
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-8}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(gguf model packed_index scheduler tokenizer base_logprobs prompt_cache grammar http_request serve_api image mmproj)
fi
read -r -a flags <<<"${FUZZ_FLAGS:---dev -s none}"

cargo fuzz build "${flags[@]}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
for t in "${targets[@]}"; do
    mkdir -p "$scratch/$t"
    echo "fuzz: $t for ${seconds}s"
    # New inputs go to the scratch corpus (first); the seeds are read only.
    if ! cargo fuzz run "${flags[@]}" "$t" "$scratch/$t" "corpus/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=4096 -print_final_stats=1 \
        >"$scratch/$t.log" 2>&1; then
        tail -n 60 "$scratch/$t.log" >&2
        echo "fuzz: $t FAILED (the crashing input is in fuzz/artifacts/$t/)" >&2
        exit 1
    fi
    grep -a -E '^stat::number_of_executed_units|^#[0-9]+ +DONE' "$scratch/$t.log" | tail -n 2 | sed 's/^/  /'
done
echo "fuzz: all targets ran without a crash"
