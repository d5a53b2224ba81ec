// The lockstep paged prefill kernel for Hopper (sm_90a): the wgmma fused forward
// (fused_forward_sm90_kernel.cuh) with its K and V tiles gathered from pages, the same traits,
// main loop and epilogue: two warpgroups of 64 query rows, K/V tiles double-buffered in the
// 128-byte-swizzled layout wgmma reads, S = Q K^T and P V on warpgroup MMA with P from
// registers. Only the rows' source differs: a tile is a piece of one page when page_tokens >=
// kBlockN (one block-table read), and otherwise each row finds its page. It runs where the
// warp-specialised paged prefill (paged_tma_source.cuh) cannot: pages of fewer than 8 tokens,
// tensors the copy engine cannot address.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/fused/block_mask.cuh"
#include "cuda/fused/fused_forward_sm90_kernel.cuh"
#include "cuda/fused/online_softmax.cuh"
#include "cuda/fused/paged_forward.h"
#include "cuda/fused/paged_kv.cuh"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/query_block.cuh"
#include "cuda/fused/wgmma.cuh"

namespace attn::cuda {

// Copies key rows [key0, key0 + kTileRows) of one block of the pages into a swizzled shared
// tile (wgmma::SwizzledByteOffset), rows past `rows` zero-filled; as LoadPagedTileAsync.
template <bool kOnePage, int kTileRows, int kHeadDim, int kThreads, typename Element>
__device__ __forceinline__ void LoadPagedSwizzledTileAsync(unsigned char* tile,
                                                           const PageWalk<Element>& walk,
                                                           int64_t block_offset, int key0,
                                                           int rows) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kChunks = kTileRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "whole passes over the tile");
  const Element* base = walk.pages;
  if (kOnePage && rows > 0) base = walk.KeyRow(key0) + block_offset;
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int row = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    const bool valid = row < rows;
    const Element* from = walk.pages;
    if (valid) {
      from = (kOnePage ? base + row * walk.token_stride : walk.KeyRow(key0 + row) + block_offset) +
             col;
    }
    ptx::CopyAsync16(ptx::SharedAddress(tile + wgmma::SwizzledByteOffset(row, col, kTileRows)),
                     from, valid);
  }
}

// kOnePage: page_tokens >= kBlockN, so that a tile is a piece of one page.
template <typename Traits, bool kOnePage>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kCtasPerSm)
    PagedPrefillSm90Kernel(const __grid_constant__ PagedForwardParams p) {
#ifdef ATTN_WGMMA_AVAILABLE
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kDTiles = Traits::kDTiles;
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

  const int warp_group = threadIdx.x / 128;
  const int warp = (threadIdx.x % 128) / 32;  // within the warpgroup: owns 16 of its 64 rows
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;
  const int quad_col = lane % 4;
  const int local_row = warp_group * 64 + warp * 16 + quad_row;  // + 8 for the second row
  const int thread_row_pos = row0 + local_row + mask.shift;

  extern __shared__ __align__(1024) unsigned char swizzled_smem[];
  unsigned char* sQ = swizzled_smem;
  unsigned char* sK = sQ + Traits::kQTileBytes;                             // 2 stages
  unsigned char* sV = sQ + Traits::kQTileBytes + 2 * Traits::kKVTileBytes;  // 2 stages

  const Element* q = block.template q<Element>(p);
  const PageWalk<Element> walk(p, blockIdx.z, kv_head);
  auto load_kv = [&](int n_block, int stage) {
    const int key0 = n_block * kBlockN;
    LoadPagedSwizzledTileAsync<kOnePage, kBlockN, kHeadDim, kThreads>(
        sK + stage * Traits::kKVTileBytes, walk, 0, key0, seq.seqlen_k - key0);
    LoadPagedSwizzledTileAsync<kOnePage, kBlockN, kHeadDim, kThreads>(
        sV + stage * Traits::kKVTileBytes, walk, p.v_offset, key0, seq.seqlen_k - key0);
  };

  float acc[1][kDTiles][4];
#pragma unroll
  for (int dj = 0; dj < kDTiles; ++dj)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][dj][e] = 0.f;
  OnlineSoftmax<1, kNTiles, kDTiles> softmax;
  softmax.Init();
  const float scale_log2 = p.scale * static_cast<float>(M_LOG2E);
  const Element element_tag{};

  const uint32_t q_smem = ptx::SharedAddress(sQ) + warp_group * 64 * 128;
  const uint32_t k_smem = ptx::SharedAddress(sK);
  const uint32_t v_smem = ptx::SharedAddress(sV);

  const int num_tiles = n_block_max - n_block_min;
  if (num_tiles > 0) {
    LoadSwizzledTileAsync<kBlockM, kHeadDim, kThreads>(sQ, q, p.q_token_stride, rows_in_block);
    load_kv(n_block_max - 1, 0);
    ptx::CommitAsyncGroup();

    for (int it = 0; it < num_tiles; ++it) {
      const int n_block = n_block_max - 1 - it;
      const int key0 = n_block * kBlockN;
      const int stage = it % 2;
      ptx::WaitAsyncGroups<0>();
      wgmma::FenceSharedForAsyncProxy();  // cp.async wrote the tiles wgmma reads next
      __syncthreads();  // tile j has landed; both warpgroups are done with tile j + 1's stage
      if (it + 1 < num_tiles) {
        load_kv(n_block - 1, 1 - stage);
        ptx::CommitAsyncGroup();
      }

      // S = Q K^T over head_dim in k-steps of 16 (32 bytes inside a 128-byte swizzled row).
      float s[1][kNTiles][4];
      auto& s_flat = reinterpret_cast<float(&)[kBlockN / 2]>(s[0]);
      const uint32_t k_stage = k_smem + stage * Traits::kKVTileBytes;
      wgmma::Fence();
      const uint64_t q_desc = wgmma::MakeDescriptor(q_smem, 0);
      const uint64_t k_desc = wgmma::MakeDescriptor(k_stage, 0);
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        const uint32_t column = (ks % 4) * 32;  // k-step within the 64-column block
        const uint64_t desc_q = wgmma::DescriptorPlus(q_desc, (ks / 4) * kBlockM * 128 + column);
        const uint64_t desc_k = wgmma::DescriptorPlus(k_desc, (ks / 4) * kBlockN * 128 + column);
        if constexpr (kBlockN == 128) {
          wgmma::MmaSS_128(s_flat, desc_q, desc_k, ks > 0, element_tag);
        } else {
          wgmma::MmaSS_64(s_flat, desc_q, desc_k, ks > 0, element_tag);
        }
      }
      wgmma::CommitGroup();
      wgmma::WaitGroup<0>();

      if (mask.TileNeedsMask(key0)) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const RowKeys keys = mask.Row(thread_row_pos + half * 8);
#pragma unroll
          for (int nj = 0; nj < kNTiles; ++nj)
#pragma unroll
            for (int e = 2 * half; e < 2 * half + 2; ++e) {
              const int key = key0 + nj * 8 + quad_col * 2 + (e & 1);
              if (key < keys.begin || key >= keys.end) s[0][nj][e] = -INFINITY;
            }
        }
      }

      softmax.Update(s, acc, scale_log2);

      // acc += P V: P packed to 16 bits as the register A operand (all of it before the fence,
      // so no register feeding a wgmma changes between the fence and the last MMA), V MN-major
      // from shared memory.
      uint32_t p_frag[kBlockN / 16][4];
#pragma unroll
      for (int ps = 0; ps < kBlockN / 16; ++ps) {
        p_frag[ps][0] = ptx::PackPair<Element>(s[0][2 * ps][0], s[0][2 * ps][1]);
        p_frag[ps][1] = ptx::PackPair<Element>(s[0][2 * ps][2], s[0][2 * ps][3]);
        p_frag[ps][2] = ptx::PackPair<Element>(s[0][2 * ps + 1][0], s[0][2 * ps + 1][1]);
        p_frag[ps][3] = ptx::PackPair<Element>(s[0][2 * ps + 1][2], s[0][2 * ps + 1][3]);
      }
      auto& acc_flat = reinterpret_cast<float(&)[kHeadDim / 2]>(acc[0]);
      const uint32_t v_stage = v_smem + stage * Traits::kKVTileBytes;
      wgmma::Fence();
      const uint64_t v_desc = wgmma::MakeDescriptor(v_stage, Traits::kBlockN * 128);
#pragma unroll
      for (int ps = 0; ps < kBlockN / 16; ++ps) {
        const uint64_t desc_v = wgmma::DescriptorPlus(v_desc, ps * 16 * 128);
        if constexpr (kHeadDim == 128) {
          wgmma::MmaRS_128(acc_flat, p_frag[ps], desc_v, element_tag);
        } else {
          wgmma::MmaRS_64(acc_flat, p_frag[ps], desc_v, element_tag);
        }
      }
      wgmma::CommitGroup();
      wgmma::WaitGroup<0>();  // acc is rescaled and V's stage refilled next iteration
    }
  }

  // Epilogue: O = acc / l (0 for rows that saw no key), staged through the Q tile.
  __syncthreads();
  float* lse = block.lse(p);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float l = QuadSum(softmax.l[half]);
    const float inv_l = InverseRowSum(l);
    const int row = local_row + half * 8;
#pragma unroll
    for (int dj = 0; dj < kDTiles; ++dj) {
      const int col = dj * 8 + quad_col * 2;
      *reinterpret_cast<uint32_t*>(sQ + wgmma::SwizzledByteOffset(row, col, kBlockM)) =
          ptx::PackPair<Element>(acc[0][dj][2 * half] * inv_l, acc[0][dj][2 * half + 1] * inv_l);
    }
    if (lse != nullptr && quad_col == 0 && row < rows_in_block) {
      lse[row] = RowLse(softmax.m[half], l, p.scale);
    }
  }
  __syncthreads();
  Element* o = static_cast<Element*>(p.o) + (seq.q_start + row0) * p.o_token_stride +
               block.head * p.o_head_stride;
  constexpr int kChunksPerRow = kHeadDim / 8;
#pragma unroll
  for (int i = 0; i < kBlockM * kChunksPerRow / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int row = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    if (row < rows_in_block) {
      *reinterpret_cast<uint4*>(o + row * p.o_token_stride + col) =
          *reinterpret_cast<const uint4*>(sQ + wgmma::SwizzledByteOffset(row, col, kBlockM));
    }
  }
#endif  // ATTN_WGMMA_AVAILABLE
}

}  // namespace attn::cuda
