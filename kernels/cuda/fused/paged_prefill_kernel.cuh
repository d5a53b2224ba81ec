// The paged prefill kernel: the portable fused forward (fused_forward_kernel.cuh) with its K and
// V tiles gathered from pages. Same traits (kernel_traits.h), the same main loop and epilogue:
// one CTA per (kBlockM query rows, head, sequence), tiles walked from the last visible one, V_j
// fetched while S_j is computed and K_{j-1} while the softmax and P V_j run. Only the source of
// a tile's rows differs: a tile of kBlockN keys is a piece of one page when page_tokens >=
// kBlockN (one block-table read), and otherwise spans kBlockN / page_tokens pages, each row
// finding its page (LoadPagedTileAsync).
//
// A loader policy shared with the dense kernel is where this should go next; the dense kernel
// sits at 255 registers, where ptxas follows small changes of its code.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/fused/block_mask.cuh"
#include "cuda/fused/fused_forward_kernel.cuh"
#include "cuda/fused/kernel_traits.h"
#include "cuda/fused/online_softmax.cuh"
#include "cuda/fused/paged_forward.h"
#include "cuda/fused/paged_kv.cuh"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/query_block.cuh"

namespace attn::cuda {

// kOnePage: page_tokens >= kBlockN, so that a tile is a piece of one page.
template <typename Traits, bool kOnePage>
__global__ void __launch_bounds__(Traits::kThreads, 2)
    PagedPrefillKernel(const __grid_constant__ PagedForwardParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr int kPitch = Traits::kRowPitch;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;

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
  const int quad_row = lane / 4;
  const int quad_col = lane % 4;

  extern __shared__ __align__(128) unsigned char smem[];
  Element* sQ = reinterpret_cast<Element*>(smem);
  Element* sK = reinterpret_cast<Element*>(smem + Traits::kQTileBytes);
  Element* sV = reinterpret_cast<Element*>(smem + Traits::kQTileBytes + Traits::kKVTileBytes);

  const Element* q = block.template q<Element>(p);
  const PageWalk<Element> walk(p, blockIdx.z, kv_head);
  const auto load_k = [&](int key0) {
    LoadPagedTileAsync<kOnePage, kBlockN, kHeadDim, kPitch, kThreads>(sK, walk, 0, key0,
                                                                      seq.seqlen_k - key0);
  };
  const auto load_v = [&](int key0) {
    LoadPagedTileAsync<kOnePage, kBlockN, kHeadDim, kPitch, kThreads>(sV, walk, p.v_offset, key0,
                                                                      seq.seqlen_k - key0);
  };

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
    load_k(n_block * kBlockN);
    ptx::CommitAsyncGroup();

    for (; n_block >= n_block_min; --n_block) {
      const int key0 = n_block * kBlockN;
      ptx::WaitAsyncGroups<0>();
      __syncthreads();  // K_j has landed; every warp is done reading V_{j+1}
      load_v(key0);
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
        load_k(key0 - kBlockN);
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
  for (int c = threadIdx.x; c < kBlockM * Traits::kChunksPerRow; c += kThreads) {
    const int row = c / Traits::kChunksPerRow;
    const int col = (c % Traits::kChunksPerRow) * kElemsPerChunk;
    if (row < rows_in_block) {
      *reinterpret_cast<uint4*>(o + row * p.o_token_stride + col) =
          *reinterpret_cast<const uint4*>(sQ + row * kPitch + col);
    }
  }
}

}  // namespace attn::cuda
