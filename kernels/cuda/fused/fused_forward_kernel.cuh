// The fused attention forward kernel: FlashAttention's IO-aware tiling with online softmax.
//
// One CTA owns kBlockM query rows of one (sequence, head). Q is loaded to shared memory once;
// K and V tiles of kBlockN keys stream through one shared buffer each, walking from the last
// visible tile to the first so that the tiles needing a mask (sequence tail, causal diagonal,
// window edges) come first. Each warp owns kRowsPerWarp whole rows, so row statistics never
// leave a warp. Per tile:
//   S = Q K^T (tensor cores, fp32)  ->  mask  ->  online softmax (m, l, alpha, P)  ->
//   acc = acc * alpha + P V  (P reused from the S registers as the A operand).
// Loads overlap compute as in FlashAttention-2: V_j is fetched while S_j is computed, K_{j-1}
// while the softmax and P V_j run. At the end O = acc / l goes out through shared memory in
// 16-byte stores, and LSE = m * scale + log(l). S and P never touch device memory.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/fused/block_mask.cuh"
#include "cuda/fused/fused_forward.h"
#include "cuda/fused/kernel_traits.h"
#include "cuda/fused/online_softmax.cuh"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/query_block.cuh"

namespace attn::cuda {

// Copies `rows` valid rows (of kTileRows) of a [token, head, dim] tensor into a padded shared
// tile with 16-byte asynchronous copies; rows past `rows` are zero-filled.
template <typename Traits, int kTileRows>
__device__ __forceinline__ void LoadTileAsync(typename Traits::Element* tile,
                                              const typename Traits::Element* src,
                                              int64_t token_stride, int rows) {
  constexpr int kChunks = kTileRows * Traits::kChunksPerRow;
  constexpr int kElemsPerChunk = 16 / sizeof(typename Traits::Element);
#pragma unroll
  for (int c = threadIdx.x; c < kChunks; c += Traits::kThreads) {
    const int row = c / Traits::kChunksPerRow;
    const int col = (c % Traits::kChunksPerRow) * kElemsPerChunk;
    const bool valid = row < rows;
    const auto* from = valid ? src + row * token_stride + col : src;
    ptx::CopyAsync16(ptx::SharedAddress(tile + row * Traits::kRowPitch + col), from, valid);
  }
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 2)
    FusedForwardKernel(const __grid_constant__ FusedForwardParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr int kPitch = Traits::kRowPitch;

  const QueryBlock<kBlockM> block(p);
  if (block.empty()) return;
  const SequenceView<int>& seq = block.seq;
  const int row0 = block.row0;
  const int rows_in_block = block.rows();
  const int kv_head = block.kv_head(p);

  const BlockMask<kBlockN> mask(p, seq, row0, rows_in_block);
  const int n_block_min = mask.n_block_min;
  const int n_block_max = mask.n_block_max;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;  // row within an 8-row half of an MMA tile
  const int quad_col = lane % 4;  // column pair within an 8-column MMA tile

  extern __shared__ __align__(128) unsigned char smem[];
  Element* sQ = reinterpret_cast<Element*>(smem);
  Element* sK = reinterpret_cast<Element*>(smem + Traits::kQTileBytes);
  Element* sV = reinterpret_cast<Element*>(smem + Traits::kQTileBytes + Traits::kKVTileBytes);

  const Element* q = block.template q<Element>(p);
  const Element* k = block.template k<Element>(p, kv_head);
  const Element* v = block.template v<Element>(p, kv_head);

  // The visible key range of each of the 2 * kMTiles rows this thread holds.
  RowKeys row_keys[2 * kMTiles];
#pragma unroll
  for (int r = 0; r < 2 * kMTiles; ++r) {
    const int row = row0 + warp * Traits::kRowsPerWarp + (r / 2) * 16 + (r % 2) * 8 + quad_row;
    row_keys[r] = mask.Row(row + mask.shift);
  }

  float acc[kMTiles][kDTiles][4];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int dj = 0; dj < kDTiles; ++dj)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][dj][e] = 0.f;
  OnlineSoftmax<kMTiles, kNTiles, kDTiles> softmax;
  softmax.Init();
  const float scale_log2 = p.scale * static_cast<float>(M_LOG2E);

  // ldmatrix row addresses of this lane (see ptx.cuh for the fragment layouts).
  const uint32_t q_frag_base = ptx::SharedAddress(
      sQ + (warp * Traits::kRowsPerWarp + (lane & 15)) * kPitch + (lane >> 4) * 8);
  const uint32_t k_frag_base =
      ptx::SharedAddress(sK + ((lane & 7) + (lane >> 4) * 8) * kPitch + ((lane >> 3) & 1) * 8);
  const uint32_t v_frag_base =
      ptx::SharedAddress(sV + ((lane & 7) + ((lane >> 3) & 1) * 8) * kPitch + (lane >> 4) * 8);
  constexpr uint32_t kElemBytes = sizeof(Element);

  if (n_block_max > n_block_min) {
    LoadTileAsync<Traits, kBlockM>(sQ, q, p.q_token_stride, rows_in_block);
    int n_block = n_block_max - 1;
    LoadTileAsync<Traits, kBlockN>(sK,
                                   k + static_cast<int64_t>(n_block) * kBlockN * p.k_token_stride,
                                   p.k_token_stride, seq.seqlen_k - n_block * kBlockN);
    ptx::CommitAsyncGroup();

    for (; n_block >= n_block_min; --n_block) {
      const int key0 = n_block * kBlockN;
      ptx::WaitAsyncGroups<0>();
      __syncthreads();  // K_j has landed; every warp is done reading V_{j+1}
      LoadTileAsync<Traits, kBlockN>(sV, v + static_cast<int64_t>(key0) * p.v_token_stride,
                                     p.v_token_stride, seq.seqlen_k - key0);
      ptx::CommitAsyncGroup();

      // S = Q K^T
      float s[kMTiles][kNTiles][4];
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int nj = 0; nj < kNTiles; ++nj)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][nj][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < Traits::kKSteps; ++ks) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          ptx::LoadMatrixX4(a[mi], q_frag_base + (mi * 16 * kPitch + ks * 16) * kElemBytes);
        }
#pragma unroll
        for (int nj = 0; nj < kNTiles; nj += 2) {
          uint32_t b[4];
          ptx::LoadMatrixX4(b, k_frag_base + (nj * 8 * kPitch + ks * 16) * kElemBytes);
#pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
            ptx::Mma16816<Element>(s[mi][nj], a[mi], b[0], b[1]);
            ptx::Mma16816<Element>(s[mi][nj + 1], a[mi], b[2], b[3]);
          }
        }
      }

      if (mask.TileNeedsMask(key0)) {
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
          for (int nj = 0; nj < kNTiles; ++nj)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const RowKeys& keys = row_keys[mi * 2 + e / 2];
              const int key = key0 + nj * 8 + quad_col * 2 + (e & 1);
              if (key < keys.begin || key >= keys.end) s[mi][nj][e] = -INFINITY;
            }
      }

      ptx::WaitAsyncGroups<0>();
      __syncthreads();  // V_j has landed; every warp is done reading K_j
      if (n_block > n_block_min) {
        LoadTileAsync<Traits, kBlockN>(sK,
                                       k + static_cast<int64_t>(key0 - kBlockN) * p.k_token_stride,
                                       p.k_token_stride, kBlockN);
        ptx::CommitAsyncGroup();
      }

      softmax.Update(s, acc, scale_log2);

      // acc += P V, P taken straight from the score registers as the A operand.
#pragma unroll
      for (int ps = 0; ps < Traits::kPSteps; ++ps) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          a[mi][0] = ptx::PackPair<Element>(s[mi][2 * ps][0], s[mi][2 * ps][1]);
          a[mi][1] = ptx::PackPair<Element>(s[mi][2 * ps][2], s[mi][2 * ps][3]);
          a[mi][2] = ptx::PackPair<Element>(s[mi][2 * ps + 1][0], s[mi][2 * ps + 1][1]);
          a[mi][3] = ptx::PackPair<Element>(s[mi][2 * ps + 1][2], s[mi][2 * ps + 1][3]);
        }
#pragma unroll
        for (int dj = 0; dj < kDTiles; dj += 2) {
          uint32_t b[4];
          ptx::LoadMatrixX4Transposed(b, v_frag_base + (ps * 16 * kPitch + dj * 8) * kElemBytes);
#pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
            ptx::Mma16816<Element>(acc[mi][dj], a[mi], b[0], b[1]);
            ptx::Mma16816<Element>(acc[mi][dj + 1], a[mi], b[2], b[3]);
          }
        }
      }
    }
  }

  // Epilogue: O = acc / l (0 for rows that saw no key), staged through the Q tile.
  __syncthreads();  // every warp is done with sQ and sV
  float* lse = block.lse(p);
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mi * 2 + half;
      const float l = QuadSum(softmax.l[r]);
      const float inv_l = InverseRowSum(l);
      const int local_row = warp * Traits::kRowsPerWarp + mi * 16 + half * 8 + quad_row;
#pragma unroll
      for (int dj = 0; dj < kDTiles; ++dj) {
        *reinterpret_cast<uint32_t*>(sQ + local_row * kPitch + dj * 8 + quad_col * 2) =
            ptx::PackPair<Element>(acc[mi][dj][2 * half] * inv_l,
                                   acc[mi][dj][2 * half + 1] * inv_l);
      }
      if (lse != nullptr && quad_col == 0 && local_row < rows_in_block) {
        lse[local_row] = RowLse(softmax.m[r], l, p.scale);
      }
    }
  }
  __syncthreads();
  Element* o = static_cast<Element*>(p.o) + (seq.q_start + row0) * p.o_token_stride +
               block.head * p.o_head_stride;
  constexpr int kElemsPerChunk = 16 / sizeof(Element);
#pragma unroll
  for (int c = threadIdx.x; c < kBlockM * Traits::kChunksPerRow; c += Traits::kThreads) {
    const int row = c / Traits::kChunksPerRow;
    const int col = (c % Traits::kChunksPerRow) * kElemsPerChunk;
    if (row < rows_in_block) {
      *reinterpret_cast<uint4*>(o + row * p.o_token_stride + col) =
          *reinterpret_cast<const uint4*>(sQ + row * kPitch + col);
    }
  }
}

}  // namespace attn::cuda
