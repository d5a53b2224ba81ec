// The online softmax of one K/V tile, over the scores a thread holds in MMA accumulator layout.
//
// A thread holds, for each 16-row MMA tile, two rows (lane/4 and lane/4 + 8) and in each 8-key
// column tile two adjacent keys; the four lanes of a quad together hold a row's tile. Per row:
//   m_new = max(m, rowmax(S)),  alpha = exp(m - m_new),  P = exp(S - m_new),
//   acc = acc * alpha (here),  l = l * alpha + rowsum(P)   (acc += P V is the caller's MMA).
// Exponentials run in base 2: exp(x * scale) = exp2(x * scale * log2(e)), one FFMA + one EX2.
// m is kept as a raw (unscaled) score maximum; l is the thread's partial row sum, reduced over
// the quad only once at the end, since alpha rescales every partial sum alike.
#pragma once

#include <cmath>

#include "cuda/fused/ptx.cuh"

namespace attn::cuda {

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int kMTiles, int kNTiles, int kDTiles>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMTiles;  // rows held by this thread
  float m[kRows];                            // running max of raw scores
  float l[kRows];                            // running (partial) sum of exp

  __device__ __forceinline__ void Init() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.f;
    }
  }

  // Turns the scores s into P = exp(scale * (s - m_new)) in place and rescales acc by alpha.
  __device__ __forceinline__ void Update(float (&s)[kMTiles][kNTiles][4],
                                         float (&acc)[kMTiles][kDTiles][4], float scale_log2) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mi * 2 + half;
        float tile_max = -INFINITY;
#pragma unroll
        for (int nj = 0; nj < kNTiles; ++nj) {
          tile_max = fmaxf(tile_max, fmaxf(s[mi][nj][2 * half], s[mi][nj][2 * half + 1]));
        }
        const float m_new = fmaxf(m[r], QuadMax(tile_max));
        // A row that has seen only masked keys keeps m = -inf; exponentiate against 0 then so
        // that exp(-inf - -inf) never makes a NaN (every P of such a row is exp2(-inf) = 0).
        const float m_ref = m_new == -INFINITY ? 0.f : m_new * scale_log2;
        const float alpha = ptx::Exp2(m[r] * scale_log2 - m_ref);
        m[r] = m_new;
        float row_sum = 0.f;
#pragma unroll
        for (int nj = 0; nj < kNTiles; ++nj) {
          const float p0 = ptx::Exp2(fmaf(s[mi][nj][2 * half], scale_log2, -m_ref));
          const float p1 = ptx::Exp2(fmaf(s[mi][nj][2 * half + 1], scale_log2, -m_ref));
          s[mi][nj][2 * half] = p0;
          s[mi][nj][2 * half + 1] = p1;
          row_sum += p0 + p1;
        }
        l[r] = l[r] * alpha + row_sum;
#pragma unroll
        for (int dj = 0; dj < kDTiles; ++dj) {
          acc[mi][dj][2 * half] *= alpha;
          acc[mi][dj][2 * half + 1] *= alpha;
        }
      }
    }
  }

  // Update in two halves, for a kernel whose P V MMA of the previous tile still accumulates
  // into acc while this tile's softmax runs: the statistics (P in place of s, m and l, and each
  // row's alpha), then, once that MMA is done, Rescale(acc, alpha). P and l come out multiplied
  // by 2^kPLog2Scale (the FP8 forward's range for P).
  template <int kPLog2Scale = 0>
  __device__ __forceinline__ void UpdateStatistics(float (&s)[kMTiles][kNTiles][4],
                                                   float scale_log2, float (&alpha)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mi * 2 + half;
        float tile_max = -INFINITY;
#pragma unroll
        for (int nj = 0; nj < kNTiles; ++nj) {
          tile_max = fmaxf(tile_max, fmaxf(s[mi][nj][2 * half], s[mi][nj][2 * half + 1]));
        }
        const float m_new = fmaxf(m[r], QuadMax(tile_max));
        const float m_ref = m_new == -INFINITY ? 0.f : m_new * scale_log2;  // as in Update
        alpha[r] = ptx::Exp2(m[r] * scale_log2 - m_ref);
        m[r] = m_new;
        const float p_ref = kPLog2Scale == 0 ? m_ref : m_ref - static_cast<float>(kPLog2Scale);
        float row_sum = 0.f;
#pragma unroll
        for (int nj = 0; nj < kNTiles; ++nj) {
          const float p0 = ptx::Exp2(fmaf(s[mi][nj][2 * half], scale_log2, -p_ref));
          const float p1 = ptx::Exp2(fmaf(s[mi][nj][2 * half + 1], scale_log2, -p_ref));
          s[mi][nj][2 * half] = p0;
          s[mi][nj][2 * half + 1] = p1;
          row_sum += p0 + p1;
        }
        l[r] = l[r] * alpha[r] + row_sum;
      }
    }
  }

  __device__ __forceinline__ static void Rescale(float (&acc)[kMTiles][kDTiles][4],
                                                 const float (&alpha)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int dj = 0; dj < kDTiles; ++dj) {
        acc[mi][dj][0] *= alpha[mi * 2];
        acc[mi][dj][1] *= alpha[mi * 2];
        acc[mi][dj][2] *= alpha[mi * 2 + 1];
        acc[mi][dj][3] *= alpha[mi * 2 + 1];
      }
  }
};

}  // namespace attn::cuda
