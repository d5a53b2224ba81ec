// The fused backward pass: see fused_backward.h for the algorithm. Tensor-core products go
// through WMMA fragments (16 x 16 x 16, float32 accumulation) on tiles held in shared memory;
// compiled for the architectures the project builds (Ampere and Hopper).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "attn/mask.h"
#include "cuda/common/element_convert.cuh"
#include "cuda/fused/fused_backward.h"
#include "cuda/fused/ptx.cuh"

namespace attn::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kBlockQ = 64;    // query rows per tile
constexpr int kBlockK = 64;    // key rows per CTA
constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kPadHalf = 8;  // 16 bytes of padding per shared row: fewer bank conflicts
constexpr int kPadFloat = 4;

constexpr int kStages = 2;  // query tiles in flight: the next one loads while this one runs

template <typename T, int D>
struct SharedTiles {
  T k[kBlockK][D + kPadHalf];
  T v[kBlockK][D + kPadHalf];
  T q[kStages][kBlockQ][D + kPadHalf];
  T d_o[kStages][kBlockQ][D + kPadHalf];
  // S and dP of the current tile, then (once P and dS are formed) its dQ, and at the end dK
  // and dV on their way out.
  union {
    struct {
      float s[kBlockQ][kBlockK + kPadFloat];
      float dp[kBlockQ][kBlockK + kPadFloat];
    } scores;
    float rows[kBlockQ][D + kPadFloat];
  } u;
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

__device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }

struct Sequence {
  int64_t q_start, k_start, lq, lk;
};

__device__ __forceinline__ Sequence SequenceOf(const FusedBackwardParams& p, int b) {
  if (p.cu_seqlens_q != nullptr) {
    const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    return {q0, k0, p.cu_seqlens_q[b + 1] - q0, p.cu_seqlens_k[b + 1] - k0};
  }
  return {b * p.seqlen_q, b * p.seqlen_k, p.seqlen_q, p.seqlen_k};
}

// delta[h, t] = sum_c dO[t, h, c] * O[t, h, c] in float32: one warp per (token, head).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RowDotKernel(const FusedBackwardParams p, float* delta) {
  const int64_t row = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  if (row >= p.total_q * p.num_heads) return;
  const int64_t t = row / p.num_heads;
  const int h = static_cast<int>(row % p.num_heads);
  const T* o = static_cast<const T*>(p.o) + t * p.o_token_stride + h * p.o_head_stride;
  const T* d_o = static_cast<const T*>(p.d_o) + t * p.do_token_stride + h * p.do_head_stride;
  float sum = 0.f;
  for (int c = threadIdx.x % 32; c < p.head_dim; c += 32) sum += ToFloat(o[c]) * ToFloat(d_o[c]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) delta[h * p.total_q + t] = sum;
}

// dq[t, h, c] = accumulator, rounded to the dtype.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    StoreDqKernel(const FusedBackwardParams p, const float* dq_accum) {
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  const int64_t row_elems = int64_t{p.num_heads} * p.head_dim;
  if (i >= p.total_q * row_elems) return;
  const int64_t t = i / row_elems;
  const int h = static_cast<int>((i % row_elems) / p.head_dim);
  const int c = static_cast<int>(i % p.head_dim);
  static_cast<T*>(p.dq)[t * p.dq_token_stride + h * p.dq_head_stride + c] =
      FromFloat<T>(dq_accum[i]);
}

// Two CTAs per SM where their shared memory fits (d <= 64 on Hopper and Ampere's A100): the
// register cap that brings (128 per thread) measured faster than one CTA with more registers.
// dq[r][c] += factor * rows[r][c] for r < valid: four columns per atomic on Hopper (vector
// atomics on global memory are sm_90's), one elsewhere. `dq` is 16-byte aligned and D a
// multiple of 4, so every four-column group is too.
template <int D>
__device__ __forceinline__ void AddDq(float* dq, int64_t row_stride,
                                      const float (*rows)[D + kPadFloat], int64_t valid,
                                      float factor) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kQuads = D / 4;
  for (int i = threadIdx.x; i < valid * kQuads; i += kThreads) {
    const int r = i / kQuads, c = (i % kQuads) * 4;
    const float4 x = *reinterpret_cast<const float4*>(&rows[r][c]);
    atomicAdd(reinterpret_cast<float4*>(dq + r * row_stride + c),
              make_float4(x.x * factor, x.y * factor, x.z * factor, x.w * factor));
  }
#else
  for (int i = threadIdx.x; i < valid * D; i += kThreads) {
    const int r = i / D, c = i % D;
    atomicAdd(dq + r * row_stride + c, rows[r][c] * factor);
  }
#endif
}

constexpr size_t kSharedPerSm = 227 * 1024;  // the opt-in limit per SM on sm_80 and sm_90
template <int D>
constexpr int kMinBlocksPerSm = 2 * (sizeof(SharedTiles<__half, D>) + 1024) <= kSharedPerSm ? 2 : 1;

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<D>)
    BackwardKernel(const FusedBackwardParams p, const float* delta, float* dq_accum,
                   bool aligned_inputs, bool aligned_outputs) {
  extern __shared__ __align__(128) unsigned char shared_raw[];
  auto& sm = *reinterpret_cast<SharedTiles<T, D>*>(shared_raw);
  using ARow = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
  using ACol = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
  using BRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
  using BCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  constexpr int kLdT = D + kPadHalf;
  constexpr int kLdScores = kBlockK + kPadFloat;
  constexpr int kLdProbs = kBlockK + kPadHalf;
  constexpr int kLdRows = D + kPadFloat;
  constexpr int kColTiles = D / 16;
  // dK and dV are (kBlockK / 16) x kColTiles tiles each (as is a query tile's dQ); every warp
  // owns kOwned of them, consecutive in column-major order, so that its tiles mostly share a
  // column and with it the B fragment of their products.
  constexpr int kRowTiles = kBlockK / 16;
  static_assert(kBlockQ == kBlockK, "dQ tiles reuse the dK/dV ownership");
  constexpr int kOwned = kRowTiles * kColTiles / kWarps;
  static_assert(kRowTiles * kColTiles % kWarps == 0, "head_dim must be a multiple of 32");

  const int warp = threadIdx.x / 32;
  const auto owned_row = [&](int j) { return (warp * kOwned + j) % kRowTiles; };
  const auto owned_col = [&](int j) { return (warp * kOwned + j) / kRowTiles; };
  const Sequence seq = SequenceOf(p, blockIdx.z);
  const int64_t k0 = int64_t{blockIdx.x} * kBlockK;
  if (k0 >= seq.lk) return;
  const int64_t keys = Min64(kBlockK, seq.lk - k0);
  const int kv_head = blockIdx.y;

  LoadTile<T, D, kBlockK>(sm.k, static_cast<const T*>(p.k), p.k_token_stride,
                          kv_head * p.k_head_stride, seq.k_start + k0, keys, aligned_inputs);
  LoadTile<T, D, kBlockK>(sm.v, static_cast<const T*>(p.v), p.v_token_stride,
                          kv_head * p.v_head_stride, seq.k_start + k0, keys, aligned_inputs);

  // The query rows whose window can reach this key block (query row i sits at key position
  // i + lk - lq); the mask below trims the rest.
  const int64_t shift = seq.lk - seq.lq;
  int64_t first_row = 0, end_row = seq.lq;
  if (p.window_right >= 0) first_row = Max64(0, k0 - p.window_right - shift);
  if (p.window_left >= 0) end_row = Min64(seq.lq, k0 + keys + p.window_left - shift);

  Acc dk_acc[kOwned], dv_acc[kOwned];
#pragma unroll
  for (int j = 0; j < kOwned; ++j) {
    wmma::fill_fragment(dk_acc[j], 0.f);
    wmma::fill_fragment(dv_acc[j], 0.f);
  }

  // The query tiles this block meets, head by head of its group: tiles_per_head of them from
  // first_i0 on. Tile t + 1's Q, dO, LSE and D load (cp.async) while tile t runs.
  const int group = p.num_heads / p.num_kv_heads;
  const int64_t first_i0 = first_row / kBlockQ * kBlockQ;
  const int64_t tiles_per_head =
      end_row > first_i0 ? (end_row - first_i0 + kBlockQ - 1) / kBlockQ : 0;
  const int64_t tiles = tiles_per_head * group;
  const auto tile_head = [&](int64_t t) {
    return kv_head * group + static_cast<int>(t / tiles_per_head);
  };
  const auto tile_row0 = [&](int64_t t) { return first_i0 + (t % tiles_per_head) * kBlockQ; };
  const auto issue = [&](int64_t t) {
    const int stage = static_cast<int>(t % kStages);
    const int h = tile_head(t);
    const int64_t i0 = tile_row0(t), rows = Min64(kBlockQ, seq.lq - i0);
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
    // Thread r < kBlockQ loads row r's LSE and D; it alone reads them back (visible ranges).
    if (threadIdx.x < kBlockQ) {
      const int r = threadIdx.x;
      const bool in = r < rows;
      const int64_t at = h * p.total_q + seq.q_start + (in ? i0 + r : 0);
      ptx::CopyAsync4(ptx::SharedAddress(&sm.lse[stage][r]), p.lse + at, in);
      ptx::CopyAsync4(ptx::SharedAddress(&sm.delta[stage][r]), delta + at, in);
    }
    ptx::CommitAsyncGroup();
  };
  if (tiles > 0) issue(0);

  for (int64_t t = 0; t < tiles; ++t) {
    const int stage = static_cast<int>(t % kStages);
    const int h = tile_head(t);
    const int64_t i0 = tile_row0(t), rows = Min64(kBlockQ, seq.lq - i0);
    // Tile t - 1's readers of the other stage finished before its dQ went out (the barrier
    // there), so the next tile may land in it now.
    if (t + 1 < tiles) {
      issue(t + 1);
      ptx::WaitAsyncGroups<1>();
    } else {
      ptx::WaitAsyncGroups<0>();
    }
    if (threadIdx.x < kBlockQ) {
      const int r = threadIdx.x;
      int begin = 0, end = 0;
      if (r < rows && sm.lse[stage][r] != -INFINITY) {
        const KeyRange visible = VisibleKeys(i0 + r, seq.lq, seq.lk, p.window_left, p.window_right);
        begin = static_cast<int>(Min64(Max64(visible.begin - k0, 0), keys));
        end = static_cast<int>(Min64(Max64(visible.end - k0, 0), keys));
      }
      sm.visible_begin[r] = begin;
      sm.visible_end[r] = end;
    }
    __syncthreads();  // this tile's Q, dO, LSE, D and ranges are in; last tile's dQ is out
    const auto& tq = sm.q[stage];
    const auto& tdo = sm.d_o[stage];

    // S = Q K^T and dP = dO V^T, 4 x 4 tiles each: a warp takes two tiles of one row, so
    // each step loads its A fragment once for both.
    static_assert((kBlockQ / 16) * (kBlockK / 16) == 2 * kWarps, "two score tiles per warp");
    {
      const int tr = warp / 2, tc0 = (warp % 2) * 2;
      Acc s[2], dp[2];
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        wmma::fill_fragment(s[x], 0.f);
        wmma::fill_fragment(dp[x], 0.f);
      }
#pragma unroll
      for (int kk = 0; kk < D; kk += 16) {
        ARow a;
        BCol b;  // column-major view of a row-major [keys, D] tile: its transpose
        wmma::load_matrix_sync(a, &tq[tr * 16][kk], kLdT);
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          wmma::load_matrix_sync(b, &sm.k[(tc0 + x) * 16][kk], kLdT);
          wmma::mma_sync(s[x], a, b, s[x]);
        }
        wmma::load_matrix_sync(a, &tdo[tr * 16][kk], kLdT);
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          wmma::load_matrix_sync(b, &sm.v[(tc0 + x) * 16][kk], kLdT);
          wmma::mma_sync(dp[x], a, b, dp[x]);
        }
      }
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        wmma::store_matrix_sync(&sm.u.scores.s[tr * 16][(tc0 + x) * 16], s[x], kLdScores,
                                wmma::mem_row_major);
        wmma::store_matrix_sync(&sm.u.scores.dp[tr * 16][(tc0 + x) * 16], dp[x], kLdScores,
                                wmma::mem_row_major);
      }
    }
    __syncthreads();

    // P = exp(scale * S - LSE) on visible keys, dS = P * (dP - D); two columns a step.
    for (int i = threadIdx.x; i < kBlockQ * kBlockK / 2; i += kThreads) {
      const int r = i / (kBlockK / 2), c = (i % (kBlockK / 2)) * 2;
      const float lse = sm.lse[stage][r], row_delta = sm.delta[stage][r];
      const int begin = sm.visible_begin[r], end = sm.visible_end[r];
      const float2 score = *reinterpret_cast<const float2*>(&sm.u.scores.s[r][c]);
      const float2 dprob = *reinterpret_cast<const float2*>(&sm.u.scores.dp[r][c]);
      const float p0 = c >= begin && c < end ? __expf(fmaf(score.x, p.scale, -lse)) : 0.f;
      const float p1 = c + 1 >= begin && c + 1 < end ? __expf(fmaf(score.y, p.scale, -lse)) : 0.f;
      sm.p[r][c] = FromFloat<T>(p0);
      sm.p[r][c + 1] = FromFloat<T>(p1);
      sm.ds[r][c] = FromFloat<T>(p0 * (dprob.x - row_delta));
      sm.ds[r][c + 1] = FromFloat<T>(p1 * (dprob.y - row_delta));
    }
    __syncthreads();

    // dV += P^T dO and dK += dS^T Q (dS^T Q is scaled once, at the end). A warp's tiles share
    // their column, so the B fragments (dO, Q) load once per step for all of them.
#pragma unroll
    for (int kk = 0; kk < kBlockQ; kk += 16) {
      BRow b_do, b_q;
      int loaded_col = -1;
#pragma unroll
      for (int j = 0; j < kOwned; ++j) {
        const int tr = owned_row(j), tc = owned_col(j);
        if (tc != loaded_col) {
          wmma::load_matrix_sync(b_do, &tdo[kk][tc * 16], kLdT);
          wmma::load_matrix_sync(b_q, &tq[kk][tc * 16], kLdT);
          loaded_col = tc;
        }
        ACol a;  // column-major view of the row-major [queries, keys] tile: its transpose
        wmma::load_matrix_sync(a, &sm.p[kk][tr * 16], kLdProbs);
        wmma::mma_sync(dv_acc[j], a, b_do, dv_acc[j]);
        wmma::load_matrix_sync(a, &sm.ds[kk][tr * 16], kLdProbs);
        wmma::mma_sync(dk_acc[j], a, b_q, dk_acc[j]);
      }
    }
    // This tile's dQ = dS K, staged where S and dP were, then added to the accumulator.
    {
      Acc dq[kOwned];
#pragma unroll
      for (int j = 0; j < kOwned; ++j) wmma::fill_fragment(dq[j], 0.f);
#pragma unroll
      for (int kk = 0; kk < kBlockK; kk += 16) {
        BRow b;
        int loaded_col = -1;
#pragma unroll
        for (int j = 0; j < kOwned; ++j) {
          const int tr = owned_row(j), tc = owned_col(j);
          if (tc != loaded_col) {
            wmma::load_matrix_sync(b, &sm.k[kk][tc * 16], kLdT);
            loaded_col = tc;
          }
          ARow a;
          wmma::load_matrix_sync(a, &sm.ds[tr * 16][kk], kLdProbs);
          wmma::mma_sync(dq[j], a, b, dq[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kOwned; ++j) {
        wmma::store_matrix_sync(&sm.u.rows[owned_row(j) * 16][owned_col(j) * 16], dq[j], kLdRows,
                                wmma::mem_row_major);
      }
    }
    __syncthreads();
    AddDq<D>(dq_accum + ((seq.q_start + i0) * p.num_heads + h) * D, int64_t{p.num_heads} * D,
             sm.u.rows, rows, p.scale);
  }

  // dK (scaled) and dV of this block, through shared memory to the dtype.
  for (int pass = 0; pass < 2; ++pass) {
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kOwned; ++j) {
      wmma::store_matrix_sync(&sm.u.rows[owned_row(j) * 16][owned_col(j) * 16],
                              pass == 0 ? dk_acc[j] : dv_acc[j], kLdRows, wmma::mem_row_major);
    }
    __syncthreads();
    T* out = static_cast<T*>(pass == 0 ? p.dk : p.dv);
    const int64_t token_stride = pass == 0 ? p.dk_token_stride : p.dv_token_stride;
    const int64_t head_offset = kv_head * (pass == 0 ? p.dk_head_stride : p.dv_head_stride);
    const float factor = pass == 0 ? p.scale : 1.f;
    constexpr int kChunks = D / 8;
    for (int i = threadIdx.x; i < keys * kChunks; i += kThreads) {
      const int r = i / kChunks, c = (i % kChunks) * 8;
      alignas(16) T values[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) values[e] = FromFloat<T>(sm.u.rows[r][c + e] * factor);
      T* dst = out + (seq.k_start + k0 + r) * token_stride + head_offset + c;
      if (aligned_outputs) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(values);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = values[e];
      }
    }
  }
}

// The workspace holds D, padded to 16 bytes so that the dQ accumulator after it takes vector
// atomics, then the accumulator.
int64_t DeltaFloats(int64_t rows) { return (rows + 3) / 4 * 4; }

bool Aligned16(const void* data, int64_t token_stride, int64_t head_stride) {
  constexpr int64_t kElemsPer16Bytes = 8;  // 16-bit elements
  return reinterpret_cast<uintptr_t>(data) % 16 == 0 && token_stride % kElemsPer16Bytes == 0 &&
         head_stride % kElemsPer16Bytes == 0;
}

template <typename T, int D>
cudaError_t Run(const FusedBackwardParams& p, cudaStream_t stream) {
  float* delta = static_cast<float*>(p.workspace);
  float* dq_accum = delta + DeltaFloats(p.num_heads * p.total_q);
  const int64_t accum_elems = p.total_q * p.num_heads * D;
  if (cudaError_t e = cudaMemsetAsync(dq_accum, 0, accum_elems * sizeof(float), stream);
      e != cudaSuccess) {
    return e;
  }
  const int64_t rows = p.total_q * p.num_heads;
  if (rows > 0) {
    RowDotKernel<T>
        <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(p, delta);
  }

  const bool aligned_inputs = Aligned16(p.q, p.q_token_stride, p.q_head_stride) &&
                              Aligned16(p.k, p.k_token_stride, p.k_head_stride) &&
                              Aligned16(p.v, p.v_token_stride, p.v_head_stride) &&
                              Aligned16(p.d_o, p.do_token_stride, p.do_head_stride);
  const bool aligned_outputs = Aligned16(p.dk, p.dk_token_stride, p.dk_head_stride) &&
                               Aligned16(p.dv, p.dv_token_stride, p.dv_head_stride);
  const size_t shared = sizeof(SharedTiles<T, D>);
  auto* kernel = &BackwardKernel<T, D>;
  if (cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
      e != cudaSuccess) {
    return e;
  }
  const dim3 grid(static_cast<unsigned>((p.max_seqlen_k + kBlockK - 1) / kBlockK),
                  static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(p.batch));
  if (grid.x > 0 && grid.y > 0 && grid.z > 0) {
    kernel<<<grid, kThreads, shared, stream>>>(p, delta, dq_accum, aligned_inputs, aligned_outputs);
  }
  if (accum_elems > 0) {
    StoreDqKernel<T>
        <<<static_cast<unsigned>((accum_elems + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
            p, dq_accum);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t DispatchHeadDim(const FusedBackwardParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32:
      return Run<T, 32>(p, stream);
    case 64:
      return Run<T, 64>(p, stream);
    case 96:
      return Run<T, 96>(p, stream);
    case 128:
      return Run<T, 128>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

absl::Status FusedBackwardSupports(const AttentionProblem& p) {
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) {
    return absl::UnimplementedError(absl::StrCat("cuda_fused: backward dtype ",
                                                 std::string(DTypeName(p.dtype)),
                                                 " is not covered (float16 and bfloat16 are)"));
  }
  if (p.head_dim != 32 && p.head_dim != 64 && p.head_dim != 96 && p.head_dim != 128) {
    return absl::UnimplementedError(absl::StrCat("cuda_fused: backward head_dim ", p.head_dim,
                                                 " is not covered (32, 64, 96, 128 are)"));
  }
  if (p.batch() > 65535 || p.num_kv_heads > 65535) {
    return absl::UnimplementedError("cuda_fused: backward needs batch and num_kv_heads <= 65535");
  }
  return absl::OkStatus();
}

int64_t FusedBackwardWorkspaceBytes(const AttentionProblem& p) {
  const int64_t rows = p.total_q() * p.num_heads;
  return (DeltaFloats(rows) + rows * p.head_dim) * static_cast<int64_t>(sizeof(float));
}

absl::Status LaunchFusedBackward(const FusedBackwardParams& p, void* stream) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError("cuda_fused: num_heads must be a multiple of num_kv_heads");
  }
  if (p.total_q == 0 && p.max_seqlen_k == 0) return absl::OkStatus();
  auto* s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaErrorInvalidValue;
  if (p.dtype == DType::kF16) {
    err = DispatchHeadDim<__half>(p, s);
  } else if (p.dtype == DType::kBF16) {
    err = DispatchHeadDim<__nv_bfloat16>(p, s);
  }
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cuda_fused: backward launch failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace attn::cuda
