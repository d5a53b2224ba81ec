#!/usr/bin/env bash
# The GPU check of the paged forward and split-KV decode, in one call: the paged tests, the
# whole CUDA suite, compute-sanitizer memcheck and racecheck on a small paged subset (a ring of
# stages that wraps, sequence tails, splits and the combine, the prefill's multi-page tiles, the
# warp-specialised prefill's boxes of one swizzle atom, whole pages and tails),
# attn_decode_bench (the main grid, then the sweeps that chose the heuristics), and PyTorch
# SDPA's decode anchors on the same shapes; a short table last: ours against each SDPA backend
# per row, TB/s and the fraction of the copy bandwidth.
#
# Here (build machine), after building the programs (CUDA with sm_90a):
#   /work/shared/tools/gpu-bundle build/gpu-bundle \
#     build-decode/tests/cuda/attn_cuda_tests build-decode/bench/cuda/attn_decode_bench
# There (device tool, repo root, carry build/gpu-bundle):
#   bash bench/cuda/decode_check.sh
#
# Results go to $OUT (at most 8 files come back): summary.txt (also printed last), tests.log,
# sanitizer.log, decode.jsonl (the main grid), decode-sweep.jsonl (forced splits and page
# sizes, and the paged prefill against the dense forward), sdpa-decode.jsonl, anchor.txt.
# Knobs (environment): BUNDLE (build/gpu-bundle), SKIP (any of paged,suite,sanitizer,bench,
# sweep,anchor, comma-separated), BENCH_ARGS, SWEEP_ARGS (the sweeps' attn_decode_bench runs,
# ';'-separated), ANCHOR_ARGS, SANITIZER_FILTER, and step time limits in seconds: PAGED_LIMIT,
# SUITE_LIMIT, SANITIZER_LIMIT, BENCH_LIMIT, ANCHOR_LIMIT.
set -uo pipefail

bundle=${BUNDLE:-build/gpu-bundle}
out=${OUT:-/tmp/attn-decode-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source "$bundle/env.sh" || { echo "decode_check: no bundle at $bundle" >&2; exit 2; }
skip=",${SKIP:-},"
summary="$out/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
tests=$bundle/bin/attn_cuda_tests
paged='Paged/*:CudaPaged*:PagedSupport*:PagedPlan*'

say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"

# Counts of a gtest XML file: "P passed, F failed, S skipped of T".
counts() {
  python3 - "$1" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    r = ET.parse(sys.argv[1]).getroot()
    t, f, e = (int(r.get(k, 0)) for k in ("tests", "failures", "errors"))
    s = sum(1 for c in r.iter("testcase") if c.find("skipped") is not None)
    print(f"{t - f - e - s} passed, {f + e} failed, {s} skipped of {t}")
except Exception as ex:
    print(f"no XML ({ex})")
PY
}

# 1. Tests: the paged ones, then the rest of the suite.
xml_dir=$(mktemp -d)
: >"$out/tests.log"
run_tests() {  # name filter limit
  local name=$1 filter=$2 limit=$3 start=$SECONDS
  timeout "$limit" "$tests" --gtest_filter="$filter" --gtest_output="xml:$xml_dir/$name.xml" \
    >>"$out/tests.log" 2>&1
  local rc=$?
  say "tests  $name: rc=$rc, $(counts "$xml_dir/$name.xml") ($((SECONDS - start)) s)"
}
if [[ $skip != *,paged,* ]]; then run_tests paged "$paged" "${PAGED_LIMIT:-150}"; fi
if [[ $skip != *,suite,* ]]; then run_tests rest-of-suite "-$paged" "${SUITE_LIMIT:-200}"; fi
grep -E '^\[  FAILED  \]' "$out/tests.log" | sort -u | head -20 | tee -a "$summary"
rm -rf "$xml_dir"

# 2. compute-sanitizer on a small paged subset.
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
m='Paged/CudaPagedTest.MatchesReference'
filter=${SANITIZER_FILTER:-"$m/decode_len1013_g1_p1_d128_bf16:$m/decode_len17_g8_p16_d128_f16:$m/splits7_p16:$m/splits300_p256:$m/decode_q5_causal_p16:$m/prefill_causal_p16:$m/prefill_d96_causal_p64:$m/tma_ragged_p8_d128_causal_f16:$m/tma_ragged_p256_d64_f16:$m/tma_edges_p16_d256:$m/tma_spare_in_unused_slots_p64"}
if [[ $skip != *,sanitizer,* ]] && [[ -x $sanitizer ]]; then
  : >"$out/sanitizer.log"
  for tool in memcheck racecheck; do
    start=$SECONDS
    timeout "${SANITIZER_LIMIT:-90}" "$sanitizer" --tool "$tool" --error-exitcode 99 "$tests" \
      --gtest_filter="$filter" >>"$out/sanitizer.log" 2>&1
    rc=$?
    line=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer.log" | tail -1)
    passed=$(grep -E '^\[  (PASSED|FAILED)  \]' "$out/sanitizer.log" | tail -2 | tr '\n' ' ')
    say "sanitizer $tool: rc=$rc ${line:-no summary} | $passed($((SECONDS - start)) s)"
  done
elif [[ $skip != *,sanitizer,* ]]; then
  say "sanitizer: not run (compute-sanitizer missing)"
fi

# 3. The decode benchmark: the main grid, then the sweeps.
if [[ $skip != *,bench,* ]]; then
  start=$SECONDS
  # shellcheck disable=SC2086
  timeout "${BENCH_LIMIT:-120}" attn_decode_bench --json ${BENCH_ARGS:-} \
    >"$out/decode.jsonl" 2>>"$out/tests.log"
  say "bench: rc=$? $(grep -c '"status":"ok"' "$out/decode.jsonl") ok rows," \
    "$(grep '"pass":"decode"' "$out/decode.jsonl" | grep -vc '"status":"ok"') other" \
    "($((SECONDS - start)) s)"
fi
if [[ $skip != *,sweep,* ]]; then
  start=$SECONDS
  : >"$out/decode-sweep.jsonl"
  # Forced split counts and page sizes (what chose the heuristics), several query tokens, one KV
  # head (its rows contiguous in a page: the layout's share of the read rate), and the paged
  # prefill against the dense forward at d 128 and 64.
  sweeps=${SWEEP_ARGS:-"--batch=1,4,8,16 --context=4096,32768 --splits=0,1,2,4,8,16,32,64;--batch=1,16 --context=8192,32768 --page_tokens=16,64,128,256;--batch=16 --context=8192 --q_tokens=4 --splits=0,1,2;--heads=4 --kv_heads=1 --batch=128,256 --context=8192,32768;--batch=1 --context=1024 --prefill=4096;--d=64 --batch=1 --context=1024 --prefill=4096"}
  IFS=';' read -ra runs <<<"$sweeps"
  for args in "${runs[@]}"; do
    # shellcheck disable=SC2086
    timeout "${BENCH_LIMIT:-120}" attn_decode_bench --json --min_ms=30 $args \
      >>"$out/decode-sweep.jsonl" 2>>"$out/tests.log"
    say "sweep: rc=$? $args"
  done
  say "sweep: $(grep -c '"status":"ok"' "$out/decode-sweep.jsonl") ok rows ($((SECONDS - start)) s)"
fi

# 4. The SDPA anchors on the same shapes, and the table.
if [[ $skip != *,anchor,* ]]; then
  start=$SECONDS
  rm -f "$out/sdpa-decode.jsonl"
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 timeout "${ANCHOR_LIMIT:-150}" python3 bench/sdpa_anchor.py --pass decode \
    --ours "$out/decode.jsonl" --out "$out/sdpa-decode.jsonl" ${ANCHOR_ARGS:-} \
    >"$out/anchor.txt" 2>&1
  say "anchor: rc=$? ($((SECONDS - start)) s)"
  tail -3 "$out/anchor.txt" | grep -iE 'error|traceback' | tee -a "$summary"
  grep -E '^(\||#|decode|note)' "$out/anchor.txt" | tee -a "$summary" >/dev/null
fi

echo
echo "==== summary ($out) ===="
cat "$summary"
