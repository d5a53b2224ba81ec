#!/usr/bin/env bash
# Same-call A/B of server binaries on the small set (by default shared-memory tensors, a unix
# socket, AttendStream; docs/server-performance.md): the servers take turns, REPS rounds, each
# turn a server_bench.sh run with batching on and off at the LEVELS. Instances of the GPU
# machine differ by 10-30%, so only rows from one call are compared.
#
#   source build/server-bundle/env.sh
#   OUT=$OUT SERVERS="prev=/path/attnserve_prev,new=attnserve" bash bench/server/ab_session.sh
#
# A SERVERS entry may name the client too: name=server+client (default $CLIENT, else
# attnserve_client on PATH).
#
# Environment: OUT (required), SERVERS (name=binary,... required), REPS (default 2), LEVELS
# (default 1,64,128), DURATION (default 3s), SERVER_ARGS (for every server), RPCS (default
# stream; unary), LISTEN (default unix; tcp), CLIENT_ARGS (default --shared_memory; empty:
# tensors inline), VARIANTS (extra turns after the rounds: name=binary:flag[:flag...],... e.g.
# "t4=attnserve:--stream_threads=4").
# Writes $OUT/ab-<name>-<round>/ (server_bench.sh output) and prints one table last.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:?set OUT}
mkdir -p "$out"
reps=${REPS:-2}
levels=${LEVELS:-1,64,128}
IFS=, read -r -a servers <<<"${SERVERS:?set SERVERS=name=binary,...}"

turn() {  # turn NAME SERVER[+CLIENT] SERVER_ARGS
  local dir=$out/ab-$1 server=${2%%+*} client=${CLIENT:-$(command -v attnserve_client)}
  [[ $2 == *+* ]] && client=${2#*+}
  env OUT="$dir" SERVER="$server" CLIENT="$client" SERVER_ARGS="$3" DURATION="${DURATION:-3s}" LEVEL_TIMEOUT=60 \
    SETS=small SMALL_LEVELS="$levels" RPCS="${RPCS:-stream}" LISTEN="${LISTEN:-unix}" \
    CLIENT_ARGS="${CLIENT_ARGS---shared_memory}" \
    timeout 300 bash "$here/server_bench.sh" >"$dir.log" 2>&1
  echo "turn $1: exit $?"
}

for rep in $(seq "$reps"); do
  for entry in "${servers[@]}"; do
    turn "${entry%%=*}-$rep" "${entry#*=}" "${SERVER_ARGS:-}"
  done
done
if [[ -n ${VARIANTS:-} ]]; then
  IFS=, read -r -a variants <<<"$VARIANTS"
  for v in "${variants[@]}"; do
    name=${v%%=*}
    spec=${v#*=}
    binary=${spec%%:*}
    flags=${spec#"$binary"}
    turn "$name" "$binary" "${SERVER_ARGS:-} ${flags//:/ }"
  done
fi

python3 - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
print("| turn | conc | on req/s | off req/s | on/off | on p50 overhead us | off p50 overhead us | on batch |")
print("|---|---|---|---|---|---|---|---|")
for d in sorted(glob.glob(os.path.join(out, "ab-*")), key=os.path.getmtime):
    f = os.path.join(d, "server-bench.jsonl")
    if not os.path.isfile(f):
        continue
    rows = [json.loads(l) for l in open(f) if l.strip()]
    by = {(r["batching"], r["level"]): r for r in rows}
    for level in sorted({r["level"] for r in rows}):
        on, off = by.get(("on", level)), by.get(("off", level))
        rate = lambda r: r["requests_per_s"] if r else float("nan")
        ov = lambda r: 1000 * r["p50_overhead_ms"] if r else float("nan")
        print(f"| {os.path.basename(d)[3:]} | {level} | {rate(on):.0f} | {rate(off):.0f} | "
              f"{rate(on) / rate(off):.2f} | {ov(on):.0f} | {ov(off):.0f} | "
              f"{on['mean_batch_requests'] if on else float('nan'):.1f} |")
EOF
