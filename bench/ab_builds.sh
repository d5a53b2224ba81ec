#!/usr/bin/env bash
# A/B of kernel builds on the GPU machine, in one call: each build's attn_kernel_bench in turn,
# ROUNDS times over, on one grid, then PyTorch's SDPA backends on the same grid, then the table
# (bench/ab_table.py: best of the rounds, each build against the first and against the anchors,
# and how far a build's own rounds spread).
#
# Here (build machine): build each variant and keep its program under a name of its own, e.g.
#   cp build-cuda/bench/cuda/attn_kernel_bench /tmp/ab/attn_kernel_bench_base   (and _new, ...)
#   /work/shared/tools/gpu-bundle build/gpu-bundle /tmp/ab/attn_kernel_bench_base /tmp/ab/...
# There (device tool, repo root, carry build/gpu-bundle):
#   BUILDS="base new" PASS=bwd bash bench/ab_builds.sh
#
# Knobs (environment): BUILDS (names b of attn_kernel_bench_<b> on PATH, the first the
# reference; required), PASS (fwd or bwd; fwd), DTYPES (bf16,fp16), DIMS (64,128),
# LENGTHS (1024,4096,16384), CAUSAL (0,1), ROUNDS (2), BENCH_ARGS (extra attn_kernel_bench
# flags, e.g. --kernel=sm90_tma), ANCHOR (sdpa_anchor.py backends, CUDNN; "none" skips it),
# BUNDLE (build/gpu-bundle). Results in $OUT, four files (so that bench/run_gpu.sh's tests can
# share the call and its eight returned files): ab.jsonl (rows tagged build and round),
# sdpa.jsonl, ab.log (the GPU, each run's status, the programs' stderr), table.md (also
# printed last).
set -uo pipefail

bundle=${BUNDLE:-build/gpu-bundle}
out=${OUT:-/tmp/attn-ab-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source "$bundle/env.sh" || { echo "ab_builds: no bundle at $bundle" >&2; exit 2; }
[[ -n ${BUILDS:-} ]] || { echo "ab_builds: set BUILDS, e.g. BUILDS=\"base new\"" >&2; exit 2; }
for b in $BUILDS; do
  command -v "attn_kernel_bench_$b" >/dev/null ||
    { echo "ab_builds: no attn_kernel_bench_$b in the bundle" >&2; exit 2; }
done
pass=${PASS:-fwd}
dtypes=${DTYPES:-bf16,fp16} dims=${DIMS:-64,128} lengths=${LENGTHS:-1024,4096,16384}
causal=${CAUSAL:-0,1}

log="$out/ab.log"
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)
echo "$(date -u +%FT%TZ) $gpu" | tee "$log"
: >"$out/ab.jsonl"
for round in $(seq "${ROUNDS:-2}"); do
  for b in $BUILDS; do
    start=$SECONDS
    # shellcheck disable=SC2086
    "attn_kernel_bench_$b" --json --pass="$pass" --engine=fused --dtype="$dtypes" --d="$dims" \
      --n="$lengths" --causal="$causal" --min_ms=30 --warmup_ms=10 ${BENCH_ARGS:-} \
      2>>"$log" |
      sed "s/^{/{\"build\":\"$b\",\"round\":$round,/" >>"$out/ab.jsonl"
    echo "round $round $b: rc=${PIPESTATUS[0]} ($((SECONDS - start)) s)" | tee -a "$log"
  done
done

anchor=()
if [[ ${ANCHOR:-CUDNN} != none ]]; then
  rm -f "$out/sdpa.jsonl"
  python3 bench/sdpa_anchor.py --pass "$pass" --dtype "$dtypes" --d "$dims" --n "$lengths" \
    --causal "$causal" --backends "${ANCHOR:-CUDNN}" --rep-ms 40 --out "$out/sdpa.jsonl" \
    >>"$log" 2>&1 || { echo "ab_builds: sdpa_anchor failed:"; tail -3 "$log"; }
  [[ -s $out/sdpa.jsonl ]] && anchor=(--anchor "$out/sdpa.jsonl")
fi
{
  echo "$gpu"
  python3 bench/ab_table.py "$out/ab.jsonl" "${anchor[@]}"
} >"$out/table.md"
echo
cat "$out/table.md"
