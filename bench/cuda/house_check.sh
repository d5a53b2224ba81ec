#!/usr/bin/env bash
# The GPU check of a kernels change that must not change behaviour or speed: the CUDA and CPU
# suites of the build after it, then attn_kernel_bench of the build before and of the build
# after, alternated in one call (before, after, after, before, ...) so that both see the same
# GPU, and a table of after/before TFLOP/s per configuration.
#
# Here (build machine), two bundles (/work/shared/tools/gpu-bundle) of CUDA builds (80;90a):
#   after:   gpu-bundle build-kern/house-after build-kern/tests/cuda/attn_cuda_tests \
#              build-kern/tests/cpu/attn_cpu_tests build-kern/bench/cuda/attn_kernel_bench
#   before:  gpu-bundle build-kern/house-before BEFORE_BUILD/bench/cuda/attn_kernel_bench
#            where BEFORE_BUILD builds the commit before the change (git archive REV | tar -x,
#            then attn_configure with -DATTN_CUDA=ON and build the attn_kernel_bench target)
# There (device tool, repo root, carry build-kern/house-before and build-kern/house-after):
#   bash bench/cuda/house_check.sh
#
# Results go to $OUT: summary.txt (also printed last), <suite>.log, tests.log (both suites and
# the benchmark's stderr), bench-<side>-<round>-<pass>.jsonl.
# Knobs (environment): BEFORE, AFTER (the bundles), ROUNDS (alternations, default 2), TOLERANCE
# (the ratio band reported as noise, default 0.03), FWD_ARGS / BWD_ARGS (attn_kernel_bench
# flags; the defaults cover every head_dim of the capability table), SKIP (tests and/or bench).
set -uo pipefail

before=${BEFORE:-build-kern/house-before}
after=${AFTER:-build-kern/house-after}
rounds=${ROUNDS:-2}
tolerance=${TOLERANCE:-0.03}
out=${OUT:-/tmp/attn-house-out}
skip=",${SKIP:-},"
# 3072 channels divide by every head_dim of the table (32, 64, 96, 128, 256).
fwd_args=${FWD_ARGS:---engine=fused --dtype=bf16,fp16 --d=32,64,96,128,256 --n=1024,4096 --causal=0,1 --head_width=3072 --min_ms=60}
bwd_args=${BWD_ARGS:---engine=fused --dtype=bf16,fp16 --d=32,64,96,128 --n=1024,4096 --causal=0,1 --head_width=3072 --min_ms=60}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }

for side in "$before" "$after"; do
  [[ -f $side/env.sh ]] || { echo "house_check: no bundle at $side" >&2; exit 2; }
done
say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"

# Runs a bundle's program with the bundle's libraries, in a subshell so the two bundles' paths
# never mix.
in_bundle() {
  local bundle=$1
  shift
  (
    # shellcheck disable=SC1091
    source "$bundle/env.sh"
    "$@"
  )
}

# 1. The suites of the build after the change.
if [[ $skip != *,tests,* ]]; then
  : >"$out/tests.log"
  for name in attn_cuda_tests attn_cpu_tests; do
    [[ -x $after/bin/$name ]] || { say "tests  $name: not in $after"; continue; }
    start=$SECONDS
    in_bundle "$after" "$name" --gtest_brief=1 >"$out/$name.log" 2>&1
    rc=$?
    result=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$name.log" | tr '\n' ' ')
    say "tests  $name: rc=$rc $result($((SECONDS - start)) s)"
    cat "$out/$name.log" >>"$out/tests.log"
  done
  grep -E '^\[  FAILED  \]' "$out/tests.log" | sort -u | head -20 | tee -a "$summary"
fi

# 2. The benchmark, before and after alternated: round r runs (before, after) when r is odd and
# (after, before) when it is even.
if [[ $skip != *,bench,* ]]; then
  for ((r = 1; r <= rounds; ++r)); do
    order=(before after)
    ((r % 2 == 0)) && order=(after before)
    for side in "${order[@]}"; do
      bundle=$before
      [[ $side == after ]] && bundle=$after
      for pass in fwd bwd; do
        args=$fwd_args
        [[ $pass == bwd ]] && args="$bwd_args --pass=bwd"
        start=$SECONDS
        # shellcheck disable=SC2086
        in_bundle "$bundle" attn_kernel_bench --json $args \
          >"$out/bench-$side-$r-$pass.jsonl" 2>>"$out/tests.log"
        say "bench  $side round $r $pass: rc=$? $(grep -c '"status":"ok"' "$out/bench-$side-$r-$pass.jsonl") rows ($((SECONDS - start)) s)"
      done
    done
  done
  python3 - "$out" "$tolerance" <<'PY' | tee -a "$summary"
import glob, json, os, statistics, sys
out, tolerance = sys.argv[1], float(sys.argv[2])
runs = {"before": {}, "after": {}}
for path in glob.glob(os.path.join(out, "bench-*-*-*.jsonl")):
    side = os.path.basename(path).split("-")[1]
    for line in open(path):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("status") != "ok":
            continue
        key = (row["pass"], row["engine"], row["dtype"], row["d"], row["causal"], row["N"])
        runs[side].setdefault(key, []).append(row["tflops"])
keys = sorted(set(runs["before"]) & set(runs["after"]))
print(f"| pass | engine | dtype | d | causal | N | before TFLOP/s | after TFLOP/s | after/before |")
print("|---|---|---|---|---|---|---|---|---|")
outside = []
for k in keys:
    b = statistics.median(runs["before"][k])
    a = statistics.median(runs["after"][k])
    ratio = a / b if b else float("nan")
    flag = "" if abs(ratio - 1) <= tolerance else "  <-- outside the band"
    if flag:
        outside.append(k)
    print(f"| {' | '.join(str(x) for x in k)} | {b:.1f} | {a:.1f} | {ratio:.3f}{flag} |")
missing = sorted(set(runs["before"]) ^ set(runs["after"]))
ratios = [statistics.median(runs["after"][k]) / statistics.median(runs["before"][k]) for k in keys]
if ratios:
    print(f"# {len(keys)} configurations, median after/before {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}; {len(outside)} outside +-{tolerance:.0%}")
if missing:
    print(f"# in one side only: {missing}")
PY
fi

echo
echo "==== summary ($out) ===="
cat "$summary"
