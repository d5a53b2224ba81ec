#!/usr/bin/env bash
# AttendBackward on a GPU machine: starts attnserve on AUTO, sends backward requests of several
# shapes and dtypes with and without the forward's O/LSE, and checks dQ, dK, dV against the
# float64 CPU reference. AUTO runs the bf16 and fp16 requests on the fused backward kernel, the
# float32 one (head_dim 80, a window) on the CUDA naive path; the last asks for the CPU path.
# Two ask for deterministic mode (the Hopper backward adds dQ in key-block order).
# tests/server/gpu_server_check.sh runs training steps on the fused and naive paths too, among
# its other checks; this one is the backward alone.
# Binaries from PATH (source a gpu-bundle env.sh first). Prints one line per request.
set -uo pipefail
out=${OUT:-/tmp/backward-check}
mkdir -p "$out"
attnserve --listen=127.0.0.1:0 --port_file="$out/port" --metrics_address= >"$out/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 100); do [[ -s $out/port ]] && break; sleep 0.2; done
target="127.0.0.1:$(cat "$out/port")"
fail=0
run() {
  attnserve_client backward --target="$target" --check --timeout=120s "$@" || fail=1
}
run --dtype=bfloat16 --seqlen_q=1024 --seqlen_k=1024 --heads=8 --kv_heads=2 --head_dim=128 --causal
run --dtype=float16 --varlen --batch=4 --seqlen_q=300 --seqlen_k=500 --heads=4 --head_dim=64 --send_forward
run --dtype=float32 --seqlen_q=77 --seqlen_k=130 --heads=4 --kv_heads=1 --head_dim=80 --window_left=16
run --dtype=bfloat16 --seqlen_q=513 --seqlen_k=513 --heads=2 --head_dim=64 --path=cpu --send_forward
run --dtype=bfloat16 --seqlen_q=2048 --seqlen_k=2048 --heads=8 --kv_heads=2 --head_dim=128 --causal \
  --deterministic
run --dtype=float16 --varlen --batch=3 --seqlen_q=700 --seqlen_k=900 --heads=4 --head_dim=64 \
  --window_left=100 --deterministic
kill -TERM $pid; wait $pid; echo "server exit $?"
grep -E "listening|drained" "$out/server.log"
echo "backward check: $([[ $fail -eq 0 ]] && echo OK || echo FAILED)"
exit $fail
