#!/usr/bin/env bash
# Sets everything up and runs attnserve's main job on this machine: installs the dependencies,
# builds the server and the client in build/, starts `attnserve` on a free loopback port (the
# CUDA fused engine when a GPU is usable, the CPU engine otherwise), asks it what it serves,
# sends it real attention requests checked against the float64 reference (a forward request,
# the same with its tensors in shared memory, then a training step's gradients through
# AttendBackward), then stops it with SIGTERM and checks that it drained cleanly.
#
# Arguments are passed to `attnserve_client attend`, e.g.
#   deploy/quickstart.sh --dtype=bfloat16 --seqlen_q=1024 --seqlen_k=1024 --heads=16 --causal
#
# Environment: ATTN_BUILD_DIR (default build), and those of deploy/common.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "${ATTN_ROOT}"

"${ATTN_ROOT}/deploy/install-deps.sh"
attn_find_cuda
dir=${ATTN_BUILD_DIR:-build}
attn_configure "${dir}" -DCMAKE_BUILD_TYPE=Release -DATTN_CUDA=AUTO
attn_compile "${dir}" attnserve attnserve_client

server=${dir}/server/attnserve
client=${dir}/clients/cli/attnserve_client
work=$(mktemp -d)
server_pid=
cleanup() {
  if [[ -n ${server_pid} ]] && kill -0 "${server_pid}" 2>/dev/null; then
    kill -KILL "${server_pid}" 2>/dev/null || true
  fi
  rm -rf "${work}"
}
trap cleanup EXIT

echo "==> starting ${server} on 127.0.0.1 (a free port), metrics on a free port too"
"${server}" --listen=127.0.0.1:0 --port_file="${work}/port" --metrics_address=127.0.0.1:0 \
  >"${work}/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do
  [[ -s ${work}/port ]] && break
  kill -0 "${server_pid}" 2>/dev/null || break
  sleep 0.1
done
if [[ ! -s ${work}/port ]]; then
  echo "quickstart: the server did not start:" >&2
  cat "${work}/server.log" >&2
  exit 1
fi
target=127.0.0.1:$(cat "${work}/port")

echo "==> ${client} health --target=${target}"
"${client}" health --target="${target}"
echo "==> ${client} info --target=${target}"
"${client}" info --target="${target}"
attend=("${client}" attend --target="${target}" --check --lse --dtype=float16 --batch=2
  --seqlen_q=256 --seqlen_k=256 --heads=8 --kv_heads=2 --head_dim=64 --causal "$@")
echo "==> ${attend[*]}"
"${attend[@]}"
# The same request from a client on this host, its tensors in a registered shared-memory region.
echo "==> ${attend[*]} --shared_memory"
"${attend[@]}" --shared_memory
# A training step through the offline endpoint: the forward's O and LSE go back with dO.
backward=("${client}" backward --target="${target}" --check --send_forward --dtype=float16
  --batch=2 --seqlen_q=128 --seqlen_k=128 --heads=8 --kv_heads=2 --head_dim=64 --causal)
echo "==> ${backward[*]}"
"${backward[@]}"

echo "==> SIGTERM: the server drains and exits"
kill -TERM "${server_pid}"
status=0
wait "${server_pid}" || status=$?
server_pid=
grep -E 'drain' "${work}/server.log" || true
if [[ ${status} -ne 0 ]]; then
  echo "quickstart: the server exited with ${status}" >&2
  cat "${work}/server.log" >&2
  exit 1
fi
echo "quickstart: OK (the server answered, the results matched the reference, it exited 0)"
