#!/usr/bin/env bash
# Training jobs on the GPU machine, in one call: the same associative-recall jobs on the CUDA
# fused engine (fused forward and backward), on the CUDA naive path (naive forward and backward)
# and, for the small job, on the CPU tiled engine; each job's loss curve and tokens/s; then the
# same layer trained by PyTorch (SDPA, same shapes, AdamW, bf16 autocast) for tokens/s beside it.
#
# Here (build machine), after a CUDA build of the server and client (build-cuda, -DATTN_CUDA=ON):
#   /work/shared/tools/gpu-bundle build/gpu-bundle \
#     build-cuda/server/attnserve build-cuda/clients/cli/attnserve_client
# There (device tool, repo root, carry build/gpu-bundle; python3 with torch and CUDA for the
# PyTorch side):
#   bash bench/training/gpu_train_check.sh
#
# Jobs (bf16, causal, residual + layer norm, AdamW at a constant learning rate):
#   small  model_dim 64,   4 heads / 2 KV heads, head_dim 32, seqlen 32,   batch 16, vocab 16,
#          300 steps (the CPU test's job at the smallest head_dim the fused kernels have)
#   large  model_dim 1024, 16 heads / 4 KV heads, head_dim 64, seqlen 1024, batch 16, vocab 512,
#          200 steps, lr 3e-3 (throughput: attention and the projections dominate)
# Checkpoints are off inside the timed runs (checkpoint_every beyond the steps); one more large
# fused job checkpoints every 50 steps to time the writes (metrics).
# Results go to $OUT: summary.txt (the table, printed last), loss_<job>_<engine>.csv,
# jobs.jsonl (each job's final TrainingJob), torch.jsonl, server.log, metrics.txt, and, where the
# bundle holds attn_train_step_bench, step_bench.jsonl (a large step's phases, fused and naive).
# Knobs: BUNDLE (build/gpu-bundle), STEPS_SMALL, STEPS_LARGE, SKIP (any of
# cpu,torch,checkpoint,bench).
set -uo pipefail

bundle=${BUNDLE:-build/gpu-bundle}
out=${OUT:-/tmp/train-gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source "$bundle/env.sh" || { echo "gpu_train_check: no bundle at $bundle" >&2; exit 2; }
skip=",${SKIP:-},"
steps_small=${STEPS_SMALL:-300}
steps_large=${STEPS_LARGE:-200}
summary="$out/summary.txt"
: >"$summary"
: >"$out/jobs.jsonl"
: >"$out/torch.jsonl"
say() { echo "$*" | tee -a "$summary"; }
say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"

work=$(mktemp -d)
attnserve --listen=127.0.0.1:0 --port_file="$work/port" --metrics_address=127.0.0.1:0 \
  --metrics_port_file="$work/metrics_port" --training_dir="$work/jobs" --log_level=info \
  >"$out/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 150); do [[ -s $work/port ]] && break; sleep 0.2; done
[[ -s $work/port ]] || { say "attnserve did not start"; tail -20 "$out/server.log"; exit 1; }
target="127.0.0.1:$(cat "$work/port")"
client() { attnserve_client --target="$target" --timeout=600s "$@"; }

small=(--model_dim=64 --num_heads=4 --num_kv_heads=2 --head_dim=32 --seqlen=32 --batch_size=16
  --vocab_size=16 --lr=0.01 --steps="$steps_small")
large=(--model_dim=1024 --num_heads=16 --num_kv_heads=4 --head_dim=64 --seqlen=1024
  --batch_size=16 --vocab_size=512 --lr=0.003 --steps="$steps_large")

# run_job NAME PATH FLAGS...: one job to its end; its curve, its final state; one summary line.
run_job() {
  local name=$1 path=$2
  shift 2
  local id
  id=$(client train submit --causal --dtype=bfloat16 --path="$path" --name="$name-$path" "$@" |
    awk '{print $1}')
  [[ -n $id ]] || { say "$name $path: submission failed"; return; }
  client train watch --job="$id" >/dev/null
  client train status --job="$id" --json >>"$out/jobs.jsonl"
  client train result --job="$id" --curve_csv="$out/loss_${name}_${path}.csv" >/dev/null
  python3 - "$out/jobs.jsonl" "$out/loss_${name}_${path}.csv" "$name" "$path" <<'PY' | tee -a "$summary"
import csv, json, sys
job = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
p = job.get("progress", {})
rows = list(csv.DictReader(open(sys.argv[2])))
first = float(rows[0]["loss"]) if rows else float("nan")
last10 = sum(float(r["loss"]) for r in rows[-10:]) / max(len(rows[-10:]), 1)
metric = rows[-1].get("accuracy", "") if rows else ""
print(f"job {sys.argv[3]:5s} {sys.argv[4]:5s} {job['state'].removeprefix('TRAINING_JOB_'):9s} "
      f"engines {job.get('forwardEngine', '?')}/{job.get('backwardEngine', '?')}  "
      f"{float(p.get('tokensPerSecond', 0)):12.0f} tokens/s  loss {first:.3f} -> {last10:.4f} "
      f"(last 10)  accuracy {metric}  steps {p.get('step', 0)}  {job.get('error', '')}")
PY
}

for path in fused naive; do run_job small "$path" "${small[@]}" --checkpoint_every=100000; done
[[ $skip != *,cpu,* ]] && run_job small cpu "${small[@]}" --checkpoint_every=100000
for path in fused naive; do run_job large "$path" "${large[@]}" --checkpoint_every=100000; done
if [[ $skip != *,checkpoint,* ]]; then
  run_job ckpt fused "${large[@]}" --steps=100 --checkpoint_every=50
fi
# One large step's phases and the trainer without the server (bench/cuda/train_step_bench.cc),
# where the bundle has it.
if [[ $skip != *,bench,* ]] && command -v attn_train_step_bench >/dev/null; then
  for path in fused naive; do
    attn_train_step_bench --path="$path" --steps=20 >"$work/bench_$path.txt" 2>&1 ||
      say "attn_train_step_bench $path: exit $?"
    grep '^{' "$work/bench_$path.txt" >>"$out/step_bench.jsonl"
    sed -n '/^phase/,$p' "$work/bench_$path.txt" | tee -a "$summary"
  done
fi
curl -s "http://127.0.0.1:$(cat "$work/metrics_port")/metrics" | grep '^attnserve_training' \
  >"$out/metrics.txt" || true
grep -E 'checkpoint_duration_seconds_(sum|count)' "$out/metrics.txt" | tee -a "$summary"

if [[ $skip != *,torch,* ]]; then
  if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    for cfg in small large; do
      if [[ $cfg == small ]]; then
        args=(--model_dim 64 --num_heads 4 --num_kv_heads 2 --head_dim 32 --seqlen 32
          --batch_size 16 --vocab_size 16 --lr 0.01 --steps "$steps_small")
      else
        args=(--model_dim 1024 --num_heads 16 --num_kv_heads 4 --head_dim 64 --seqlen 1024
          --batch_size 16 --vocab_size 512 --lr 0.003 --steps "$steps_large")
      fi
      python3 bench/training/torch_train.py "${args[@]}" --curve "$out/loss_${cfg}_torch.csv" \
        >>"$out/torch.jsonl"
      python3 - "$out/torch.jsonl" "$cfg" <<'PY' | tee -a "$summary"
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(f"job {sys.argv[2]:5s} torch SDPA ({r['torch']}) {r['tokens_per_second']:12.0f} tokens/s  "
      f"loss {r['loss_first']:.3f} -> {r['loss_last']:.4f}  accuracy {r['accuracy_last']:.3f}")
PY
    done
  else
    say "torch: not run (no torch with CUDA in this python3)"
  fi
fi

kill -TERM $pid
wait $pid
rc=$?
# Job states from each job's final TrainingJob (the server log's drain line says "0 failed" of
# requests, so grepping it for " failed" counts a job that never failed).
jobs=$(python3 - "$out/jobs.jsonl" <<'PY'
import collections, json, sys
states = collections.Counter()
for line in open(sys.argv[1]):
    if line.strip():
        states[json.loads(line).get("state", "?").removeprefix("TRAINING_JOB_").lower()] += 1
others = "".join(f", {n} {s}" for s, n in sorted(states.items()) if s not in ("succeeded", "failed"))
print(f"{states['succeeded']} jobs succeeded, {states['failed']} failed{others}")
PY
)
say "server exit $rc ($jobs)"
