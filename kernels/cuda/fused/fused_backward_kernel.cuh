// The fused backward's main kernel (see fused_backward.h for the algorithm): one CTA per
// (64-key block, KV head, sequence). Tensor-core products are m16n8k16 MMAs (float32
// accumulation) on fragments loaded with ldmatrix from tiles in shared memory; S, dP and dQ stay
// in registers. Compiled for Ampere and Hopper; one generated file per backward row of the table
// instantiates it (fused_backward_launch.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attn/mask.h"
#include "cuda/common/element_convert.cuh"
#include "cuda/fused/backward_tiles.cuh"
#include "cuda/fused/dq_order.cuh"
#include "cuda/fused/fused_backward.h"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/sequence.cuh"

namespace attn::cuda::backward {

constexpr int kBlockQ = 64;    // query rows per tile
constexpr int kBlockK = 64;    // key rows per CTA
constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kPadHalf = 8;  // 16 bytes of padding per shared row: fewer bank conflicts

// Query tiles in flight: with two, the next one loads while this one runs; with one, loads and
// compute overlap only across the CTAs an SM holds. d = 128 takes one so that two CTAs fit on
// an SM, which measured faster than two stages and one CTA (docs/cuda-fused.md); d = 256 takes
// one because two (217 KiB) exceed the A100's 163 KiB per block.
template <int D>
constexpr int kStagesFor = D >= 128 ? 1 : 2;

template <typename T, int D>
struct SharedTiles {
  static constexpr int kStages = kStagesFor<D>;
  T k[kBlockK][D + kPadHalf];
  T v[kBlockK][D + kPadHalf];
  T q[kStages][kBlockQ][D + kPadHalf];
  T d_o[kStages][kBlockQ][D + kPadHalf];
  // P and dS of the current tile: every warp reads all of them, transposed for dK and dV.
  T p[kBlockQ][kBlockK + kPadHalf];
  T ds[kBlockQ][kBlockK + kPadHalf];
  float lse[kStages][kBlockQ];
  float delta[kStages][kBlockQ];
  // The current tile's visible keys per query row, as columns [begin, end) of this key block
  // (empty for rows past the sequence and rows the forward saw no key for).
  int visible_begin[kBlockQ];
  int visible_end[kBlockQ];
};

// Rows [row0, row0 + valid) of head `head` of a strided [tokens, heads, D] tensor into a shared
// tile; rows past `valid` become zeros. 8 elements (16 bytes) per step, one load when aligned.
template <typename T, int D, int kRows>
__device__ void LoadTile(T (*tile)[D + kPadHalf], const T* base, int64_t token_stride,
                         int64_t head_offset, int64_t row0, int64_t valid, bool aligned) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    T* dst = &tile[r][c];
    if (r < valid) {
      const T* src = base + (row0 + r) * token_stride + head_offset + c;
      if (aligned) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = src[e];
      }
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
}

// LoadTile through cp.async (16-byte aligned rows only): the copies land while the CTA works
// on the tile before; rows past `valid` are zero-filled without reading memory.
template <typename T, int D, int kRows>
__device__ void LoadTileAsync(T (*tile)[D + kPadHalf], const T* base, int64_t token_stride,
                              int64_t head_offset, int64_t row0, int64_t valid) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    const bool in = r < valid;
    const T* src = in ? base + (row0 + r) * token_stride + head_offset + c : base;
    ptx::CopyAsync16(ptx::SharedAddress(&tile[r][c]), src, in);
  }
}

// Two CTAs per SM where their shared memory fits (on Hopper d <= 128, d = 128 with one stage;
// on an A100 d <= 64; at d = 256 nowhere: 151 KiB): the register cap that brings (128 per thread)
// measured faster than one CTA with more registers (docs/cuda-fused.md). The device pass for each
// architecture sizes the cap by its own shared memory per SM.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr size_t kSharedPerSm = 164 * 1024;  // A100
#else
constexpr size_t kSharedPerSm = 228 * 1024;  // H100 / H200
#endif
template <int D>
constexpr int kMinBlocksPerSm = 2 * (sizeof(SharedTiles<__half, D>) + 1024) <= kSharedPerSm ? 2 : 1;

// Tensor-core fragments of m16n8k16 (ptx::Mma16816) loaded from padded row-major shared tiles
// with ldmatrix. Lane l addresses row l % 8 of 8x8 matrix l / 8.
struct Fragments {
  int matrix, row;  // this lane's ldmatrix role
  __device__ Fragments() : matrix(threadIdx.x % 32 / 8), row(threadIdx.x % 8) {}

  // A (16 x 16) = X[m0.., k0..] of a row-major X.
  template <typename T, int kLd>
  __device__ void A(uint32_t (&a)[4], const T (*x)[kLd], int m0, int k0) const {
    ptx::LoadMatrixX4(a,
                      ptx::SharedAddress(&x[m0 + row + (matrix & 1) * 8][k0 + (matrix >> 1) * 8]));
  }
  // A (16 x 16) = X^T[m0.., k0..] of a row-major X (X's rows are A's columns).
  template <typename T, int kLd>
  __device__ void ATransposed(uint32_t (&a)[4], const T (*x)[kLd], int m0, int k0) const {
    ptx::LoadMatrixX4Transposed(
        a, ptx::SharedAddress(&x[k0 + row + (matrix >> 1) * 8][m0 + (matrix & 1) * 8]));
  }
  // B for columns n0.. and n0 + 8.. (b[0], b[1] and b[2], b[3]) where B = X^T: X row-major
  // [n][k], as K is for S = Q K^T.
  template <typename T, int kLd>
  __device__ void BOfRows(uint32_t (&b)[4], const T (*x)[kLd], int n0, int k0) const {
    ptx::LoadMatrixX4(b,
                      ptx::SharedAddress(&x[n0 + row + (matrix >> 1) * 8][k0 + (matrix & 1) * 8]));
  }
  // The same where B = X: X row-major [k][n], as dO is for dV = P^T dO.
  template <typename T, int kLd>
  __device__ void BOfColumns(uint32_t (&b)[4], const T (*x)[kLd], int k0, int n0) const {
    ptx::LoadMatrixX4Transposed(
        b, ptx::SharedAddress(&x[k0 + row + (matrix & 1) * 8][n0 + (matrix >> 1) * 8]));
  }
};

// acc[n] and acc[n + 1] += A times the two 8-column B tiles one ldmatrix.x4 loaded (b[0..1],
// b[2..3]).
template <typename T, int kTiles>
__device__ __forceinline__ void MmaTilePair(float (&acc)[kTiles][4], int n, const uint32_t (&a)[4],
                                            const uint32_t (&b)[4]) {
  ptx::Mma16816<T>(acc[n], a, b[0], b[1]);
  ptx::Mma16816<T>(acc[n + 1], a, b[2], b[3]);
}

// kDeterministic: dQ added in key-block order (dq_order.cuh). A template parameter, so that the
// default kernel carries none of its code: as a runtime branch it cost the default 11-13% on the
// H200 (more spills at d = 128).
template <typename T, int D, bool kDeterministic>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<D>)
    BackwardKernel(const FusedBackwardParams p, const float* delta, float* dq_accum,
                   int* dq_tile_counters, int64_t query_tiles, bool aligned_inputs,
                   bool aligned_outputs) {
  extern __shared__ __align__(128) unsigned char shared_raw[];
  auto& sm = *reinterpret_cast<SharedTiles<T, D>*>(shared_raw);
  // Warp w owns rows [16 (w % 4), +16) of every product: query rows of S, dP and dQ, key rows
  // of dK and dV. Its columns: keys [32 (w / 4), +32) of S and dP, and half the head dimension,
  // [kHalf (w / 4), +kHalf), of dK, dV and dQ, as kColTiles tiles of 8.
  static_assert(kBlockQ == 64 && kBlockK == 64 && kThreads == 256, "the warp layout below");
  constexpr int kHalf = D / 2;
  constexpr int kColTiles = kHalf / 8;
  static_assert(kHalf % 16 == 0, "head_dim must be a multiple of 32");
  constexpr int kKeyTiles = 4;  // 32 keys of S and dP per warp

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = (warp % 4) * 16;
  const int key0 = (warp / 4) * 32;
  const int col0 = (warp / 4) * kHalf;
  const int g = lane / 4, pair = (lane % 4) * 2;  // accumulator: rows g, g + 8; columns pair, +1
  const Fragments frag;

  const SequenceView<int64_t> seq = SequenceOf<int64_t>(p, blockIdx.z);
  const int64_t k0 = int64_t{blockIdx.x} * kBlockK;
  if (k0 >= seq.seqlen_k) return;
  const int64_t keys = Min64(kBlockK, seq.seqlen_k - k0);
  const int kv_head = blockIdx.y;

  LoadTile<T, D, kBlockK>(sm.k, static_cast<const T*>(p.k), p.k_token_stride,
                          kv_head * p.k_head_stride, seq.k_start + k0, keys, aligned_inputs);
  LoadTile<T, D, kBlockK>(sm.v, static_cast<const T*>(p.v), p.v_token_stride,
                          kv_head * p.v_head_stride, seq.k_start + k0, keys, aligned_inputs);

  float dk[kColTiles][4] = {}, dv[kColTiles][4] = {};

  // The query tiles this block meets, head by head of its group. Tile t + 1's Q, dO, LSE and D
  // load (cp.async) while tile t runs.
  constexpr int kStages = kStagesFor<D>;
  // d = 256: one stage and one CTA per SM, so nothing would hide a tile's load; it is issued
  // as soon as dV and dK of the tile before are done with the stage, and lands under that
  // tile's dQ. d = 128 keeps its measured schedule (the other CTA on the SM overlaps the load).
  constexpr bool kRefillUnderDq = kStages == 1 && D > 128;
  const QueryTiles block_tiles(p, seq, k0, keys, kBlockQ);
  const int64_t tiles = block_tiles.count;
  const auto tile_head = [&](int64_t t) { return block_tiles.head(t, kv_head); };
  const auto tile_row0 = [&](int64_t t) { return block_tiles.row0(t, kBlockQ); };
  const auto issue = [&](int64_t t) {
    const int stage = static_cast<int>(t % kStages);
    const int h = tile_head(t);
    const int64_t i0 = tile_row0(t), rows = Min64(kBlockQ, seq.seqlen_q - i0);
    const T* q = static_cast<const T*>(p.q);
    const T* d_o = static_cast<const T*>(p.d_o);
    if (aligned_inputs) {
      LoadTileAsync<T, D, kBlockQ>(sm.q[stage], q, p.q_token_stride, h * p.q_head_stride,
                                   seq.q_start + i0, rows);
      LoadTileAsync<T, D, kBlockQ>(sm.d_o[stage], d_o, p.do_token_stride, h * p.do_head_stride,
                                   seq.q_start + i0, rows);
    } else {
      LoadTile<T, D, kBlockQ>(sm.q[stage], q, p.q_token_stride, h * p.q_head_stride,
                              seq.q_start + i0, rows, false);
      LoadTile<T, D, kBlockQ>(sm.d_o[stage], d_o, p.do_token_stride, h * p.do_head_stride,
                              seq.q_start + i0, rows, false);
    }
    // Thread r < kBlockQ loads row r's LSE and D; it alone reads the LSE back (visible ranges).
    if (threadIdx.x < kBlockQ) {
      const int r = threadIdx.x;
      const bool in = r < rows;
      const int64_t at = h * p.total_q + seq.q_start + (in ? i0 + r : 0);
      ptx::CopyAsync4(ptx::SharedAddress(&sm.lse[stage][r]), p.lse + at, in);
      ptx::CopyAsync4(ptx::SharedAddress(&sm.delta[stage][r]), delta + at, in);
    }
    ptx::CommitAsyncGroup();
  };
  if ((kStages > 1 || kRefillUnderDq) && tiles > 0) issue(0);

  for (int64_t t = 0; t < tiles; ++t) {
    const int stage = static_cast<int>(t % kStages);
    const int h = tile_head(t);
    const int64_t i0 = tile_row0(t), rows = Min64(kBlockQ, seq.seqlen_q - i0);
    if (kStages == 1 && !kRefillUnderDq) {
      if (t > 0) __syncthreads();  // every warp is done with tile t - 1's Q, dO, P and dS
      issue(t);
    }
    ptx::WaitAsyncGroups<0>();  // tile t, the only group in flight
    if (threadIdx.x < kBlockQ) {
      const int r = threadIdx.x;
      int begin = 0, end = 0;
      if (r < rows && sm.lse[stage][r] != -INFINITY) {
        const KeyRange visible =
            VisibleKeys(i0 + r, seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
        begin = static_cast<int>(Min64(Max64(visible.begin - k0, 0), keys));
        end = static_cast<int>(Min64(Max64(visible.end - k0, 0), keys));
      }
      sm.visible_begin[r] = begin;
      sm.visible_end[r] = end;
    }
    // Tile t's Q, dO, LSE, D and ranges are in; every warp is done with tile t - 1 (its P, dS
    // and stage), so the next tile may land in that stage.
    __syncthreads();
    if (kStages > 1 && t + 1 < tiles) issue(t + 1);
    const auto& tq = sm.q[stage];
    const auto& tdo = sm.d_o[stage];

    // S = Q K^T and dP = dO V^T for this warp's 16 query rows x 32 keys, in registers.
    float s[kKeyTiles][4] = {}, dp[kKeyTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
      uint32_t a[4], b[4];
      frag.A(a, tq, row0, kk);
#pragma unroll
      for (int n = 0; n < kKeyTiles; n += 2) {
        frag.BOfRows(b, sm.k, key0 + n * 8, kk);
        MmaTilePair<T>(s, n, a, b);
      }
      frag.A(a, tdo, row0, kk);
#pragma unroll
      for (int n = 0; n < kKeyTiles; n += 2) {
        frag.BOfRows(b, sm.v, key0 + n * 8, kk);
        MmaTilePair<T>(dp, n, a, b);
      }
    }
    // P = exp(scale * S - LSE) on visible keys and dS = P * (dP - D), into shared memory.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + g + half * 8;
      const float lse = sm.lse[stage][r], row_delta = sm.delta[stage][r];
      const int begin = sm.visible_begin[r], end = sm.visible_end[r];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        const int c = key0 + n * 8 + pair;
        const float x0 = s[n][half * 2], x1 = s[n][half * 2 + 1];
        const float p0 = c >= begin && c < end ? __expf(fmaf(x0, p.scale, -lse)) : 0.f;
        const float p1 = c + 1 >= begin && c + 1 < end ? __expf(fmaf(x1, p.scale, -lse)) : 0.f;
        *reinterpret_cast<uint32_t*>(&sm.p[r][c]) = ptx::PackPair<T>(p0, p1);
        *reinterpret_cast<uint32_t*>(&sm.ds[r][c]) = ptx::PackPair<T>(
            p0 * (dp[n][half * 2] - row_delta), p1 * (dp[n][half * 2 + 1] - row_delta));
      }
    }
    __syncthreads();

    // dV += P^T dO and dK += dS^T Q (dS^T Q is scaled once, at the end): this warp's 16 keys x
    // kHalf columns, over the tile's 64 queries.
#pragma unroll
    for (int kk = 0; kk < kBlockQ; kk += 16) {
      uint32_t a_p[4], a_ds[4], b[4];
      frag.ATransposed(a_p, sm.p, row0, kk);
      frag.ATransposed(a_ds, sm.ds, row0, kk);
#pragma unroll
      for (int n = 0; n < kColTiles; n += 2) {
        frag.BOfColumns(b, tdo, kk, col0 + n * 8);
        MmaTilePair<T>(dv, n, a_p, b);
        frag.BOfColumns(b, tq, kk, col0 + n * 8);
        MmaTilePair<T>(dk, n, a_ds, b);
      }
    }
    if constexpr (kRefillUnderDq) {
      __syncthreads();  // every warp is done with this tile's Q and dO
      if (t + 1 < tiles) issue(t + 1);
    }
    // This tile's dQ = dS K (16 query rows x kHalf columns), added to the accumulator from
    // registers: two columns per atomic on Hopper. Deterministic mode: the whole CTA's adds of
    // the tile in key-block order (dq_order.cuh), atomics still, one block at a time.
    int* dq_counter = nullptr;
    if constexpr (kDeterministic) {
      dq_counter = DqTileCounter(dq_tile_counters, query_tiles, p.num_heads, h, i0);
      if (threadIdx.x == 0) WaitForTurn(dq_counter, DqTurn(p, seq, i0, kBlockK));
      __syncthreads();
    }
    // At most 8 column tiles of dQ at a time: at d = 256 all 16 on top of dK and dV spill.
    constexpr int kDqTiles = kColTiles < 8 ? kColTiles : 8;
    static_assert(kColTiles % kDqTiles == 0, "whole chunks of dQ");
#pragma unroll
    for (int chunk = 0; chunk < kColTiles; chunk += kDqTiles) {
      const int dq0 = col0 + chunk * 8;
      float dq[kDqTiles][4] = {};
#pragma unroll
      for (int kk = 0; kk < kBlockK; kk += 16) {
        uint32_t a[4], b[4];
        frag.A(a, sm.ds, row0, kk);
#pragma unroll
        for (int n = 0; n < kDqTiles; n += 2) {
          frag.BOfColumns(b, sm.k, kk, dq0 + n * 8);
          MmaTilePair<T>(dq, n, a, b);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = row0 + g + half * 8;
        if (r >= rows) continue;
        float* out = dq_accum + ((seq.q_start + i0 + r) * p.num_heads + h) * D + dq0 + pair;
#pragma unroll
        for (int n = 0; n < kDqTiles; ++n) {
          const float x0 = dq[n][half * 2] * p.scale, x1 = dq[n][half * 2 + 1] * p.scale;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
          atomicAdd(reinterpret_cast<float2*>(out + n * 8), make_float2(x0, x1));
#else
          atomicAdd(out + n * 8, x0);
          atomicAdd(out + n * 8 + 1, x1);
#endif
        }
      }
    }
    if constexpr (kDeterministic) {
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) PassTurn(dq_counter);
    }
  }

  // dK (scaled) and dV of this block, from registers to the dtype.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + g + half * 8;
    if (r >= keys) continue;
    const int64_t token = seq.k_start + k0 + r;
    T* dk_row = static_cast<T*>(p.dk) + token * p.dk_token_stride + kv_head * p.dk_head_stride;
    T* dv_row = static_cast<T*>(p.dv) + token * p.dv_token_stride + kv_head * p.dv_head_stride;
#pragma unroll
    for (int n = 0; n < kColTiles; ++n) {
      const int c = col0 + n * 8 + pair;
      const float k_lo = dk[n][half * 2] * p.scale, k_hi = dk[n][half * 2 + 1] * p.scale;
      const float v_lo = dv[n][half * 2], v_hi = dv[n][half * 2 + 1];
      if (aligned_outputs) {
        *reinterpret_cast<uint32_t*>(dk_row + c) = ptx::PackPair<T>(k_lo, k_hi);
        *reinterpret_cast<uint32_t*>(dv_row + c) = ptx::PackPair<T>(v_lo, v_hi);
      } else {
        dk_row[c] = FromFloat<T>(k_lo);
        dk_row[c + 1] = FromFloat<T>(k_hi);
        dv_row[c] = FromFloat<T>(v_lo);
        dv_row[c + 1] = FromFloat<T>(v_hi);
      }
    }
  }
}

}  // namespace attn::cuda::backward
