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
#   DEVICES_AB=0:0,1 bash bench/server/session_bench.sh   # one GPU, then two, in one call
#
# Knobs (environment): SERVER, CLIENT (the binaries), OUT (default /tmp/session-bench),
# GRID ("sessions:context ..." default "8:4096 64:4096 16:16384"), LEVELS (client concurrency per
# grid point, default "1 8 32"), SHAPE (client shape flags, default 32 query / 8 KV heads, d 128,
# bf16), DURATION (per level, default 3s), STATELESS (1: also the stateless steps, default 1),
# SERVER_ARGS (extra server flags), CHECK (1: --check each session's first step, default 1),
# DEVICES_AB (device lists separated by ':', e.g. "0:0,1"; default empty: one server as
# SERVER_ARGS says). With DEVICES_AB the whole grid runs once per list, each on a fresh server
# started with --devices=LIST, one after the other; the JSON lines get a "devices" field, the
# table a devices column, and for every (mode, sessions, context, clients) a scaling line:
# steps/s on the last list over steps/s on the first. Each server's /metrics is read after its
# run, and the session steps each device ran are printed under the table: the scaling factor
# means what it says only when every device of the last list ran a fair share of them.
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
devices_ab=${DEVICES_AB:-}
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

start_server() {  # start_server LOG [SERVER FLAGS...]: sets server_pid and target
  local log=$1
  shift
  rm -f "$work/port" "$work/metrics_port"
  # shellcheck disable=SC2086
  "$server" --listen=127.0.0.1:0 --port_file="$work/port" "$@" ${SERVER_ARGS:-} >"$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 300); do
    [[ -s $work/port ]] && break
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.1
  done
  [[ -s $work/port ]] || { echo "session_bench: the server did not start" >&2; cat "$log" >&2; exit 1; }
  target=127.0.0.1:$(cat "$work/port")
}
stop_server() {
  kill -TERM "$server_pid" 2>/dev/null
  wait "$server_pid"
  server_pid=
}

status=0
run_grid() {  # run_grid JSONL: the grid against $target, one JSON line per level
  local point sessions context list extra
  for point in $grid; do
    sessions=${point%%:*}
    context=${point##*:}
    list=$(echo "$levels" | tr ' ' ',')
    extra=
    [[ $check == 1 ]] && extra=--check
    # shellcheck disable=SC2086
    timeout 600 "$client" bench --target="$target" --sessions="$sessions" --context="$context" \
      --concurrency="$list" --duration="$duration" --json $shape $extra >>"$1" || status=1
    if [[ $stateless == 1 ]]; then
      # shellcheck disable=SC2086
      timeout 600 "$client" bench --target="$target" --sessions="$sessions" --context="$context" \
        --concurrency="$(echo "$levels" | awk '{print $NF}')" --duration="$duration" --json \
        --stateless $shape >>"$1" || status=1
    fi
  done
}

if [[ -z $devices_ab ]]; then
  start_server "$out/server.log" --metrics_address=
  run_grid "$jsonl"
  stop_server
else
  IFS=: read -r -a device_sets <<<"$devices_ab"
  for dset in "${device_sets[@]}"; do
    tag=${dset//,/_}
    start_server "$out/server-devices-$tag.log" --devices="$dset" \
      --metrics_address=127.0.0.1:0 --metrics_port_file="$work/metrics_port"
    : >"$out/session-bench-devices-$tag.jsonl"
    run_grid "$out/session-bench-devices-$tag.jsonl"
    /usr/bin/python3 - "http://127.0.0.1:$(cat "$work/metrics_port")/metrics" \
      >"$out/metrics-devices-$tag.txt" <<'PY' || status=1
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
PY
    stop_server
  done
fi

/usr/bin/python3 - "$jsonl" "$out" "$devices_ab" <<'PY'
import json, re, sys
jsonl, out, devices_ab = sys.argv[1], sys.argv[2], sys.argv[3]
sets = devices_ab.split(":") if devices_ab else []
if sets:  # one file per device list: tag each row, gather them in session-bench.jsonl
    rows = []
    for s in sets:
        for line in open(f"{out}/session-bench-devices-{s.replace(',', '_')}.jsonl"):
            if line.strip():
                rows.append(dict(json.loads(line), devices=s))
    with open(jsonl, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
else:
    rows = [json.loads(l) for l in open(jsonl) if l.strip()]
dev = f"{'devices':<9}" if sets else ""
print(f"{dev}{'mode':<10}{'sessions':>9}{'context':>9}{'mean':>7}{'clients':>8}{'steps/s':>11}"
      f"{'KV GB/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'ingest GB/s':>12}{'errors':>7}")
for r in rows:
    dev = f"{r['devices']:<9}" if sets else ""
    print(f"{dev}{r['mode']:<10}{r['sessions']:>9}{r['context']:>9}{r.get('mean_context', 0):>7.0f}"
          f"{r['clients']:>8}"
          f"{r['steps_per_s']:>11.1f}{r['kv_read_gb_per_s']:>9.2f}{r['p50_ms']:>9.3f}"
          f"{r['p99_ms']:>9.3f}{r['ingest_gb_per_s']:>12.2f}{r['errors']:>7}")
if len(sets) >= 2:
    # The session steps each device ran, from each server's /metrics after its run.
    for s in sets:
        steps = {}
        try:
            for line in open(f"{out}/metrics-devices-{s.replace(',', '_')}.txt"):
                m = re.match(r'attnserve_session_steps_total\{device="([^"]+)"\} (\S+)', line)
                if m:
                    steps[m.group(1)] = float(m.group(2))
        except OSError:
            pass
        total = sum(steps.values())
        share = ", ".join(f"{d} {n:.0f} ({100 * n / total:.0f}%)" for d, n in sorted(steps.items())) \
            if total else "none counted"
        print(f"devices {s}: session steps per device: {share}")
        listed = len(s.split(","))
        if listed > 1 and (len(steps) < listed or min(steps.values()) < 0.25 * total / listed):
            print(f"devices {s}: WARNING: the session steps did not spread over the {listed} "
                  f"devices; the scaling lines below do not measure them all")
    first, last = sets[0], sets[-1]
    key = lambda r: (r["mode"], r["sessions"], r["context"], r["clients"])
    base = {key(r): r for r in rows if r["devices"] == first}
    for r in rows:
        if r["devices"] != last or key(r) not in base:
            continue
        b = base[key(r)]
        factor = r["steps_per_s"] / b["steps_per_s"] if b["steps_per_s"] > 0 else float("nan")
        print(f"scaling {r['mode']} {r['sessions']}x{r['context']} {r['clients']} clients: "
              f"devices {last} {r['steps_per_s']:.1f} steps/s / devices {first} "
              f"{b['steps_per_s']:.1f} steps/s = {factor:.2f}x")
PY
exit $status
