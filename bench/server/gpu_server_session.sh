#!/usr/bin/env bash
# One device call's worth of server benchmarks on the GPU machine (docs/server-performance.md).
# Binaries come from PATH (source a gpu-bundle env.sh first). Each run is a server_bench.sh
# invocation; all results are packed into $OUT/server-session.tgz (one file to bring back) and
# the tables are printed last.
#
#   source build/server-bundle/env.sh; OUT=$OUT RUNS=main,large bash bench/server/gpu_server_session.sh
#
# Runs:
#   main       small set, unary + stream, batching on/off, concurrency 1,4,16,64
#   large      large set, unary + stream, concurrency 1,8
#   tiny       1-token requests: the RPC path's floor
#   lane1      small at 1,64 with --lane_threads=1 (one thread per lane, as before 2026-11-30)
#   large1     the large set with --lane_threads=1
#   wide       small, stream, concurrency 64 over 32 streams on 16 connections
#   lanes4     small at 64 with --lanes_per_device=4
#   window     small at 1,64 with 16 MiB HTTP/2 stream windows and BDP probing off, both sides
#   tuned      `window` plus 1 MiB HTTP/2 frames and 256 KiB-1 MiB TCP reads, both sides
#   nommap     the large set with glibc's mmap for big allocations off (GLIBC_TUNABLES), both
#              sides: 32 MiB+ tensors then reuse heap pages instead of faulting in fresh ones
#   tunedlarge the large set with the `tuned` arguments
#   unix       small set over a unix socket instead of TCP loopback
#   shm        small set, tensors in shared memory (client --shared_memory), TCP loopback
#   shmunix    the same over a unix socket
#   shmwide    `wide` with tensors in shared memory
#   shmlarge   the large set with tensors in shared memory (needs ~0.5 GiB of /dev/shm)
#   Lane and client variants of `shmunix`, small at 1 and 64, AttendStream only:
#   sdefault   the defaults (the baseline the variants below are read against)
#   sspin      --gpu_wait=spin   syield  --gpu_wait=yield   sblock  --gpu_wait=block
#   slanes1    --lanes_per_device=1   slanes4  --lanes_per_device=4
#   sblock4    --gpu_wait=block --lanes_per_device=4
#   sstreams   the client's 64 requests over 64 streams on 16 connections (one in flight each)
#   sconc      the defaults at 64 and 128 in flight
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:?set OUT}
work=${WORK:-/tmp/server-session}
duration=${DURATION:-3s}
runs=${RUNS:-main,large,tiny,lane1,wide}
rm -rf "$work"
mkdir -p "$work"

window="grpc.http2.lookahead_bytes=16777216,grpc.http2.bdp_probe=0"
tuned="$window,grpc.http2.max_frame_size=1048576,grpc.experimental.tcp_min_read_chunk_size=262144,grpc.experimental.tcp_read_chunk_size=1048576"

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  lscpu | grep -E '^Model name|^CPU\(s\)|^Thread|^Core' || true
  df -h /dev/shm | tail -1
} | tee "$work/machine.txt"

bench() {  # bench NAME ENV...
  local name=$1
  shift
  echo "=== $name: $*"
  env OUT="$work/$name" DURATION="$duration" LEVEL_TIMEOUT=60 "$@" \
    timeout 300 bash "$here/server_bench.sh" >"$work/$name.log" 2>&1
  echo "exit $? ($name)"
}

shmstream="SETS=small SMALL_LEVELS=1,64 RPCS=stream LISTEN=unix CLIENT_ARGS=--shared_memory"
IFS=, read -r -a run_list <<<"$runs"
for run in "${run_list[@]}"; do
  case $run in
    main) bench main SETS=small ;;
    large) bench large SETS=large LARGE_LEVELS=1,8 ;;
    tiny) bench tiny SETS=tiny ;;
    lane1) bench lane1 SETS=small SMALL_LEVELS=1,64 SERVER_ARGS=--lane_threads=1 ;;
    large1) bench large1 SETS=large LARGE_LEVELS=1,8 SERVER_ARGS=--lane_threads=1 ;;
    wide) bench wide SETS=small SMALL_LEVELS=64 RPCS=stream STREAMS=32 CHANNELS=16 ;;
    lanes4) bench lanes4 SETS=small SMALL_LEVELS=64 SERVER_ARGS=--lanes_per_device=4 ;;
    window) bench window SETS=small SMALL_LEVELS=1,64 SERVER_ARGS="--grpc_arg=$window" \
              CLIENT_ARGS="--grpc_arg=$window" ;;
    tuned) bench tuned SETS=small SMALL_LEVELS=1,64 SERVER_ARGS="--grpc_arg=$tuned" \
             CLIENT_ARGS="--grpc_arg=$tuned" ;;
    nommap) bench nommap SETS=large LARGE_LEVELS=1,8 GLIBC_TUNABLES=glibc.malloc.mmap_max=0 ;;
    tunedlarge) bench tunedlarge SETS=large LARGE_LEVELS=1,8 SERVER_ARGS="--grpc_arg=$tuned" \
                  CLIENT_ARGS="--grpc_arg=$tuned" ;;
    unix) bench unix SETS=small LISTEN=unix ;;
    shm) bench shm SETS=small CLIENT_ARGS=--shared_memory ;;
    shmunix) bench shmunix SETS=small LISTEN=unix CLIENT_ARGS=--shared_memory ;;
    shmwide) bench shmwide SETS=small SMALL_LEVELS=64 RPCS=stream STREAMS=32 CHANNELS=16 \
               CLIENT_ARGS=--shared_memory ;;
    sdefault) bench sdefault $shmstream ;;
    sspin) bench sspin $shmstream SERVER_ARGS=--gpu_wait=spin ;;
    syield) bench syield $shmstream SERVER_ARGS=--gpu_wait=yield ;;
    sblock) bench sblock $shmstream SERVER_ARGS=--gpu_wait=block ;;
    slanes1) bench slanes1 $shmstream SERVER_ARGS=--lanes_per_device=1 ;;
    slanes4) bench slanes4 $shmstream SERVER_ARGS=--lanes_per_device=4 ;;
    sblock4) bench sblock4 $shmstream SERVER_ARGS="--gpu_wait=block --lanes_per_device=4" ;;
    sstreams) bench sstreams $shmstream STREAMS=64 CHANNELS=16 ;;
    sconc) bench sconc $shmstream SMALL_LEVELS=64,128 ;;
    shmlarge) bench shmlarge SETS=large LARGE_LEVELS=1,8 CLIENT_ARGS=--shared_memory ;;
    *) echo "unknown run $run" ;;
  esac
done

tar czf "$out/server-session.tgz" -C "$work" .
for run in "${run_list[@]}"; do
  echo
  echo "##### $run"
  sed -n '/^| set/,$p' "$work/$run/table.txt" 2>/dev/null | grep -v '^|---' || tail -5 "$work/$run.log"
done
