// Which keys a query row may attend to: causal masking aligned to the bottom-right corner and
// sliding windows, as FlashAttention 2.1+ defines them. Usable from host and device code.
//
// Query row i of a sequence with Lq queries and Lk keys sits at key position i + (Lk - Lq).
// Key j is visible iff  pos - window_left <= j <= pos + window_right,  clipped to [0, Lk).
// A negative window side means "unbounded"; causal forces window_right = 0.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTN_HOST_DEVICE inline
#endif

namespace attn {

struct KeyRange {
  int64_t begin;  // first visible key
  int64_t end;    // one past the last visible key; end <= begin means no visible key
};

ATTN_HOST_DEVICE KeyRange VisibleKeys(int64_t row, int64_t seqlen_q, int64_t seqlen_k,
                                      int64_t window_left, int64_t window_right) {
  const int64_t pos = row + seqlen_k - seqlen_q;
  int64_t begin = window_left < 0 ? 0 : pos - window_left;
  int64_t end = window_right < 0 ? seqlen_k : pos + window_right + 1;
  if (begin < 0) begin = 0;
  if (end > seqlen_k) end = seqlen_k;
  return {begin, end};
}

}  // namespace attn
