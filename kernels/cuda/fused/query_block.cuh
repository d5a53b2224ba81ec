// The query rows a fused forward CTA owns, and the parts both forward kernels share around
// their main loop: where the block's rows of Q, K, V and the LSE start, and how a row's
// statistics finish into O = acc / l and LSE. The kernels compute O's row pointer themselves:
// as a member here it reordered the portable kernel's epilogue code.
//
// The members are computed where a kernel asks for them, in the order the kernels always did:
// both kernels sit at or near 255 registers, where ptxas's allocation follows small changes of
// the instruction order.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/fused/fused_forward.h"
#include "cuda/fused/sequence.cuh"

namespace attn::cuda {

// kBlockM query rows of one (sequence, head), from the CTA's block index or given. By block
// index, query blocks run in reverse, so that the heavy causal blocks (late query rows) start
// first and shorten the tail.
template <int kBlockM>
struct QueryBlock {
  int head;
  int batch;  // the sequence's index
  SequenceView<int> seq;
  int row0;  // first query row of the block within its sequence

  __device__ __forceinline__ explicit QueryBlock(const FusedForwardParams& p) {
    const int m_block = gridDim.x - 1 - blockIdx.x;
    head = blockIdx.y;
    batch = blockIdx.z;
    seq = SequenceOf<int>(p, blockIdx.z);
    row0 = m_block * kBlockM;
  }

  // Block m_block of query head `head` in sequence `batch`, for kernels that walk several
  // blocks a CTA (query_schedule.cuh).
  __device__ __forceinline__ QueryBlock(const FusedForwardParams& p, int m_block, int head,
                                        int batch)
      : head(head), batch(batch), seq(SequenceOf<int>(p, batch)), row0(m_block * kBlockM) {}

  // The block starts past its sequence's last query row: nothing to do.
  __device__ __forceinline__ bool empty() const { return row0 >= seq.seqlen_q; }

  // Rows of the block inside the sequence (when not empty()).
  __device__ __forceinline__ int rows() const { return min(kBlockM, seq.seqlen_q - row0); }

  // The KV head that query head `head` reads (GQA/MQA).
  __device__ __forceinline__ int kv_head(const FusedForwardParams& p) const {
    return head / (p.num_heads / p.num_kv_heads);
  }

  // The block's first row of Q, and the sequence's first row of K and V at KV head `kv`.
  template <typename T>
  __device__ __forceinline__ const T* q(const FusedForwardParams& p) const {
    return static_cast<const T*>(p.q) + (seq.q_start + row0) * p.q_token_stride +
           head * p.q_head_stride;
  }
  template <typename T>
  __device__ __forceinline__ const T* k(const FusedForwardParams& p, int kv) const {
    return static_cast<const T*>(p.k) + seq.k_start * p.k_token_stride + kv * p.k_head_stride;
  }
  template <typename T>
  __device__ __forceinline__ const T* v(const FusedForwardParams& p, int kv) const {
    return static_cast<const T*>(p.v) + seq.k_start * p.v_token_stride + kv * p.v_head_stride;
  }

  // The block's first LSE entry; null when the LSE is not stored.
  __device__ __forceinline__ float* lse(const FusedForwardParams& p) const {
    return p.lse == nullptr ? nullptr : p.lse + head * p.total_q + seq.q_start + row0;
  }
};

// 1 / l for O = acc / l; 0 for a row that saw no key, whose acc is 0 as well.
__device__ __forceinline__ float InverseRowSum(float l) { return l == 0.f ? 0.f : 1.f / l; }

// The row's natural-log LSE of the scaled scores from its raw maximum m and sum l; -inf for a
// row that saw no key.
__device__ __forceinline__ float RowLse(float m, float l, float scale) {
  return l == 0.f ? -INFINITY : m * scale + logf(l);
}

}  // namespace attn::cuda
