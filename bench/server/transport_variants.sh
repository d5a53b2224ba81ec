#!/usr/bin/env bash
# Same-call A/B of how the programs meet the transport, on the small set (ab_session.sh): the
# shipped setup (def), gRPC's poll() engine for both programs instead of epoll1 (poll), the
# server and the client on separate cores (pin: the nearest thing here to a load generator on
# another host), and both (pinpoll). One server binary; the variants are wrapper scripts.
#
#   source build/server-bundle/env.sh
#   OUT=$OUT bash bench/server/transport_variants.sh
#
# Environment: OUT (required), REPS (default 2), LEVELS (default 1,64,128), SERVER_CORES (cores
# 0..SERVER_CORES-1 for the server, the rest for the client; default three quarters).
# Writes $OUT/ab-<variant>-<round>/, $OUT/wrappers/, $OUT/ab.txt and prints its table.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:?set OUT}
mkdir -p "$out/wrappers"
server=$(command -v attnserve) || { echo "attnserve not on PATH" >&2; exit 2; }
client=$(command -v attnserve_client) || { echo "attnserve_client not on PATH" >&2; exit 2; }
cores=$(nproc)
server_cores=${SERVER_CORES:-$((cores * 3 / 4))}
(( server_cores >= 1 && server_cores < cores )) || { echo "SERVER_CORES out of range" >&2; exit 2; }

wrapper() {  # wrapper NAME ENV COMMAND: a script that runs COMMAND with ENV and the arguments
  printf '#!/usr/bin/env bash\n%s exec %s "$@"\n' "$2" "$3" >"$out/wrappers/$1"
  chmod +x "$out/wrappers/$1"
}
server_pin="taskset -c 0-$((server_cores - 1))"
client_pin="taskset -c $server_cores-$((cores - 1))"
poll=GRPC_POLL_STRATEGY=poll
wrapper server-poll "$poll" "$server"
wrapper client-poll "$poll" "$client"
wrapper server-pin "" "$server_pin $server"
wrapper client-pin "" "$client_pin $client"
wrapper server-pinpoll "$poll" "$server_pin $server"
wrapper client-pinpoll "$poll" "$client_pin $client"

w=$out/wrappers
OUT=$out REPS=${REPS:-2} LEVELS=${LEVELS:-1,64,128} \
  SERVERS="def=$server,poll=$w/server-poll+$w/client-poll,pin=$w/server-pin+$w/client-pin,pinpoll=$w/server-pinpoll+$w/client-pinpoll" \
  bash "$here/ab_session.sh" | tee "$out/ab.txt"
