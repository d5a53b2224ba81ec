#!/usr/bin/env bash
# Our fused engine and cuDNN under sustained load, shape by shape in turn: each runs back to back
# for seconds (ours: attn_kernel_bench with a long warm-up and --min_ms; cuDNN:
# bench/sdpa_anchor.py --sustained-s), long enough for a power-capped GPU to settle its clock,
# while nvidia-smi logs the SM clock and board power every 100 ms. bench/sustained_table.py reads
# the log over each row's timed window and prints TFLOP/s, clock and power side by side.
#
# There (device tool, repo root, carry build/gpu-bundle): bash bench/sustained.sh
# Results in $OUT (rows and the log appended to, so that runs with other knobs can share it):
# ours.jsonl, sdpa.jsonl, smi.csv, and table.md over all of them.
# Knobs (environment, space-separated lists): BUNDLE, SECONDS_EACH (timed seconds a row after
# 1.5 s of warm-up, default 3), PASSES (fwd bwd), DTYPES (bf16), DS (64 128), CAUSALS (0 1),
# NS (1024 4096 16384).
set -uo pipefail

bundle=${BUNDLE:-build/gpu-bundle}
out=${OUT:-/tmp/attn-sustained-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source "$bundle/env.sh" || { echo "sustained: no bundle at $bundle" >&2; exit 2; }
each=${SECONDS_EACH:-3}
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader \
  >"$out/gpu.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader,nounits -lms 100 >>"$out/smi.csv" &
smi=$!
trap 'kill $smi 2>/dev/null' EXIT
for pass in ${PASSES:-fwd bwd}; do
  for dtype in ${DTYPES:-bf16}; do
    for d in ${DS:-64 128}; do
      for causal in ${CAUSALS:-0 1}; do
        for n in ${NS:-1024 4096 16384}; do
          attn_kernel_bench --json --pass="$pass" --engine=fused --dtype="$dtype" --d="$d" \
            --causal="$causal" --n="$n" --warmup_ms=1500 --min_ms="$((each * 1000))" \
            --max_repeats=1000000 >>"$out/ours.jsonl" 2>>"$out/errors.txt"
          python3 bench/sdpa_anchor.py --pass "$pass" --dtype "$dtype" --d "$d" \
            --causal "$causal" --n "$n" --backends CUDNN --sustained-s "$each" \
            --out "$out/sdpa.jsonl" >/dev/null 2>>"$out/errors.txt"
        done
      done
    done
  done
done
kill $smi
python3 bench/sustained_table.py --dir "$out" | tee "$out/table.md"
