#!/usr/bin/env bash
# End-to-end benchmark of the attnserve server: starts `attnserve` on a loopback ephemeral port,
# drives it with `attnserve_client bench` (closed loop) for two request shapes, with dynamic
# batching on (the server's defaults) and off (--max_batch_requests=1: one request per engine
# call), over unary Attend calls and over pipelined AttendStream calls, and writes one JSON line
# per (shape, batching, rpc, concurrency) plus a printed table. Each level is its own client run,
# bracketed by per-thread CPU snapshots of the server (thread_cpu.py); the client reports its
# own CPU time, so each row says how many cores server and client kept busy.
#
#   bash bench/server/server_bench.sh            # build-serverbench/ binaries, results in $OUT
#
# docs/server-performance.md gives the build commands and, for each published table, the
# variables that reproduced it.
#
# Shapes (dense, self-attention, batch 1 per request, not causal):
#   small: N = 64,   8 heads,  d = 64,  float16   concurrency 1, 4, 16, 64
#   tiny:  N = 1,    8 heads,  d = 64,  float16   concurrency 1, 64 (not in the default SETS: the
#          RPC path with 1 KiB of payload, the floor under the small set's figures)
#   large: N = 4096, 32 heads, d = 128, bfloat16  concurrency 1, 2, 4, 8
#
# Knobs (environment):
#   SERVER, CLIENT   the binaries (default: on PATH, else build-serverbench/...)
#   OUT              results folder (default /tmp/server-bench): server-bench.jsonl, table.txt,
#                    one server log per run
#   DURATION         closed-loop time per concurrency level (default 3s)
#   SETS             small,large,tiny (default small,large)   MODES  on,off (default both)
#   RPCS             unary,stream (default both)
#   STREAMS          AttendStream calls per level for rpc=stream (default 8)
#   CHANNELS         gRPC channels (connections) of the client (default STREAMS: one per
#                    stream, so each client thread polls only its own socket; sharing
#                    connections costs the client cores and requests, see
#                    docs/server-performance.md)
#   SMALL_LEVELS, LARGE_LEVELS   concurrency lists (defaults above)
#   LARGE_N, LARGE_HEADS         override the large shape (the CPU engine needs seconds per
#                                N = 4096 request)
#   ENGINE           --engine of the server (default auto)
#   METRICS_ADDRESS  --metrics_address (default empty: the Prometheus exporter off; the
#                    in-process counters still run)
#   SERVER_ARGS      extra server flags for every run; ON_ARGS / OFF_ARGS for one mode
#   CLIENT_ARGS      extra flags for every client run (e.g. --grpc_arg=...)
#   LEVEL_TIMEOUT    hard limit in seconds on one client run (default 120)
#   LISTEN           tcp (default: 127.0.0.1, an ephemeral port) or unix (a socket in $OUT)
#   (CLIENT_ARGS=--shared_memory sends the tensors through a registered shared-memory region)
#
# Every run is bounded (`timeout` on the client, SIGTERM then SIGKILL on the server), listens on
# 127.0.0.1 (or a unix socket) only, and the server is killed on exit whatever happens.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
pick() { command -v "$1" 2>/dev/null || echo "$root/build-serverbench/$2/$1"; }
server=${SERVER:-$(pick attnserve server)}
client=${CLIENT:-$(pick attnserve_client clients/cli)}
out=${OUT:-/tmp/server-bench}
duration=${DURATION:-3s}
sets=${SETS:-small,large}
modes=${MODES:-on,off}
rpcs=${RPCS:-unary,stream}
streams=${STREAMS:-8}
channels=${CHANNELS:-$streams}
level_timeout=${LEVEL_TIMEOUT:-120}
engine=${ENGINE:-auto}
metrics_address=${METRICS_ADDRESS:-}
listen=${LISTEN:-tcp}
mkdir -p "$out"
jsonl="$out/server-bench.jsonl"
: >"$jsonl"

for b in "$server" "$client"; do
  [[ -x $b ]] || { echo "server_bench: no executable $b (set SERVER / CLIENT)" >&2; exit 2; }
done

server_pid=""
stop_server() {
  [[ -n $server_pid ]] || return 0
  kill -TERM "$server_pid" 2>/dev/null
  for _ in $(seq 50); do
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.2
  done
  kill -KILL "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  server_pid=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# start_server LOG FLAGS... -> sets $port, or returns 1
start_server() {
  local log=$1
  shift
  local port_file="$out/port.$$"
  rm -f "$port_file"
  local address=127.0.0.1:0
  [[ $listen == unix ]] && address="unix:$out/attnserve.sock" && rm -f "$out/attnserve.sock"
  "$server" --listen="$address" --port_file="$port_file" --engine="$engine" --drain_timeout=5s \
    --metrics_address="$metrics_address" "$@" >"$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 150); do
    [[ -s $port_file ]] && break
    kill -0 "$server_pid" 2>/dev/null || { echo "server_bench: server exited, see $log" >&2; return 1; }
    sleep 0.2
  done
  port=$(cat "$port_file" 2>/dev/null)
  rm -f "$port_file"
  [[ -n $port ]] || { echo "server_bench: no port after 30 s, see $log" >&2; return 1; }
}

echo "== $(date -u +%FT%TZ) $(hostname) $(nproc) cores; server $server"
command -v nvidia-smi >/dev/null &&
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

IFS=, read -r -a set_list <<<"$sets"
IFS=, read -r -a mode_list <<<"$modes"
IFS=, read -r -a rpc_list <<<"$rpcs"
for set in "${set_list[@]}"; do
  case $set in
    small) shape=(--dtype=float16 --batch=1 --seqlen_q=64 --seqlen_k=64 --heads=8 --head_dim=64)
           levels=${SMALL_LEVELS:-1,4,16,64}; pool=8 ;;
    tiny) shape=(--dtype=float16 --batch=1 --seqlen_q=1 --seqlen_k=1 --heads=8 --head_dim=64)
          levels=${TINY_LEVELS:-1,64}; pool=8 ;;
    large) n=${LARGE_N:-4096}
           shape=(--dtype=bfloat16 --batch=1 --seqlen_q="$n" --seqlen_k="$n"
                  --heads="${LARGE_HEADS:-32}" --head_dim=128)
           levels=${LARGE_LEVELS:-1,2,4,8}; pool=2 ;;
    *) echo "server_bench: unknown set '$set'" >&2; exit 2 ;;
  esac
  for mode in "${mode_list[@]}"; do
    case $mode in
      on) read -r -a mode_args <<<"${ON_ARGS:-}" ;;
      off) read -r -a mode_args <<<"--max_batch_requests=1 ${OFF_ARGS:-}" ;;
      *) echo "server_bench: unknown mode '$mode'" >&2; exit 2 ;;
    esac
    read -r -a common_args <<<"${SERVER_ARGS:-}"
    server_args=("${common_args[@]}" "${mode_args[@]}")
    log="$out/server-$set-$mode.log"
    start_server "$log" "${server_args[@]}" || exit 1
    target="127.0.0.1:$port"
    [[ $listen == unix ]] && target="unix:$out/attnserve.sock"
    info=$("$client" info --target="$target" --json --timeout=10s 2>&1)
    echo "-- $set, batching $mode: server ${server_args[*]:-(defaults)} on $target"
    IFS=, read -r -a level_list <<<"$levels"
    read -r -a client_args <<<"${CLIENT_ARGS:-}"
    for rpc in "${rpc_list[@]}"; do
      for level in "${level_list[@]}"; do
        tag="$set-$mode-$rpc-$level"
        bench_json="$out/bench-$tag.json"
        python3 "$here/thread_cpu.py" snapshot "$server_pid" >"$out/cpu-before.json" 2>/dev/null
        timeout -k 5 "$level_timeout" "$client" bench --target="$target" --json --rpc="$rpc" \
          --streams="$streams" --channels="$channels" --concurrency="$level" \
          --duration="$duration" --pool="$pool" --timeout=60s "${shape[@]}" "${client_args[@]}" \
          >"$bench_json" 2>"$out/bench-$tag.err"
        rc=$?
        python3 "$here/thread_cpu.py" snapshot "$server_pid" >"$out/cpu-after.json" 2>/dev/null
        python3 "$here/thread_cpu.py" diff "$out/cpu-before.json" "$out/cpu-after.json" \
          >"$out/cpu-$tag.json" 2>/dev/null || echo '{}' >"$out/cpu-$tag.json"
        [[ $rc -eq 0 ]] || echo "server_bench: client exit $rc ($tag), see $out/bench-$tag.err" >&2
        python3 - "$bench_json" "$set" "$mode" "${server_args[*]}" "$info" "${shape[*]}" \
          "$out/cpu-$tag.json" "${client_args[*]}" "$listen" >>"$jsonl" <<'PY'
import json, sys
path, set_, mode, args, info, shape, cpu, client_args, listen = sys.argv[1:10]
try:
    rows = json.load(open(path))
except Exception as e:
    print(json.dumps({"set": set_, "mode": mode, "error": f"no bench JSON: {e}"}))
    sys.exit(0)
try:
    info = json.loads(info)
except Exception:
    info = {}
try:
    cpu = json.load(open(cpu))
except Exception:
    cpu = {}
flags = dict(a[2:].split("=", 1) for a in shape.split())
n, h, d = int(flags["seqlen_q"]), int(flags["heads"]), int(flags["head_dim"])
es = 2 if flags["dtype"] in ("float16", "bfloat16") else 4
for r in rows:
    r.update({
        "set": set_, "batching": mode, "server_args": args, "dtype": flags["dtype"],
        "seqlen": n, "heads": h, "head_dim": d,
        "request_bytes": 3 * n * h * d * es, "response_bytes": n * h * d * es,
        "gpu": info.get("gpu", False), "engines": info.get("engines", []),
        "server_cpu_s": cpu.get("total_s"), "server_threads_cpu_s": cpu.get("threads", {}),
        "client_args": client_args, "listen": listen,
    })
    print(json.dumps(r))
PY
      done
    done
    stop_server
  done
done

python3 - "$jsonl" <<'PY' | tee "$out/table.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "p50_compute_ms" in r]
print("| set | batching | rpc | conc | req/s | p50 ms | p99 ms | batch | kernel p50 ms | "
      "compute p50 ms | queue p50 ms | overhead p50 ms | outside p50 ms | server CPU | "
      "client CPU | errors |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    err = sum(r["errors"].values())
    secs = r["seconds"] or 1
    scpu = r.get("server_cpu_s")
    scpu = f"{scpu / secs:.1f}" if scpu is not None else "-"
    print(f"| {r['set']} | {r['batching']} | {r.get('rpc', 'unary')} | {r['level']:g} | "
          f"{r['requests_per_s']:.1f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
          f"{r['mean_batch_requests']:.2f} | {r.get('p50_kernel_ms', 0):.4f} | "
          f"{r['p50_compute_ms']:.3f} | {r['p50_queue_ms']:.3f} | {r['p50_overhead_ms']:.3f} | "
          f"{r['p50_outside_ms']:.3f} | {scpu} | {r.get('client_cpu_s', 0) / secs:.1f} | {err} |")
print("\n(server / client CPU: cores busy on average over the level, from /proc and getrusage)")
for r in rows:
    if r["errors"]:
        print(f"errors, {r['set']} {r['batching']} {r.get('rpc', 'unary')} {r['level']:g}: "
              f"{r['errors']} first: {r.get('first_errors', {})}")
by = {(r["set"], r["batching"], r.get("rpc", "unary"), r["level"]): r for r in rows}
print()
for rpc in ("unary", "stream"):
    small = sorted({r["level"] for r in rows if r["set"] == "small" and r.get("rpc", "unary") == rpc})
    if not small:
        continue
    top = small[-1]
    on, off = by.get(("small", "on", rpc, top)), by.get(("small", "off", rpc, top))
    if on and off and off["requests_per_s"] > 0:
        print(f"small, {rpc}, concurrency {top:g}: batching on/off throughput = "
              f"{on['requests_per_s'] / off['requests_per_s']:.2f}x (target >= 3x)")
    for mode in ("on", "off"):
        r = by.get(("small", mode, rpc, 1))
        if r:
            print(f"small, {rpc}, batching {mode}, concurrency 1: p50 server overhead "
                  f"{r['p50_overhead_ms'] * 1e3:.0f} us (end-to-end - kernel_us; target < 200 us)")
for r in rows:
    if r["set"] != "large":
        continue
    mb = (r["request_bytes"] + r["response_bytes"]) / 2**20
    gbs = (r["request_bytes"] + r["response_bytes"]) * r["requests_per_s"] / 1e9
    print(f"large, batching {r['batching']}, {r.get('rpc', 'unary')}, conc {r['level']:g}: "
          f"{mb:.0f} MiB moved per request, {gbs:.2f} GB/s of payload, kernel "
          f"{r.get('p50_kernel_ms', 0):.2f} ms, compute {r['p50_compute_ms']:.1f} of "
          f"{r['p50_ms']:.1f} ms end-to-end (p50)")
PY
echo "results: $jsonl"
