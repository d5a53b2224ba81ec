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

// The same mask for a kernel's registers: elements at small offsets (dk keys, dr query rows)
// from a base element (key `key`, query row `row`), tested in 32 bits. The element at
// (key + dk, row + dr) is visible when dk - dr lies within [-left, right] and dk < keys_left,
// which is VisibleKeys for |dk|, |dr| < kReach: each bound is clamped to +-kReach, so that a
// window wider than a tile (or none) costs two compares with immediates an element when the
// offsets are compile-time constants. keys_end: the first key past those in play (a block's
// end or the sequence's, whichever comes first; the clip at key 0 needs no test).
struct ElementMask {
  static constexpr int kReach = 1024;
  int left, right, keys_left;

  ATTN_HOST_DEVICE ElementMask(int64_t window_left, int64_t window_right, int64_t key, int64_t row,
                               int64_t seqlen_q, int64_t seqlen_k, int64_t keys_end) {
    const int64_t diff = key - (row + seqlen_k - seqlen_q);  // past the row's own key position
    left = window_left < 0 ? kReach : Clamp(diff + window_left);
    right = window_right < 0 ? kReach : Clamp(window_right - diff);
    keys_left = Clamp(keys_end - key);
  }
  ATTN_HOST_DEVICE bool Visible(int dk, int dr) const {
    return dk - dr >= -left && dk - dr <= right && dk < keys_left;
  }
  ATTN_HOST_DEVICE static int Clamp(int64_t x) {
    return static_cast<int>(x < -kReach ? -kReach : (x > kReach ? kReach : x));
  }
};

}  // namespace attn
