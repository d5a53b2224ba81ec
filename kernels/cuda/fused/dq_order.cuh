// The fused backwards' deterministic mode: the key blocks that meet one (sequence, head, query
// tile) add its dQ in key-block order. Each waits on the tile's counter (workspace, zeroed per
// launch) until it equals the blocks below it that meet the tile, adds, then counts itself in.
// Blocks of one (KV head, sequence) are launched in key-block order (blockIdx.x runs fastest),
// so the block waited for is resident or finished.
#pragma once

#include <cstdint>

#include "cuda/fused/backward_tiles.cuh"
#include "cuda/fused/fused_backward.h"
#include "cuda/fused/sequence.cuh"

namespace attn::cuda {

// Query tiles of this many rows index the counters (the portable kernel's tile; the Hopper
// kernel's tiles are whole multiples of it).
inline constexpr int kDqCounterRows = 64;

// The counter of query tile `row0` of head `head` of sequence blockIdx.z.
__device__ __forceinline__ int* DqTileCounter(int* counters, int64_t query_tiles, int num_heads,
                                              int head, int64_t row0) {
  return counters + (int64_t{blockIdx.z} * num_heads + head) * query_tiles + row0 / kDqCounterRows;
}

// This key block's turn on the tile (blockIdx.x, less the blocks below that never meet it).
__device__ __forceinline__ int64_t DqTurn(const FusedBackwardParams& p,
                                          const SequenceView<int64_t>& seq, int64_t row0,
                                          int block_n) {
  return blockIdx.x - FirstKeyBlockOf(p, seq, row0, block_n);
}

__device__ __forceinline__ void WaitForTurn(const int* counter, int64_t turn) {
  for (;;) {
    int value;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
    if (value == turn) return;
  }
}

__device__ __forceinline__ void PassTurn(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

}  // namespace attn::cuda
