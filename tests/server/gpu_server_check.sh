#!/usr/bin/env bash
# What only a GPU machine can show about the server, run there by hand (it is not a ctest: CI
# has no GPU). It starts `attnserve` on the listed CUDA devices (one batcher, lanes with their
# own pools and streams on every device), sends requests checked against the float64 reference,
# drives load, then reads /metrics and checks:
#   - every listed device took batches (its device pool was used) and reports cudaMemGetInfo
#     gauges;
#   - compute time was measured for the fused path (CUDA events on the lanes' streams);
#   - training steps (AttendBackward) match the reference on the fused and naive paths;
#   - tensors sent by reference to shared memory come back right, and under load;
#   - SIGTERM drains and the server exits 0.
#
# Usage (GPU machine, programs from a gpu-bundle on PATH):
#   DEVICES=0,1 OUT=/tmp/out bash tests/server/gpu_server_check.sh
# Environment: DEVICES (default 0), METRICS_ADDRESS (default 127.0.0.1:0), OUT (where logs go; default a temporary folder),
# ATTNSERVE / ATTNSERVE_CLIENT (default: found on PATH), SERVER_ARGS (extra server flags, e.g.
# --gpu_wait=block).
set -euo pipefail

server=${ATTNSERVE:-attnserve}
client=${ATTNSERVE_CLIENT:-attnserve_client}
devices=${DEVICES:-0}
out=${OUT:-$(mktemp -d)}
mkdir -p "${out}"
work=$(mktemp -d)
server_pid=
cleanup() {
  if [[ -n ${server_pid} ]] && kill -0 "${server_pid}" 2>/dev/null; then
    kill -KILL "${server_pid}" 2>/dev/null || true
  fi
  rm -rf "${work}"
}
trap cleanup EXIT
failures=0
check() {  # check DESCRIPTION COMMAND...
  local what=$1
  shift
  if "$@"; then
    echo "ok    ${what}"
  else
    echo "FAIL  ${what}"
    failures=$((failures + 1))
  fi
}

"${server}" --listen=127.0.0.1:0 --port_file="${work}/port" --metrics_address="${METRICS_ADDRESS:-127.0.0.1:0}" \
  --metrics_port_file="${work}/metrics_port" --devices="${devices}" ${SERVER_ARGS:-} \
  >"${out}/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 300); do
  [[ -s ${work}/port && -s ${work}/metrics_port ]] && break
  kill -0 "${server_pid}" 2>/dev/null || break
  sleep 0.1
done
if [[ ! -s ${work}/port || ! -s ${work}/metrics_port ]]; then
  echo "gpu_server_check: the server did not start" >&2
  cat "${out}/server.log" >&2
  exit 1
fi
target=127.0.0.1:$(cat "${work}/port")
metrics_url=http://127.0.0.1:$(cat "${work}/metrics_port")/metrics

"${client}" info --target="${target}" >"${out}/info.txt"
check "the server runs the CUDA fused engine" grep -q cuda_fused "${out}/info.txt"

check "bf16 varlen-sized causal GQA requests match the reference" \
  timeout 120 "${client}" attend --target="${target}" --check --lse --dtype=bfloat16 --batch=4 \
  --seqlen_q=512 --seqlen_k=512 --heads=16 --kv_heads=4 --head_dim=128 --causal --count=4
check "fp16 d=64 requests match the reference" \
  timeout 120 "${client}" attend --target="${target}" --check --dtype=float16 --batch=2 \
  --seqlen_q=300 --seqlen_k=700 --heads=8 --head_dim=64 --count=4
check "fp16 requests with tensors in shared memory match the reference" \
  timeout 120 "${client}" attend --target="${target}" --check --shared_memory --dtype=float16 \
  --batch=2 --seqlen_q=64 --seqlen_k=200 --heads=8 --kv_heads=2 --head_dim=128 --count=3
# Training steps through AttendBackward: the fused backward kernel on AUTO (checked to be the
# engine that answered), the naive path on request, float32 (which only the naive path covers).
# pipefail: a failed check fails the step even when the engine's name was printed.
check "bf16 causal GQA d=128 backward on the fused kernel matches the reference" \
  bash -c "set -o pipefail; timeout 120 '${client}' backward --target='${target}' --check --send_forward \
    --dtype=bfloat16 --batch=2 --seqlen_q=700 --seqlen_k=700 --heads=16 --kv_heads=4 \
    --head_dim=128 --causal --count=2 | tee '${out}/backward-fused.txt' | grep cuda_fused >/dev/null"
check "fp16 d=64 backward with fewer queries than keys (fused, server recomputes O) matches" \
  bash -c "set -o pipefail; timeout 120 '${client}' backward --target='${target}' --check --dtype=float16 \
    --batch=2 --seqlen_q=129 --seqlen_k=513 --heads=8 --head_dim=64 --count=2 \
    | tee '${out}/backward-fused-q-lt-k.txt' | grep cuda_fused >/dev/null"
check "bf16 d=128 backward on the naive path (requested) matches the reference" \
  bash -c "set -o pipefail; timeout 120 '${client}' backward --target='${target}' --check --send_forward \
    --path=naive --dtype=bfloat16 --batch=2 --seqlen_q=300 --seqlen_k=300 --heads=8 \
    --kv_heads=2 --head_dim=128 --causal | tee '${out}/backward-naive.txt' | grep cuda_naive >/dev/null"
check "float32 backward (naive path) matches the reference" \
  timeout 120 "${client}" backward --target="${target}" --check --dtype=float32 --batch=1 \
  --seqlen_q=200 --seqlen_k=200 --heads=4 --head_dim=64
# Four clients at once, two with page-locked shared-memory tensors and two inline, in one shape
# family so that their requests share batches (direct DMA and staged copies in one launch).
mixed_ok=1
pids=()
for i in 0 1 2 3; do
  extra=()
  [[ $i -lt 2 ]] && extra=(--shared_memory)
  timeout 120 "${client}" attend --target="${target}" --check --dtype=float16 --batch=1 \
    --seqlen_q=$((40 + 7 * i)) --seqlen_k=$((90 + 5 * i)) --heads=8 --kv_heads=2 --head_dim=128 \
    --lse --count=25 --seed=$((100 * i)) "${extra[@]}" >"${out}/mixed-${i}.txt" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "${pid}" || mixed_ok=0; done
check "mixed shared-memory and inline clients at once all match the reference" \
  test "${mixed_ok}" -eq 1
check "shared-memory load over AttendStream: no request failed" \
  bash -c "timeout 60 '${client}' bench --target='${target}' --shared_memory --rpc=stream \
    --dtype=float16 --seqlen_q=64 --seqlen_k=64 --heads=8 --head_dim=64 --concurrency=32 \
    --duration=2s --json | tee '${out}/bench-shm.json' | grep -q '\"errors\": {}'"
check "load: 32 concurrent clients for 3 s" \
  timeout 60 "${client}" bench --target="${target}" --dtype=float16 --seqlen_q=256 \
  --seqlen_k=256 --heads=8 --head_dim=64 --concurrency=32 --duration=3s --json \
  >"${out}/bench.json"

python3 - "${metrics_url}" >"${out}/metrics.txt" <<'PY'
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
PY

# The largest value of a metric over the samples whose labels contain every given fragment.
metric_max() {
  local name=$1
  shift
  awk -v name="${name}" -v want="$*" '
    index($0, name "{") == 1 || $1 == name {
      ok = 1; n = split(want, parts, " ");
      for (i = 1; i <= n; i++) if (index($0, parts[i]) == 0) ok = 0;
      if (ok && $NF + 0 > best) best = $NF + 0;
    }
    END { print best + 0 }' "${out}/metrics.txt"
}
positive() { awk -v v="$1" 'BEGIN { exit !(v > 0) }'; }

IFS=, read -r -a device_list <<<"${devices}"
for d in "${device_list[@]}"; do
  check "device ${d}: cudaMemGetInfo total reported" \
    positive "$(metric_max attnserve_device_memory_total_bytes "device=\"cuda:${d}\"")"
  check "device ${d}: its lanes' device pool was used (peak bytes > 0)" \
    positive "$(metric_max attnserve_pool_in_use_peak_bytes "device=\"cuda:${d}\"" 'memory="device"')"
done
check "fused compute time measured (compute histogram count > 0)" \
  positive "$(metric_max attnserve_compute_seconds_count 'path="fused"')"
check "fused work counted (FLOPs > 0)" positive "$(metric_max attnserve_flops_total 'path="fused"')"

kill -TERM "${server_pid}"
status=0
wait "${server_pid}" || status=$?
server_pid=
check "SIGTERM: exit 0" test "${status}" -eq 0
grep -E 'drained' "${out}/server.log" || true

echo "gpu_server_check: ${failures} failed"
[[ ${failures} -eq 0 ]]
