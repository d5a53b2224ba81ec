// Register-blocked block products for the tiled CPU engine, on GCC vector extensions: 16-float
// vectors (one AVX-512 register; two AVX2 or four SSE registers in the other clones). They are
// always inlined into the ATTN_CPU_CLONES tile functions, so each clone compiles them for its ISA.
#pragma once

#include <cstdint>

#include "cpu/tile_config.h"

#define ATTN_ALWAYS_INLINE inline __attribute__((always_inline))

namespace attn::cpu {

typedef float V16 __attribute__((vector_size(64)));

ATTN_ALWAYS_INLINE V16 Load16(const float* p) {
  V16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
ATTN_ALWAYS_INLINE void Store16(float* p, V16 v) { __builtin_memcpy(p, &v, sizeof(v)); }

// out[r][0, kBlockK) = sum_c a[r * lda + c] * bt[c * kBlockK + j] for r < R: R rows of an
// [R, depth] matrix times a [depth, kBlockK] panel (a K or V tile stored transposed). The R x 4
// accumulators live in registers for the whole depth loop.
template <int R>
ATTN_ALWAYS_INLINE void RowsTimesPanel(const float* a, int64_t lda, const float* bt, int depth,
                                       float* out) {
  static_assert(kBlockK == 64, "four 16-float vectors per panel row");
  V16 acc[R][4] = {};
  for (int c = 0; c < depth; ++c) {
    const float* b = bt + static_cast<int64_t>(c) * kBlockK;
    const V16 b0 = Load16(b), b1 = Load16(b + 16), b2 = Load16(b + 32), b3 = Load16(b + 48);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float x = a[r * lda + c];
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
      acc[r][2] += x * b2;
      acc[r][3] += x * b3;
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < 4; ++w) Store16(out + r * kBlockK + 16 * w, acc[r][w]);
  }
}

// c[r * ldc + x] += sum_k a[r * a_r + k * a_k] * b[k * ldb + x] for r < R, x in [c0, c0 + 16 W).
template <int R, int W>
ATTN_ALWAYS_INLINE void AccumulateChunk(const float* a, int64_t a_r, int64_t a_k, int depth,
                                        const float* b, int64_t ldb, float* c, int64_t ldc,
                                        int c0) {
  V16 acc[R][W];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) acc[r][w] = Load16(c + r * ldc + c0 + 16 * w);
  }
  for (int k = 0; k < depth; ++k) {
    V16 bv[W];
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) bv[w] = Load16(b + k * ldb + c0 + 16 * w);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float x = a[r * a_r + k * a_k];
#pragma GCC unroll 4
      for (int w = 0; w < W; ++w) acc[r][w] += x * bv[w];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) Store16(c + r * ldc + c0 + 16 * w, acc[r][w]);
  }
}

// C[r][0, width) += sum_k A(r, k) B[k][0, width) for r < R, with A(r, k) = a[r * a_r + k * a_k]
// (so A may be read transposed), B rows ldb apart and C rows ldc apart. Columns go 64 at a time,
// then 16 at a time, then one by one.
template <int R>
ATTN_ALWAYS_INLINE void AccumulateRows(const float* a, int64_t a_r, int64_t a_k, int depth,
                                       const float* b, int64_t ldb, float* c, int64_t ldc,
                                       int width) {
  int c0 = 0;
  for (; c0 + 64 <= width; c0 += 64) AccumulateChunk<R, 4>(a, a_r, a_k, depth, b, ldb, c, ldc, c0);
  for (; c0 + 16 <= width; c0 += 16) AccumulateChunk<R, 1>(a, a_r, a_k, depth, b, ldb, c, ldc, c0);
  for (; c0 < width; ++c0) {
    for (int r = 0; r < R; ++r) {
      float sum = c[r * ldc + c0];
      for (int k = 0; k < depth; ++k) sum += a[r * a_r + k * a_k] * b[k * ldb + c0];
      c[r * ldc + c0] = sum;
    }
  }
}

}  // namespace attn::cpu
