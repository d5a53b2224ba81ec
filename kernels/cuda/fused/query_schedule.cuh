// The persistent grid of the warp-specialised forward (fused_forward_sm90_tma_kernel.cuh): at
// most one CTA an SM, each taking query blocks from a queue in device memory as it finishes the
// last, so that one block's epilogue overlaps the next one's first loads instead of a new CTA
// starting cold, and a CTA that drew light blocks (causal, ragged batches) draws more.
//
// The queue is two ints of the caller's (FusedForwardParams::tile_counters), zero at launch and
// left zero: the next block to hand out beyond the grid's first ones, and the CTAs done with it.
// Blocks leave in the order the non-persistent grid ran them: the query blocks of one (sequence,
// head) from the last to the first (the heaviest first under a causal mask), then the next head,
// then the next sequence. The CTAs working at one time read the same K and V through the L2, and
// each head's light blocks come after its heavy ones.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/fused/fused_forward.h"

namespace attn::cuda {

struct QueryBlockIndex {
  int m_block, head, batch;
};

// The query blocks of the longest sequence, and of a launch (that times heads and batch).
template <int kBlockM>
__host__ __device__ inline int64_t QueryBlocksPerHead(const FusedForwardParams& p) {
  return (p.max_seqlen_q + kBlockM - 1) / kBlockM;
}
template <int kBlockM>
__host__ __device__ inline int64_t QueryBlocksOf(const FusedForwardParams& p) {
  return QueryBlocksPerHead<kBlockM>(p) * p.num_heads * p.batch;
}

// The blocks of a launch by their place in the queue.
struct QueryBlockOrder {
  int m_blocks;  // query blocks of the longest sequence
  int heads;
  int total;  // QueryBlocksOf, which the launch keeps under 2^31

  template <int kBlockM>
  __device__ __forceinline__ static QueryBlockOrder Of(const FusedForwardParams& p) {
    const int m_blocks = static_cast<int>(QueryBlocksPerHead<kBlockM>(p));
    return {m_blocks, p.num_heads, m_blocks * p.num_heads * p.batch};
  }

  // Block `index` (< total).
  __device__ __forceinline__ QueryBlockIndex operator[](int index) const {
    const int head_of_batch = index / m_blocks;
    return {m_blocks - 1 - (index - head_of_batch * m_blocks), head_of_batch % heads,
            head_of_batch / heads};
  }
};

// The next place in the queue for this CTA, by its producer's one thread. The first grid-size
// places are the CTAs' own; the rest are drawn from the counter.
__device__ __forceinline__ int DrawQueryBlock(int* counters) {
  return static_cast<int>(gridDim.x) + atomicAdd(counters, 1);
}

// Once the CTA's producer has drawn a place past the end (after its last block): the last CTA
// to get here sets both counters back to zero. Every CTA draws before it counts itself done, so
// no draw follows the reset; the fence orders this CTA's draws before its count.
__device__ __forceinline__ void LeaveQueryQueue(int* counters) {
  __threadfence();
  if (atomicAdd(counters + 1, 1) == static_cast<int>(gridDim.x) - 1) {
    atomicExch(counters, 0);
    atomicExch(counters + 1, 0);
  }
}

// CTAs of the persistent grid: one an SM (the kernel's shared memory and registers hold one an
// SM), fewer when there are fewer blocks, or `pinned` when positive (tests walk several blocks a
// CTA on small problems that way).
inline cudaError_t PersistentCtas(int64_t blocks, int pinned, unsigned* ctas) {
  int limit = pinned;
  if (limit <= 0) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&limit, cudaDevAttrMultiProcessorCount, device);
    }
    if (err != cudaSuccess) return err;
  }
  *ctas = static_cast<unsigned>(std::min<int64_t>(blocks, limit));
  return cudaSuccess;
}

}  // namespace attn::cuda
