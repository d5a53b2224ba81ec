// The fused attention forward kernel for Hopper (sm_90a): the same algorithm as
// fused_forward_kernel.cuh, with the two matrix products on warpgroup MMA (wgmma).
//
// A CTA owns kBlockM = 128 query rows of one (sequence, head) and runs two warpgroups of 64
// rows each. Q, K and V tiles live in shared memory in the 128-byte-swizzled layout wgmma reads
// directly (wgmma.cuh); K/V tiles are double-buffered, tile j - 1 loading with asynchronous
// copies while tile j is computed. Per tile and warpgroup:
//   S = Q K^T          wgmma, A = Q and B = K from shared memory, fp32 accumulators
//   mask, online softmax (m, l, alpha, P) on the accumulators
//   acc = acc * alpha + P V   wgmma, A = P straight from registers, B = V (MN-major)
// S and P never leave registers. O = acc / l and LSE = m * scale + log(l) close the block.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/fused/fused_forward.h"
#include "cuda/fused/fused_forward_kernel.cuh"
#include "cuda/fused/online_softmax.cuh"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/query_block.cuh"
#include "cuda/fused/wgmma.cuh"

namespace attn::cuda {

template <typename Element_, int kHeadDim_, int kBlockN_, int kCtasPerSm_ = 1>
struct FusedForwardSm90Traits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarpGroups = 2;
  static constexpr int kBlockM = 64 * kWarpGroups;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kThreads = 128 * kWarpGroups;
  // Two resident CTAs let one CTA's softmax overlap the other's MMAs, at 128 registers a thread.
  static constexpr int kCtasPerSm = kCtasPerSm_;
  static constexpr int kNTiles = kBlockN / 8;   // 8-key column tiles of S per thread row pair
  static constexpr int kDTiles = kHeadDim / 8;  // 8-column tiles of O
  static constexpr int kQTileBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVTileBytes = kBlockN * kHeadDim * 2;
  // Q (reused for the O epilogue), two stages of K, two stages of V; every tile 1024-byte
  // aligned, as the 128-byte swizzle requires.
  static constexpr int kSmemBytes = kQTileBytes + 4 * kKVTileBytes;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "wgmma path covers head_dim 64 and 128");
  static_assert(kBlockN == 64 || kBlockN == 128, "S tiles are m64n64 or m64n128");
  static_assert(sizeof(Element) == 2, "16-bit storage");
};

// Copies `rows` valid rows (of kTileRows) of a [token, head, dim] tensor into a swizzled
// shared tile; rows past `rows` are zero-filled.
template <int kTileRows, int kHeadDim, int kThreads, typename Element>
__device__ __forceinline__ void LoadSwizzledTileAsync(unsigned char* tile, const Element* src,
                                                      int64_t token_stride, int rows) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kChunks = kTileRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "whole passes over the tile");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int row = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    const bool valid = row < rows;
    const Element* from = valid ? src + row * token_stride + col : src;
    ptx::CopyAsync16(ptx::SharedAddress(tile + wgmma::SwizzledByteOffset(row, col, kTileRows)),
                     from, valid);
  }
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kCtasPerSm)
    FusedForwardSm90Kernel(const __grid_constant__ FusedForwardParams p) {
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
  const Element* k = block.template k<Element>(p, kv_head);
  const Element* v = block.template v<Element>(p, kv_head);
  auto load_kv = [&](int n_block, int stage) {
    const int key0 = n_block * kBlockN;
    LoadSwizzledTileAsync<kBlockN, kHeadDim, kThreads>(
        sK + stage * Traits::kKVTileBytes, k + static_cast<int64_t>(key0) * p.k_token_stride,
        p.k_token_stride, seq.seqlen_k - key0);
    LoadSwizzledTileAsync<kBlockN, kHeadDim, kThreads>(
        sV + stage * Traits::kKVTileBytes, v + static_cast<int64_t>(key0) * p.v_token_stride,
        p.v_token_stride, seq.seqlen_k - key0);
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
