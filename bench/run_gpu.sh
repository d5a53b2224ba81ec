#!/usr/bin/env bash
# The one call on the GPU machine: every test binary of the bundle, compute-sanitizer memcheck
# and racecheck on a small subset, the kernel benchmark and the PyTorch SDPA anchors, then a
# short summary (printed last, so it ends the reply).
#
# Here (build machine), after building the programs:
#   /work/shared/tools/gpu-bundle build/gpu-bundle \
#     build-cuda/tests/cuda/attn_cuda_tests build-cuda/tests/cpu/attn_cpu_tests \
#     build-cuda/bench/cuda/attn_kernel_bench
# There (device tool, repo root, carry build/gpu-bundle):
#   bash bench/run_gpu.sh
#
# Results go to $OUT (at most 8 files come back): summary.txt, tests.log, tests-xml.tar,
# sanitizer.log, bench.jsonl, sdpa.jsonl, anchor.txt.
# Knobs (environment): BUNDLE (build/gpu-bundle), BENCH_ARGS (extra attn_kernel_bench flags),
# ANCHOR_ARGS (extra sdpa_anchor.py flags), TEST_FILTER (gtest filter of the test programs),
# SANITIZER_FILTER (gtest filter), SANITIZER_TOOLS (default memcheck racecheck), SKIP (any of
# tests,sanitizer,bench,anchor, comma-separated).
set -uo pipefail

bundle=${BUNDLE:-build/gpu-bundle}
out=${OUT:-/tmp/attn-gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source "$bundle/env.sh" || { echo "run_gpu: no bundle at $bundle" >&2; exit 2; }
skip=",${SKIP:-},"
summary="$out/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }

say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"

# 1. Tests: every *_tests program in the bundle, one gtest XML each.
if [[ $skip != *,tests,* ]]; then
  xml_dir=$(mktemp -d)
  : >"$out/tests.log"
  for t in "$bundle"/bin/*_tests; do
    [[ -x $t ]] || continue
    name=$(basename "$t")
    start=$SECONDS
    "$t" --gtest_output="xml:$xml_dir/$name.xml" --gtest_filter="${TEST_FILTER:-*}" \
      >>"$out/tests.log" 2>&1
    rc=$?
    counts=$(python3 - "$xml_dir/$name.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    r = ET.parse(sys.argv[1]).getroot()
    t, f, e = (int(r.get(k, 0)) for k in ("tests", "failures", "errors"))
    s = sum(1 for c in r.iter("testcase") if c.find("skipped") is not None)
    print(f"{t - f - e - s} passed, {f + e} failed, {s} skipped of {t}")
except Exception as ex:
    print(f"no XML ({ex})")
PY
)
    say "tests  $name: rc=$rc, $counts ($((SECONDS - start)) s)"
  done
  tar -C "$xml_dir" -cf "$out/tests-xml.tar" . && rm -rf "$xml_dir"
  grep -E '^\[  FAILED  \]' "$out/tests.log" | sort -u | head -20 | tee -a "$summary"
fi

# 2. compute-sanitizer on a small subset of the CUDA suite (racecheck is slow).
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
filter=${SANITIZER_FILTER:-'Sweep/CudaSweepTest.*/len17_causal_bf16_d32_gqa2:Sweep/CudaSweepTest.*/varlen_empty_causal_f16_d64:Sweep/CudaSweepTest.*/window16_8_bf16_d128_gqa8:CudaNaive.Chunked*:CudaNaive.AlternatingStreams*:CudaNaive.Backward*:Sweep/CudaSweepTest.NaiveBackward*/varlen_padded_f32_d80_window'}
if [[ $skip != *,sanitizer,* ]] && [[ -x $sanitizer ]] && [[ -x $bundle/bin/attn_cuda_tests ]]; then
  : >"$out/sanitizer.log"
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
    start=$SECONDS
    "$sanitizer" --tool "$tool" --error-exitcode 99 "$bundle/bin/attn_cuda_tests" \
      --gtest_filter="$filter" >>"$out/sanitizer.log" 2>&1
    rc=$?
    line=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' "$out/sanitizer.log" | tail -1)
    tests=$(grep -E '^\[  (PASSED|FAILED)  \]' "$out/sanitizer.log" | tail -2 | tr '\n' ' ')
    say "sanitizer $tool: rc=$rc ${line:-no summary} | $tests($((SECONDS - start)) s)"
  done
elif [[ $skip != *,sanitizer,* ]]; then
  say "sanitizer: not run (compute-sanitizer or attn_cuda_tests missing)"
fi

# 3. Kernel benchmark (JSON lines), then the anchors and the ratio table.
if [[ $skip != *,bench,* ]]; then
  start=$SECONDS
  # shellcheck disable=SC2086
  attn_kernel_bench --json ${BENCH_ARGS:-} >"$out/bench.jsonl" 2>>"$out/tests.log"
  say "bench: rc=$? $(grep -c '"status":"ok"' "$out/bench.jsonl") ok rows, $(grep -vc '"status":"ok"' "$out/bench.jsonl") other ($((SECONDS - start)) s)"
fi
if [[ $skip != *,anchor,* ]]; then
  start=$SECONDS
  rm -f "$out/sdpa.jsonl"
  # shellcheck disable=SC2086
  python3 bench/sdpa_anchor.py --ours "$out/bench.jsonl" --out "$out/sdpa.jsonl" \
    ${ANCHOR_ARGS:-} >"$out/anchor.txt" 2>&1
  say "anchor: rc=$? ($((SECONDS - start)) s)"
  grep -E '^(\||#|note|forward|pinned|device memory|  (bf16|fp16))' "$out/anchor.txt" | tee -a "$summary"
  tail -3 "$out/anchor.txt" | grep -iE 'error|traceback' | tee -a "$summary"
fi

echo
echo "==== summary ($out) ===="
cat "$summary"
