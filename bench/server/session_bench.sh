#!/usr/bin/env bash
# End-to-end benchmark of KV sessions over gRPC: starts `attnserve` on a loopback ephemeral port
# and drives it with `attnserve_client bench --sessions` (decode steps: one query token, its own
# K/V appended, causal) and, in the same run, `--stateless` (the same steps as plain Attend calls
# carrying the whole K/V each time), for each (sessions, context) of the grid. One JSON line per
# level (steps/s, KV bytes read/s, p50/p90/p99, the ingest GB/s of the AppendKV calls that built
# the sessions, the mean context a step attended over: each step appends its own row, so the
# sessions grow from level to level) goes to $OUT/session-bench.jsonl, and a table is printed last.
#
#   bash bench/server/session_bench.sh      # binaries on PATH (a gpu-bundle) or in build/
#
# Knobs (environment): SERVER, CLIENT (the binaries), OUT (default /tmp/session-bench),
# GRID ("sessions:context ..." default "8:4096 64:4096 16:16384"), LEVELS (client concurrency per
# grid point, default "1 8 32"), SHAPE (client shape flags, default 32 query / 8 KV heads, d 128,
# bf16), DURATION (per level, default 3s), STATELESS (1: also the stateless steps, default 1),
# SERVER_ARGS (extra server flags), CHECK (1: --check each session's first step, default 1).
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
pick() { command -v "$1" 2>/dev/null || echo "$root/build/$2/$1"; }
server=${SERVER:-$(pick attnserve server)}
client=${CLIENT:-$(pick attnserve_client clients/cli)}
out=${OUT:-/tmp/session-bench}
grid=${GRID:-8:4096 64:4096 16:16384}
levels=${LEVELS:-1 8 32}
shape=${SHAPE:---heads=32 --kv_heads=8 --head_dim=128 --dtype=bf16}
duration=${DURATION:-3s}
stateless=${STATELESS:-1}
check=${CHECK:-1}
mkdir -p "$out"
jsonl="$out/session-bench.jsonl"
: >"$jsonl"
work=$(mktemp -d)
server_pid=
cleanup() {
  [[ -n $server_pid ]] && kill -KILL "$server_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

"$server" --listen=127.0.0.1:0 --port_file="$work/port" --metrics_address= ${SERVER_ARGS:-} \
  >"$out/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 300); do
  [[ -s $work/port ]] && break
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.1
done
[[ -s $work/port ]] || { echo "session_bench: the server did not start" >&2; cat "$out/server.log" >&2; exit 1; }
target=127.0.0.1:$(cat "$work/port")

status=0
for point in $grid; do
  sessions=${point%%:*}
  context=${point##*:}
  list=$(echo "$levels" | tr ' ' ',')
  extra=
  [[ $check == 1 ]] && extra=--check
  # shellcheck disable=SC2086
  timeout 600 "$client" bench --target="$target" --sessions="$sessions" --context="$context" \
    --concurrency="$list" --duration="$duration" --json $shape $extra >>"$jsonl" || status=1
  if [[ $stateless == 1 ]]; then
    # shellcheck disable=SC2086
    timeout 600 "$client" bench --target="$target" --sessions="$sessions" --context="$context" \
      --concurrency="$(echo "$levels" | awk '{print $NF}')" --duration="$duration" --json \
      --stateless $shape >>"$jsonl" || status=1
  fi
done
kill -TERM "$server_pid" 2>/dev/null
wait "$server_pid"
server_pid=

/usr/bin/python3 - "$jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'mode':<10}{'sessions':>9}{'context':>9}{'mean':>7}{'clients':>8}{'steps/s':>11}"
      f"{'KV GB/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'ingest GB/s':>12}{'errors':>7}")
for r in rows:
    print(f"{r['mode']:<10}{r['sessions']:>9}{r['context']:>9}{r.get('mean_context', 0):>7.0f}"
          f"{r['clients']:>8}"
          f"{r['steps_per_s']:>11.1f}{r['kv_read_gb_per_s']:>9.2f}{r['p50_ms']:>9.3f}"
          f"{r['p99_ms']:>9.3f}{r['ingest_gb_per_s']:>12.2f}{r['errors']:>7}")
PY
exit $status
