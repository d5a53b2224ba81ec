// Which query tiles a key block of the fused backward meets, and the reverse: shared by the
// portable and the Hopper backward kernels and by the deterministic mode (dq_order.cuh).
#pragma once

#include <cstdint>

#include "cuda/fused/fused_backward.h"
#include "cuda/fused/sequence.cuh"

namespace attn::cuda {

__device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }

// The query tiles of `block_m` rows that the key block [k0, k0 + keys) meets, head by head of
// its KV head's group: per_head of them from first_row0 on (the rows whose window can reach the
// block, query row i sitting at key position i + lk - lq; per-element masks trim the rest).
struct QueryTiles {
  int64_t first_row0 = 0, per_head = 0, count = 0;
  int group = 1;

  __device__ QueryTiles(const FusedBackwardParams& p, const SequenceView<int64_t>& seq, int64_t k0,
                        int64_t keys, int block_m) {
    const int64_t shift = seq.seqlen_k - seq.seqlen_q;
    int64_t first_row = 0, end_row = seq.seqlen_q;
    if (p.window_right >= 0) first_row = Max64(0, k0 - p.window_right - shift);
    if (p.window_left >= 0) end_row = Min64(seq.seqlen_q, k0 + keys + p.window_left - shift);
    first_row0 = first_row / block_m * block_m;
    per_head = end_row > first_row0 ? (end_row - first_row0 + block_m - 1) / block_m : 0;
    group = p.num_heads / p.num_kv_heads;
    count = per_head * group;
  }
  __device__ int head(int64_t t, int kv_head) const {
    return kv_head * group + static_cast<int>(t / per_head);
  }
  __device__ int64_t row0(int64_t t, int block_m) const {
    return first_row0 + (t % per_head) * block_m;
  }
};

// The lowest key block of `block_n` keys that meets query tile [row0, row0 + rows): only the
// left window bounds it (a block meets the tiles from its first visible row to its last).
__device__ __forceinline__ int64_t FirstKeyBlockOf(const FusedBackwardParams& p,
                                                   const SequenceView<int64_t>& seq, int64_t row0,
                                                   int block_n) {
  if (p.window_left < 0) return 0;
  const int64_t first_key = row0 + seq.seqlen_k - seq.seqlen_q - p.window_left;
  return first_key > 0 ? first_key / block_n : 0;
}

}  // namespace attn::cuda
