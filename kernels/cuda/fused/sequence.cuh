// Where sequence b of a batch lives in the packed tensors, for every fused kernel: dense batches
// by arithmetic, variable-length ones from the device prefix sums.
#pragma once

#include <cstdint>

#include "cuda/fused/fused_forward.h"

namespace attn::cuda {

// Lengths are int where a kernel indexes rows in 32 bits (the forward, whose launch bounds
// sequences to 2^30 tokens) and int64_t where it computes in 64 (the backward).
template <typename Length>
struct SequenceView {
  int64_t q_start, k_start;  // first token of the sequence
  Length seqlen_q, seqlen_k;
};

template <typename Length>
__device__ __forceinline__ SequenceView<Length> SequenceOf(const FusedForwardParams& p, int b) {
  SequenceView<Length> s;
  if (p.cu_seqlens_q != nullptr) {
    s.q_start = p.cu_seqlens_q[b];
    s.seqlen_q = static_cast<Length>(p.cu_seqlens_q[b + 1] - s.q_start);
    s.k_start = p.cu_seqlens_k[b];
    s.seqlen_k = static_cast<Length>(p.cu_seqlens_k[b + 1] - s.k_start);
  } else {
    s.q_start = static_cast<int64_t>(b) * p.seqlen_q;
    s.seqlen_q = static_cast<Length>(p.seqlen_q);
    s.k_start = static_cast<int64_t>(b) * p.seqlen_k;
    s.seqlen_k = static_cast<Length>(p.seqlen_k);
  }
  return s;
}

}  // namespace attn::cuda
