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
#   - KV sessions (section "sessions"): least-loaded placement puts sessions on every listed
#     device (GetSession says where), decode and prefill steps run on every device, decode steps
#     checked against the float64 reference on every device (`bench --sessions --check`, its
#     sessions steered onto one device at a time), batches of several sessions' steps form on
#     every device, the per-device KV pool gauges move and deleted sessions' pages return;
#   - SIGTERM drains and the server exits 0 (with a session still held).
#
# Usage (GPU machine, programs from a gpu-bundle on PATH):
#   DEVICES=0,1 OUT=/tmp/out bash tests/server/gpu_server_check.sh
# Environment: DEVICES (default 0), METRICS_ADDRESS (default 127.0.0.1:0), OUT (where logs go; default a temporary folder),
# ATTNSERVE / ATTNSERVE_CLIENT (default: found on PATH), SERVER_ARGS (extra server flags, e.g.
# --gpu_wait=block), SECTIONS (default "attention sessions": the requests, training steps, load
# and their GPU metrics; the KV sessions), SESSION_CONTEXT (tokens appended to each session,
# default 1024).
# Only the "sessions" section runs on a server without a GPU (the CPU engine, with the --devices
# entries as stand-ins that have their own lanes and KV pools):
#   SECTIONS=sessions DEVICES=0,1 ATTNSERVE=build/server/attnserve \
#     ATTNSERVE_CLIENT=build/clients/cli/attnserve_client bash tests/server/gpu_server_check.sh
set -euo pipefail

server=${ATTNSERVE:-attnserve}
client=${ATTNSERVE_CLIENT:-attnserve_client}
devices=${DEVICES:-0}
sections=${SECTIONS:-attention sessions}
want() { [[ " ${sections} " == *" $1 "* ]]; }
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
gpu=0
grep -q '^gpu: true' "${out}/info.txt" && gpu=1
IFS=, read -r -a device_list <<<"${devices}"

scrape() {  # scrape FILE: the server's /metrics now
  python3 - "${metrics_url}" >"$1" <<'PY'
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
PY
}
# The largest value of a metric in a scrape over the samples whose labels contain every given
# fragment (0 when none).
metric_from() {
  local file=$1 name=$2
  shift 2
  awk -v name="${name}" -v want="$*" '
    index($0, name "{") == 1 || $1 == name {
      ok = 1; n = split(want, parts, " ");
      for (i = 1; i <= n; i++) if (index($0, parts[i]) == 0) ok = 0;
      if (ok && $NF + 0 > best) best = $NF + 0;
    }
    END { printf "%.17g\n", best + 0 }' "${file}"
}
metric_max() { metric_from "${out}/metrics.txt" "$@"; }
positive() { awk -v v="$1" 'BEGIN { exit !(v > 0) }'; }

if want attention; then
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
  # The redirection inside: check's own "ok"/"FAIL" line goes to the terminal, not the JSON.
  check "load: 32 concurrent clients for 3 s" \
    bash -c "timeout 60 '${client}' bench --target='${target}' --dtype=float16 --seqlen_q=256 \
      --seqlen_k=256 --heads=8 --head_dim=64 --concurrency=32 --duration=3s --json \
      >'${out}/bench.json'"

  scrape "${out}/metrics.txt"

  for d in "${device_list[@]}"; do
    check "device ${d}: cudaMemGetInfo total reported" \
      positive "$(metric_max attnserve_device_memory_total_bytes "device=\"cuda:${d}\"")"
    check "device ${d}: its lanes' device pool was used (peak bytes > 0)" \
      positive "$(metric_max attnserve_pool_in_use_peak_bytes "device=\"cuda:${d}\"" 'memory="device"')"
  done
  check "fused compute time measured (compute histogram count > 0)" \
    positive "$(metric_max attnserve_compute_seconds_count 'path="fused"')"
  check "fused work counted (FLOPs > 0)" positive "$(metric_max attnserve_flops_total 'path="fused"')"
fi

# KV sessions on every listed device. Placement takes the device with the most free KV pages at
# CreateSession (ties: the first listed), so sessions created and filled one after another go
# round the devices; `bench --sessions` creates all its sessions before it fills them, so they
# all land on the device that has the most free pages then: emptying one device's pool (its
# sessions deleted, the others' kept) steers a checked bench onto it. That needs pools of one
# size on every device (the same GPUs, or --kv_pool_bytes).
if want sessions; then
  ctx=${SESSION_CONTEXT:-1024}
  sflags=(--dtype=bfloat16 --heads=32 --kv_heads=8 --head_dim=128)
  ndev=${#device_list[@]}
  labels=()  # the device label of each listed device, as GetSession and /metrics name it
  for i in "${!device_list[@]}"; do
    if [[ ${gpu} -eq 1 ]]; then
      labels+=("cuda:${device_list[i]}")
    elif [[ ${ndev} -eq 1 ]]; then
      labels+=(cpu)
    else
      labels+=("cpu:${i}")  # the CPU engine's stand-in devices
    fi
  done
  sclient() { timeout 120 "${client}" "$@" --target="${target}" "${sflags[@]}"; }
  session_field() {  # session_field ID FIELD: what GetSession says
    sclient session get --session_id="$1" |
      python3 -c 'import json, sys; print(json.load(sys.stdin).get(sys.argv[1], 0))' "$2"
  }
  # The KV pool gauges are refreshed every second: wait a refresh, then scrape.
  settled_scrape() { sleep 1.5; scrape "$1"; }
  pool() {  # pool FILE LABEL in_use|free_pages
    if [[ $3 == free_pages ]]; then
      metric_from "$1" attnserve_kv_pool_free_pages "device=\"$2\""
    else
      metric_from "$1" attnserve_kv_pool_bytes "device=\"$2\"" "state=\"$3\""
    fi
  }
  equal() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a == b) }'; }
  less() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a < b) }'; }
  : >"${out}/session-devices.txt"
  new_session() {  # new_session SEED: create, fill with ctx tokens; appends "ID DEVICE" to the list
    local id device
    id=$(sclient session create) || return 1
    sclient session append --session_id="${id}" --tokens="${ctx}" --seed="$1" \
      >>"${out}/sessions.log" 2>&1 || return 1
    [[ $(session_field "${id}" tokens) == "${ctx}" ]] || return 1
    device=$(session_field "${id}" device) || return 1
    echo "${id} ${device}" >>"${out}/session-devices.txt"
  }
  delta() {  # delta METRIC FRAGMENTS...: its value in ${after} less its value in ${before}
    awk -v a="$(metric_from "${after}" "$@")" -v b="$(metric_from "${before}" "$@")" \
      'BEGIN { printf "%.17g\n", a - b }'
  }
  devices_of() { awk '{ print $2 }' "${out}/session-devices.txt"; }
  ids_on() { awk -v d="$1" '$2 == d { print $1 }' "${out}/session-devices.txt"; }

  scrape "${out}/metrics-sessions-0.txt"
  declare -A free0
  for label in "${labels[@]}"; do
    free0[${label}]=$(pool "${out}/metrics-sessions-0.txt" "${label}" free_pages)
    check "sessions ${label}: KV pool reported (total bytes, free pages)" \
      positive "$(pool "${out}/metrics-sessions-0.txt" "${label}" total)"
  done

  fill_ok=1
  for i in $(seq $((2 * ndev))); do new_session "${i}" || fill_ok=0; done
  check "sessions: $((2 * ndev)) created and filled with ${ctx} tokens each (GetSession agrees)" \
    test "${fill_ok}" -eq 1
  devices_of | sort | uniq -c
  for label in "${labels[@]}"; do
    check "sessions ${label}: holds at least one session (GetSession's device)" \
      grep -qxF "${label}" <(devices_of)
  done
  settled_scrape "${out}/metrics-sessions-1.txt"
  for label in "${labels[@]}"; do
    check "sessions ${label}: KV pool in_use bytes rose" \
      positive "$(pool "${out}/metrics-sessions-1.txt" "${label}" in_use)"
    check "sessions ${label}: KV pool free pages fell" \
      less "$(pool "${out}/metrics-sessions-1.txt" "${label}" free_pages)" "${free0[${label}]}"
    check "sessions ${label}: appended bytes counted" positive \
      "$(metric_from "${out}/metrics-sessions-1.txt" attnserve_kv_append_bytes_total "device=\"${label}\"")"
  done

  # Decode steps on every session at once (each appends its own row), then a prefill chunk.
  steps_ok=1
  pids=()
  while read -r id _; do
    (
      for s in $(seq 8); do
        sclient session attend --session_id="${id}" --append --causal --tokens=1 --seed="${s}" ||
          exit 1
      done
      sclient session attend --session_id="${id}" --append --causal --tokens=64 --seed=99
    ) >"${out}/steps-${id}.txt" 2>&1 &
    pids+=($!)
  done <"${out}/session-devices.txt"
  for pid in "${pids[@]}"; do wait "${pid}" || steps_ok=0; done
  check "sessions: 8 decode steps and a 64-token prefill on every session answered" \
    test "${steps_ok}" -eq 1
  if [[ ${gpu} -eq 1 ]]; then
    check "sessions: the fused engine answered every step" \
      bash -c "! grep -h -v '^cuda_fused: ' '${out}'/steps-*.txt | grep -q ."
  fi
  scrape "${out}/metrics-sessions-2.txt"
  for label in "${labels[@]}"; do
    largest=0
    for id in $(ids_on "${label}"); do
      b=$(sed -n 's/.*batch of \([0-9]*\).*/\1/p' "${out}/steps-${id}.txt" | sort -n | tail -1)
      [[ ${b:-0} -gt ${largest} ]] && largest=${b}
    done
    echo "      ${label}: its sessions' steps ran in batches of up to ${largest}"
    check "sessions ${label}: steps ran there (steps counted)" positive \
      "$(metric_from "${out}/metrics-sessions-2.txt" attnserve_session_steps_total "device=\"${label}\"")"
    check "sessions ${label}: cached K/V read by the steps" positive \
      "$(metric_from "${out}/metrics-sessions-2.txt" attnserve_kv_read_bytes_total "device=\"${label}\"")"
  done

  # One device at a time: delete its sessions (its pages return, it has the most free pages),
  # run a checked decode bench (its sessions land there: every first step checked against the
  # float64 reference, 8 clients so that steps share launches), then refill it with a session.
  for i in "${!labels[@]}"; do
    label=${labels[i]}
    delete_ok=1
    for id in $(ids_on "${label}"); do
      sclient session delete --session_id="${id}" || delete_ok=0
    done
    awk -v d="${label}" '$2 != d' "${out}/session-devices.txt" >"${work}/left"
    mv "${work}/left" "${out}/session-devices.txt"
    check "sessions ${label}: its sessions deleted" test "${delete_ok}" -eq 1
    before=${out}/metrics-sessions-${label}-before.txt
    settled_scrape "${before}"
    check "sessions ${label}: deleted sessions' pages returned (in_use 0, free pages as at start)" \
      bash -c "[[ $(pool "${before}" "${label}" in_use) == 0 && \
        $(pool "${before}" "${label}" free_pages) == ${free0[${label}]} ]]"
    check "sessions ${label}: 8 sessions x ${ctx} tokens, decode steps checked against the reference" \
      bash -c "timeout 120 '${client}' bench --target='${target}' ${sflags[*]} --sessions=8 \
        --context='${ctx}' --concurrency=8 --duration=2s --check --json --seed=$((1000 + i)) \
        >'${out}/bench-sessions-${label}.json' && grep -q '\"errors\": 0,' \
        '${out}/bench-sessions-${label}.json'"
    after=${out}/metrics-sessions-${label}-after.txt
    settled_scrape "${after}"
    bench_steps=$(sed -n 's/.*"steps": \([0-9]*\),.*/\1/p' "${out}/bench-sessions-${label}.json")
    elsewhere=0
    for other in "${labels[@]}"; do
      [[ ${other} == "${label}" ]] && continue
      elsewhere=$(awk -v a="${elsewhere}" -v b="$(delta attnserve_session_steps_total \
        "device=\"${other}\"")" 'BEGIN { print a + b }')
    done
    check "sessions ${label}: the bench's ${bench_steps:-0} steps ran there and nowhere else" \
      bash -c "[[ ${bench_steps:-0} -gt 0 ]] && awk -v d='$(delta attnserve_session_steps_total \
        "device=\"${label}\"")' -v s='${bench_steps:-0}' -v e='${elsewhere}' \
        'BEGIN { exit !(d >= s && e == 0) }'"
    check "sessions ${label}: decode steps of several sessions shared launches (batches of 2+)" \
      less "$(delta attnserve_session_batch_steps_count)" "$(delta attnserve_session_batch_steps_sum)"
    check "sessions ${label}: the bench's sessions deleted, their pages returned" \
      equal "$(pool "${after}" "${label}" in_use)" 0
    new_session $((2000 + i)) || true
    check "sessions ${label}: a new session lands there (the most free pages)" \
      bash -c "tail -1 '${out}/session-devices.txt' | grep -q ' ${label}\$'"
  done

  delete_ok=1
  while read -r id _; do
    sclient session delete --session_id="${id}" || delete_ok=0
  done <"${out}/session-devices.txt"
  : >"${out}/session-devices.txt"
  check "sessions: the rest deleted" test "${delete_ok}" -eq 1
  settled_scrape "${out}/metrics-sessions-3.txt"
  check "sessions: none open" equal "$(metric_from "${out}/metrics-sessions-3.txt" \
    attnserve_sessions_open)" 0
  for label in "${labels[@]}"; do
    check "sessions ${label}: every page back (in_use 0, free pages as at start)" \
      bash -c "[[ $(pool "${out}/metrics-sessions-3.txt" "${label}" in_use) == 0 && \
        $(pool "${out}/metrics-sessions-3.txt" "${label}" free_pages) == ${free0[${label}]} ]]"
  done
  # One session left open: a session held does not hold up the drain.
  check "sessions: one left open for the drain" new_session 3000
fi

kill -TERM "${server_pid}"
status=0
wait "${server_pid}" || status=$?
server_pid=
check "SIGTERM: exit 0" test "${status}" -eq 0
grep -E 'drained' "${out}/server.log" || true

echo "gpu_server_check: ${failures} failed"
[[ ${failures} -eq 0 ]]
