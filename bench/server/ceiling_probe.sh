#!/usr/bin/env bash
# Where the batched small-request throughput stops growing (docs/server-performance.md): one
# server (defaults, unix socket, shared memory on), small requests with tensors in shared memory
# over AttendStream at 64 in flight, driven by one client with more streams and connections, and
# by several client processes at once (is the load generator the ceiling?). Each probe is 3 s;
# the server's per-thread CPU is taken around each, and when `perf` is on PATH one probe is also
# profiled (server and client), so the report says which code the cores run.
#
#   source build/server-bundle/env.sh; OUT=$OUT bash bench/server/ceiling_probe.sh
#
# Environment: OUT (required), SERVER (the server binary, default attnserve on PATH), SERVER_ARGS
# (extra server flags), DURATION (default 3s), PROBES (which probes, default all), PERF (0: no
# profile).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:?set OUT}
duration=${DURATION:-3s}
work=$(mktemp -d)
sock=$work/attnserve.sock
read -r -a server_args <<<"${SERVER_ARGS:-}"
shape=(--dtype=float16 --batch=1 --seqlen_q=64 --seqlen_k=64 --heads=8 --head_dim=64)

"${SERVER:-attnserve}" --listen="unix:$sock" --metrics_address= "${server_args[@]}" >"$out/probe-server.log" 2>&1 &
server=$!
trap 'kill -KILL $server 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done

bench() {  # bench CONCURRENCY STREAMS CHANNELS > json
  attnserve_client bench --target="unix:$sock" --json --rpc=stream --shared_memory \
    --concurrency="$1" --streams="$2" --channels="$3" --duration="$duration" --pool=16 \
    --timeout=60s "${shape[@]}"
}
rate() { python3 -c 'import json,sys; print(sum(json.load(open(f))[0]["requests_per_s"] for f in sys.argv[1:]))' "$@"; }
cpu_around() {  # cpu_around NAME COMMAND...: per-thread CPU of the server while COMMAND runs
  local name=$1
  shift
  python3 "$here/thread_cpu.py" snapshot $server >"$work/before.json"
  "$@"
  python3 "$here/thread_cpu.py" snapshot $server >"$work/after.json"
  python3 "$here/thread_cpu.py" diff "$work/before.json" "$work/after.json" >"$out/probe-cpu-$name.json"
}

bench 64 8 4 >/dev/null 2>&1  # warm: regions registered, pools grown, pages touched
printf '| probe | clients x (in flight, streams, connections) | req/s | server cores | client cores |\n|---|---|---|---|---|\n' >"$out/probe.md"
probe() {  # probe NAME PROCESSES CONCURRENCY STREAMS CHANNELS
  local name=$1 procs=$2
  [[ ,${PROBES:-$name}, == *,$name,* ]] || return 0
  run() {
    local pids=()
    for i in $(seq "$procs"); do
      bench "$3" "$4" "$5" >"$work/$name-$i.json" 2>"$out/probe-$name-$i.err" &
      pids+=($!)
    done
    wait "${pids[@]}"
  }
  cpu_around "$name" run "$@"
  local files=("$work/$name"-*.json)
  cp "${files[@]}" "$out/"
  local client_s
  client_s=$(python3 -c 'import json,sys; print(round(sum(json.load(open(f))[0]["client_cpu_s"] for f in sys.argv[1:]),2))' "${files[@]}")
  local server_s
  server_s=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["total_s"])' "$out/probe-cpu-$name.json")
  local secs=${duration%s}
  printf '| %s | %s x (%s, %s, %s) | %.0f | %.1f | %.1f |\n' "$name" "$procs" "$3" "$4" "$5" \
    "$(rate "${files[@]}")" "$(python3 -c "print($server_s/$secs)")" "$(python3 -c "print($client_s/$secs)")" >>"$out/probe.md"
}
probe base 1 64 8 4
probe streams16 1 64 16 8
probe streams32 1 64 32 8
probe procs2 2 32 8 4
probe procs4 4 16 4 4
probe base128 1 128 16 8
probe procs2x64 2 64 8 4

if [[ ${PERF:-1} != 0 ]] && command -v perf >/dev/null; then
  perf record -F 499 -p $server -o "$work/server.perf" -- sleep 2 >/dev/null 2>&1 &
  perfpid=$!
  bench 64 8 4 >"$out/perf-bench.json" 2>/dev/null &
  benchpid=$!
  sleep 0.5
  client=$(pgrep -n attnserve_clien)
  perf record -F 499 -p "$client" -o "$work/client.perf" -- sleep 1.5 >/dev/null 2>&1
  wait $perfpid $benchpid
  for side in server client; do
    perf report -i "$work/$side.perf" --no-children --sort comm,dso --stdio -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -40 >"$out/perf-$side-dso.txt"
    perf report -i "$work/$side.perf" --no-children --sort comm,sym --stdio -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -80 >"$out/perf-$side-sym.txt"
  done
fi
cat "$out/probe.md"
