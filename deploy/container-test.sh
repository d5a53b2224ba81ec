#!/usr/bin/env bash
# Builds the CPU-only attnserve image from deploy/Dockerfile and checks it for real: the server
# starts as a non-root user, the image's HEALTHCHECK and the gRPC health service answer, an
# attention request computed in the container matches the float64 reference, the metrics
# endpoint is scraped with curl and by a real Prometheus using deploy/prometheus.yml (when the
# server has an exporter), and SIGTERM under load drains and exits 0.
#
# Engine: podman (as shared/notes/machines.md sets it up: runc, host network, a local base
# image), or docker when a Docker engine answers. No registry is needed with podman: when the
# base image is the default localhost/debian:bookworm and missing, it is made with debootstrap
# (root) and imported, once. Everything listens on 127.0.0.1 only; every wait is bounded.
#
# Usage: deploy/container-test.sh [--no-build] [--git-ref=REF]
#   --git-ref=REF  build from the committed tree of REF (git archive) instead of the working
#                  tree, e.g. HEAD while others have half-finished edits in a shared checkout;
#                  the Dockerfile is the working tree's deploy/Dockerfile either way
# Environment:
#   ATTN_IMAGE           tag to build and test (default attnserve:cpu-test)
#   ATTN_BASE_IMAGE      build and runtime base (default localhost/debian:bookworm with podman,
#                        debian:bookworm with docker)
#   ATTN_JOBS            compile jobs inside the build (default 2)
#   ATTN_BUILD_TIMEOUT   seconds the image build may take (default 3600)
# Exit status: 0 when every check passed; the failed check is named otherwise.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build=1
git_ref=""
for arg in "$@"; do
  case "${arg}" in
    --no-build) build=0 ;;
    --git-ref=*) git_ref=${arg#--git-ref=} ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "container-test: unknown argument ${arg}" >&2
      exit 2
      ;;
  esac
done

image=${ATTN_IMAGE:-attnserve:cpu-test}
jobs=${ATTN_JOBS:-2}
build_timeout=${ATTN_BUILD_TIMEOUT:-3600}
name="attnserve-ctest-$$"
t_start=$(date +%s)
timings=()

log() { echo "container-test: $*"; }
fail() {
  echo "container-test: FAIL: $*" >&2
  exit 1
}
now_ms() { echo $(($(date +%s%N) / 1000000)); }
# timed LABEL COMMAND...: runs the command and records how long it took.
timed() {
  local label=$1 t0 rc=0
  shift
  t0=$(now_ms)
  "$@" || rc=$?
  timings+=("$(printf '%-28s %8.1f s' "${label}" "$((($(now_ms) - t0) / 100))e-1")")
  return "${rc}"
}

# ---- the container engine
engine=()
build_flags=()
own_conf=""
if command -v podman >/dev/null 2>&1; then
  engine=(podman)
  # Debian's podman on this kind of machine: runc, and no default ulimits (the sandbox refuses
  # raising them). An existing CONTAINERS_CONF is respected.
  if [[ -z "${CONTAINERS_CONF:-}" ]]; then
    conf=$(mktemp /tmp/attnserve-containers.XXXXXX.conf)
    printf '[containers]\ndefault_ulimits = []\n' >"${conf}"
    export CONTAINERS_CONF=${conf}
    own_conf=${conf}
  fi
  command -v runc >/dev/null 2>&1 && engine+=(--runtime runc)
  # Docker format keeps the HEALTHCHECK (OCI images have none).
  build_flags+=(--format docker)
  base=${ATTN_BASE_IMAGE:-localhost/debian:bookworm}
elif command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; then
  engine=(docker)
  base=${ATTN_BASE_IMAGE:-debian:bookworm}
else
  fail "neither podman nor a running Docker engine"
fi
log "engine: ${engine[*]}, image ${image}, base ${base}"

cleanup() {
  "${engine[@]}" rm -f -t 0 "${name}" >/dev/null 2>&1 || true
  [[ -z "${own_conf}" ]] || rm -f "${own_conf}"
}
trap cleanup EXIT

# ---- the base image, made locally once when it is the default and missing
ensure_base() {
  if "${engine[@]}" image exists "${base}" 2>/dev/null ||
    "${engine[@]}" image inspect "${base}" >/dev/null 2>&1; then
    log "base image ${base} is present"
    return 0
  fi
  if [[ "${engine[0]}" != podman || "${base}" != localhost/debian:bookworm ]]; then
    log "base image ${base} is missing; the build will try to pull it"
    return 0
  fi
  command -v debootstrap >/dev/null 2>&1 || fail "debootstrap is needed to make ${base}"
  [[ ${EUID} -eq 0 ]] || fail "making ${base} with debootstrap needs root"
  local rootfs
  rootfs=$(mktemp -d /tmp/attnserve-rootfs.XXXXXX)
  log "making ${base} with debootstrap in ${rootfs} (a few minutes, once)"
  timeout 1200 debootstrap --variant=minbase bookworm "${rootfs}" >"${rootfs}.log" 2>&1 ||
    fail "debootstrap failed, see ${rootfs}.log"
  tar -C "${rootfs}" -c . | timeout 600 "${engine[@]}" import - "${base}" >/dev/null
  rm -rf "${rootfs}" "${rootfs}.log"
}
timed "base image" ensure_base

# ---- build
context=.
if [[ -n "${git_ref}" ]]; then
  context=$(mktemp -d /tmp/attnserve-context.XXXXXX)
  git archive "${git_ref}" | tar -x -C "${context}"
  cp .dockerignore "${context}/" 2>/dev/null || true
  log "build context: git archive $(git rev-parse --short "${git_ref}") in ${context}"
fi
if [[ ${build} -eq 1 ]]; then
  build_cmd=("${engine[@]}" build "${build_flags[@]}" --network=host
    --build-arg "BUILD_BASE=${base}" --build-arg "RUNTIME_BASE=${base}"
    --build-arg ATTN_CUDA=OFF --build-arg "BUILD_JOBS=${jobs}"
    -t "${image}" -f "${PWD}/deploy/Dockerfile" "${context}")
  log "${build_cmd[*]}"
  timed "image build" timeout "${build_timeout}" "${build_cmd[@]}" || fail "image build"
fi
[[ "${context}" == . ]] || rm -rf "${context}"
size=$("${engine[@]}" image inspect --format '{{.Size}}' "${image}")
log "image ${image}: $((size / 1000000)) MB"

# ---- free loopback ports for gRPC and metrics
read -r grpc_port metrics_port < <(/usr/bin/python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
EOF
)

# --helpfull exits 1 (absl), so read its output before looking into it.
has_metrics=0
server_help=$("${engine[@]}" run --rm --network=none --entrypoint /usr/local/bin/attnserve \
  "${image}" --helpfull 2>&1 || true)
grep -q -- '--metrics_address' <<<"${server_help}" && has_metrics=1
log "server has --metrics_address: $([[ ${has_metrics} -eq 1 ]] && echo yes || echo no)"


in_ctr() { timeout 120 "${engine[@]}" exec "${name}" "$@"; }

# ---- run
log "starting ${name}: gRPC 127.0.0.1:${grpc_port}, metrics 127.0.0.1:${metrics_port}"
"${engine[@]}" run -d --name "${name}" --network=host \
  -e "ATTN_GRPC_PORT=${grpc_port}" -e "ATTN_METRICS_PORT=${metrics_port}" "${image}" \
  "--listen=127.0.0.1:${grpc_port}" "--metrics_address=127.0.0.1:${metrics_port}" \
  --cpu_threads=2 --drain_timeout=15s --max_queue_delay=5ms >/dev/null

wait_serving() {
  local deadline=$(($(date +%s) + 60))
  while (($(date +%s) < deadline)); do
    if in_ctr attnserve_client health --target="127.0.0.1:${grpc_port}" --timeout=2s \
      >/dev/null 2>&1; then
      return 0
    fi
    [[ "$("${engine[@]}" inspect --format '{{.State.Running}}' "${name}")" == true ]] || break
    sleep 0.5
  done
  "${engine[@]}" logs "${name}" | tail -20 >&2
  return 1
}
timed "start to SERVING" wait_serving || fail "the server did not become SERVING within 60 s"

log "user in the container: $(in_ctr id)"
[[ "$(in_ctr id -u)" == 10001 ]] || fail "the server does not run as uid 10001"

log "health (server and service):"
in_ctr attnserve_client health --target="127.0.0.1:${grpc_port}" || fail "health"
in_ctr attnserve_client health --target="127.0.0.1:${grpc_port}" \
  --service=attnserve.v1.AttentionService || fail "health of attnserve.v1.AttentionService"

if [[ "${engine[0]}" == podman ]]; then
  # Runs the image's own HEALTHCHECK command once, as the runtime would.
  hc=$("${engine[@]}" healthcheck run "${name}" 2>&1) && hc_rc=0 || hc_rc=$?
  log "image HEALTHCHECK: rc=${hc_rc} ${hc}"
  [[ ${hc_rc} -eq 0 ]] || fail "the image's HEALTHCHECK"
else
  log "image HEALTHCHECK: $("${engine[@]}" inspect --format '{{json .Config.Healthcheck}}' \
    "${image}")"
fi

log "GetServerInfo:"
in_ctr attnserve_client info --target="127.0.0.1:${grpc_port}" || fail "info"

attend=(attnserve_client attend --target="127.0.0.1:${grpc_port}" --dtype=bfloat16 --batch=3
  --varlen --seqlen_q=300 --seqlen_k=513 --heads=8 --kv_heads=2 --head_dim=64 --causal --lse
  --check)
log "attend in the container, checked against the float64 reference:"
timed "attend --check" in_ctr "${attend[@]}" || fail "attend --check"

host_client=""
for dir in build build-server build-test; do
  [[ -x "${dir}/clients/cli/attnserve_client" ]] && host_client=${dir}/clients/cli/attnserve_client &&
    break
done
if [[ -n "${host_client}" ]]; then
  log "attend from the host (${host_client}), float32 dense:"
  timeout 120 "${host_client}" attend --target="127.0.0.1:${grpc_port}" --dtype=float32 \
    --batch=2 --seqlen_q=177 --seqlen_k=177 --heads=4 --head_dim=128 --check --count=3 ||
    fail "attend from the host"
fi

log "bench in the container (closed loop, 2 s per level):"
timed "bench" in_ctr attnserve_client bench --target="127.0.0.1:${grpc_port}" --dtype=bfloat16 \
  --seqlen_q=128 --seqlen_k=128 --heads=8 --head_dim=64 --concurrency=1,4 --duration=2s ||
  fail "bench"

if [[ ${has_metrics} -eq 1 ]]; then
  scrape=$(curl -sf --max-time 10 "http://127.0.0.1:${metrics_port}/metrics") ||
    fail "GET http://127.0.0.1:${metrics_port}/metrics"
  lines=$(grep -c '^attnserve_' <<<"${scrape}" || true)
  log "metrics: ${lines} attnserve_* samples; a few:"
  grep -E '^attnserve_(build_info|requests_total|tokens_total|flops_total|requests_queued|path_total)' \
    <<<"${scrape}" | head -12 || true
  [[ ${lines} -gt 0 ]] || fail "no attnserve_* sample on /metrics"
else
  log "metrics: SKIPPED (the server in this image has no --metrics_address yet)"
fi

# ---- a real Prometheus scraping the container with deploy/prometheus.yml
prometheus_check() {
  local dir port pid up=0 value deadline
  dir=$(mktemp -d /tmp/attnserve-prometheus.XXXXXX)
  sed "s/attnserve:9464/127.0.0.1:${metrics_port}/" deploy/prometheus.yml >"${dir}/prometheus.yml"
  port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  prometheus --config.file="${dir}/prometheus.yml" --storage.tsdb.path="${dir}/data" \
    --web.listen-address="127.0.0.1:${port}" >"${dir}/log" 2>&1 &
  pid=$!
  deadline=$(($(date +%s) + 60))
  while (($(date +%s) < deadline)); do
    value=$(curl -sf --max-time 5 "http://127.0.0.1:${port}/api/v1/query" \
      --data-urlencode 'query=sum(attnserve_requests_total{job="attnserve"})' |
      /usr/bin/python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")' \
      2>/dev/null || true)
    if [[ -n "${value}" ]]; then
      up=1
      break
    fi
    sleep 1
  done
  kill "${pid}" 2>/dev/null || true
  wait "${pid}" 2>/dev/null || true
  if [[ ${up} -eq 1 ]]; then
    log "Prometheus $(prometheus --version 2>&1 | head -n1 | awk '{print $3}') with" \
      "deploy/prometheus.yml scraped the container: sum(attnserve_requests_total) = ${value}"
    rm -rf "${dir}"
    return 0
  fi
  tail -n 5 "${dir}/log" >&2
  return 1
}
if [[ ${has_metrics} -eq 1 ]] && command -v prometheus >/dev/null 2>&1; then
  timed "Prometheus scrape" prometheus_check || fail "Prometheus did not scrape the container"
else
  log "Prometheus scrape: SKIPPED (no exporter in the image or no prometheus on PATH)"
fi

# ---- SIGTERM under load: the drain must finish the accepted calls and exit 0
log "SIGTERM while a client sends requests:"
in_ctr attnserve_client attend --target="127.0.0.1:${grpc_port}" --dtype=bfloat16 --batch=4 \
  --seqlen_q=512 --seqlen_k=512 --heads=8 --head_dim=64 --count=40 >/tmp/${name}-load.log 2>&1 &
load_pid=$!
sleep 2
t_term=$(date +%s%N)
"${engine[@]}" kill --signal TERM "${name}" >/dev/null
exit_code=$(timeout 60 "${engine[@]}" wait "${name}") || fail "the server did not exit within 60 s"
drain_ms=$((($(date +%s%N) - t_term) / 1000000))
wait "${load_pid}" 2>/dev/null && load_rc=0 || load_rc=$?
load_ok=$(grep -c 'engine cpu_tiled' "/tmp/${name}-load.log" || true)
log "load client: exit ${load_rc}, ${load_ok} of 40 requests answered before the drain; the" \
  "rest refused (expected after SIGTERM):"
grep -v 'engine cpu_tiled' "/tmp/${name}-load.log" | head -n 3 || true
rm -f "/tmp/${name}-load.log"
log "server log, last lines:"
"${engine[@]}" logs "${name}" 2>&1 | tail -n 5
log "exit code ${exit_code}, ${drain_ms} ms from SIGTERM to exit"
[[ "${exit_code}" == 0 ]] || fail "exit code ${exit_code} after SIGTERM"
"${engine[@]}" logs "${name}" 2>&1 | grep -q 'drained:' || fail "no 'drained:' line in the log"

echo
echo "container-test: timings"
printf '  %s\n' "${timings[@]}"
printf '  %-28s %6d   s\n' "whole run" $(($(date +%s) - t_start))
echo "container-test: OK"
