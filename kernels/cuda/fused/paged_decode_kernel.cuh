// The paged decode kernel: few query rows per sequence over a long paged K/V, bound by reading
// the K/V once.
//
// One CTA per (16 packed query rows, KV head, split, sequence). The rows are the query heads
// that share the KV head times the sequence's query tokens (GQA packing: packed row i is token
// i / group of query head kv_head * group + i % group), so each page is read once per group.
// The CTA walks the key stages of its split (split-KV: PagedForwardPlan::tiles_per_split stages
// each), kStages deep: cp.async copies stage j + kStages - 1 from the pages while stage j is
// computed. Every warp takes a quarter of each stage's keys for all 16 rows and keeps its own
// online-softmax state (m, l, acc); per stage and warp:
//   S = Q K^T (mma.sync, fp32)  ->  mask  ->  m_new, alpha, P  ->  acc = acc * alpha + P V.
// At the end the four warps' states merge in shared memory by the same rule,
//   m = max_w m_w,  l = sum_w exp(m_w - m) l_w,  acc = sum_w exp(m_w - m) acc_w,
// and the CTA writes O = acc / l and LSE = m * scale + log(l); with several splits it writes the
// float32 partial O and its LSE instead, and the tile's last split to finish merges them all
// (paged_combine.cuh).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/fused/block_mask.cuh"
#include "cuda/fused/online_softmax.cuh"
#include "cuda/fused/paged_combine.cuh"
#include "cuda/fused/paged_forward.h"
#include "cuda/fused/paged_kv.cuh"
#include "cuda/fused/paged_traits.h"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/query_block.cuh"
#include "cuda/fused/sequence.cuh"

namespace attn::cuda {

// kOnePage: page_tokens >= kBlockN, so that a stage is a piece of one page.
template <typename Element, int kHeadDim, bool kOnePage>
__global__ void __launch_bounds__(PagedDecodeTraits<kHeadDim>::kThreads, 2)
    PagedDecodeKernel(const __grid_constant__ PagedForwardParams p) {
  using Traits = PagedDecodeTraits<kHeadDim, sizeof(Element)>;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kWarps = Traits::kWarps;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr int kKSteps = Traits::kKSteps;
  constexpr int kPitch = Traits::kRowPitch;
  constexpr uint32_t kElemBytes = sizeof(Element);

  const int m_blocks = p.plan.m_blocks;
  const int m_block = blockIdx.x % m_blocks;
  const int kv_head = blockIdx.x / m_blocks;
  const int split = blockIdx.y;
  const SequenceView<int> seq = SequenceOf<int>(p, blockIdx.z);
  const int group = p.num_heads / p.num_kv_heads;
  const int packed0 = m_block * kBlockM;
  if (packed0 >= seq.seqlen_q * group) return;
  const int rows_valid = min(kBlockM, seq.seqlen_q * group - packed0);

  // The mask of the tokens the rows belong to; this split's share of their visible stages.
  const int first_token = packed0 / group;
  const int last_token = (packed0 + rows_valid - 1) / group;
  const BlockMask<kBlockN> mask(p, seq, first_token, last_token - first_token + 1);
  const int tile_begin = mask.n_block_min + split * p.plan.tiles_per_split;
  const int num_tiles =
      max(0, min(mask.n_block_max, tile_begin + p.plan.tiles_per_split) - tile_begin);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;
  const int quad_col = lane % 4;

  extern __shared__ __align__(128) unsigned char smem[];
  Element* sQ = reinterpret_cast<Element*>(smem);
  unsigned char* stages = smem + Traits::kQTileBytes;
  const auto stage_k = [&](int stage) {
    return reinterpret_cast<Element*>(stages + stage * Traits::kStageBytes);
  };
  const auto stage_v = [&](int stage) {
    return reinterpret_cast<Element*>(stages + stage * Traits::kStageBytes + Traits::kKVTileBytes);
  };

  // Q's packed rows, zero-filled past the last valid one: their own commit group, the oldest.
  constexpr int kElemsPerChunk = 16 / sizeof(Element);
  for (int c = threadIdx.x; c < kBlockM * Traits::kChunksPerRow; c += kThreads) {
    const int row = c / Traits::kChunksPerRow;
    const int col = (c % Traits::kChunksPerRow) * kElemsPerChunk;
    const bool valid = row < rows_valid;
    const int i = packed0 + row;
    const Element* from = static_cast<const Element*>(p.q);
    if (valid) {
      from += (seq.q_start + i / group) * p.q_token_stride +
              (kv_head * group + i % group) * p.q_head_stride + col;
    }
    ptx::CopyAsync16(ptx::SharedAddress(sQ + row * kPitch + col), from, valid);
  }
  ptx::CommitAsyncGroup();

  const PageWalk<Element> walk(p, blockIdx.z, kv_head);
  const auto load_stage = [&](int tile, int stage) {
    const int key0 = (tile_begin + tile) * kBlockN;
    LoadPagedTileAsync<kOnePage, kBlockN, kHeadDim, kPitch, kThreads>(stage_k(stage), walk, 0, key0,
                                                                      seq.seqlen_k - key0);
    LoadPagedTileAsync<kOnePage, kBlockN, kHeadDim, kPitch, kThreads>(
        stage_v(stage), walk, p.v_offset, key0, seq.seqlen_k - key0);
  };
  // One commit group per stage, empty ones included, so that wait_group counts stages.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) load_stage(s, s);
    ptx::CommitAsyncGroup();
  }

  // The visible keys of the two packed rows this thread holds.
  RowKeys row_keys[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_keys[half] = mask.Row((packed0 + quad_row + half * 8) / group + mask.shift);
  }

  float acc[1][kDTiles][4];
#pragma unroll
  for (int dj = 0; dj < kDTiles; ++dj)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][dj][e] = 0.f;
  OnlineSoftmax<1, kNTiles, kDTiles> softmax;
  softmax.Init();
  const float scale_log2 = p.scale * static_cast<float>(M_LOG2E);

  const int warp_key0 = warp * Traits::kWarpKeys;
  const uint32_t q_frag_base = ptx::SharedAddress(sQ + (lane & 15) * kPitch + (lane >> 4) * 8);
  const uint32_t k_frag_offset =
      ((warp_key0 + (lane & 7) + (lane >> 4) * 8) * kPitch + ((lane >> 3) & 1) * 8) * kElemBytes;
  const uint32_t v_frag_offset =
      ((warp_key0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kPitch + (lane >> 4) * 8) * kElemBytes;
  [[maybe_unused]] uint32_t q_frag[Traits::kQInRegisters ? kKSteps : 1][4];

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile % kStages;
    ptx::WaitAsyncGroups<kStages - 2>();
    __syncthreads();  // stage `tile` has landed; every warp is done with the previous stage
    if (tile + kStages - 1 < num_tiles) {
      load_stage(tile + kStages - 1, (tile + kStages - 1) % kStages);
    }
    ptx::CommitAsyncGroup();
    if constexpr (Traits::kQInRegisters) {
      if (tile == 0) {
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) ptx::LoadMatrixX4(q_frag[ks], q_frag_base + ks * 32);
      }
    }

    // S = Q K^T over this warp's keys of the stage.
    const uint32_t k_frag_base = ptx::SharedAddress(stage_k(stage)) + k_frag_offset;
    float s[1][kNTiles][4];
#pragma unroll
    for (int nj = 0; nj < kNTiles; ++nj)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][nj][e] = 0.f;
    const auto q_k_step = [&](const uint32_t(&a)[4], int ks) {
#pragma unroll
      for (int nj = 0; nj < kNTiles; nj += 2) {
        uint32_t b[4];
        ptx::LoadMatrixX4(b, k_frag_base + (nj * 8 * kPitch + ks * 16) * kElemBytes);
        ptx::Mma16816<Element>(s[0][nj], a, b[0], b[1]);
        ptx::Mma16816<Element>(s[0][nj + 1], a, b[2], b[3]);
      }
    };
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      if constexpr (Traits::kQInRegisters) {
        q_k_step(q_frag[ks], ks);
      } else {
        uint32_t a[4];
        ptx::LoadMatrixX4(a, q_frag_base + ks * 32);
        q_k_step(a, ks);
      }
    }

    const int key0 = (tile_begin + tile) * kBlockN;
    if (mask.TileNeedsMask(key0)) {
#pragma unroll
      for (int nj = 0; nj < kNTiles; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const RowKeys& keys = row_keys[e / 2];
          const int key = key0 + warp_key0 + nj * 8 + quad_col * 2 + (e & 1);
          if (key < keys.begin || key >= keys.end) s[0][nj][e] = -INFINITY;
        }
    }

    softmax.Update(s, acc, scale_log2);

    // acc += P V, P from the score registers as the A operand.
    const uint32_t v_frag_base = ptx::SharedAddress(stage_v(stage)) + v_frag_offset;
#pragma unroll
    for (int ps = 0; ps < Traits::kPSteps; ++ps) {
      uint32_t a[4];
      a[0] = ptx::PackPair<Element>(s[0][2 * ps][0], s[0][2 * ps][1]);
      a[1] = ptx::PackPair<Element>(s[0][2 * ps][2], s[0][2 * ps][3]);
      a[2] = ptx::PackPair<Element>(s[0][2 * ps + 1][0], s[0][2 * ps + 1][1]);
      a[3] = ptx::PackPair<Element>(s[0][2 * ps + 1][2], s[0][2 * ps + 1][3]);
#pragma unroll
      for (int dj = 0; dj < kDTiles; dj += 2) {
        uint32_t b[4];
        ptx::LoadMatrixX4Transposed(b, v_frag_base + (ps * 16 * kPitch + dj * 8) * kElemBytes);
        ptx::Mma16816<Element>(acc[0][dj], a, b[0], b[1]);
        ptx::Mma16816<Element>(acc[0][dj + 1], a, b[2], b[3]);
      }
    }
  }

  // The warps' states into the (now idle) stages: m, l, acc per warp and row.
  ptx::WaitAsyncGroups<0>();
  __syncthreads();
  float* merge_acc = reinterpret_cast<float*>(stages);  // [kWarps][kBlockM][kAccPitch]
  float* merge_m = merge_acc + kWarps * kBlockM * Traits::kAccPitch;  // [kWarps][kBlockM]
  float* merge_l = merge_m + kWarps * kBlockM;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = warp * kBlockM + quad_row + half * 8;
    const float l = QuadSum(softmax.l[half]);
    if (quad_col == 0) {
      merge_m[row] = softmax.m[half];
      merge_l[row] = l;
    }
#pragma unroll
    for (int dj = 0; dj < kDTiles; ++dj) {
      *reinterpret_cast<float2*>(merge_acc + row * Traits::kAccPitch + dj * 8 + quad_col * 2) =
          make_float2(acc[0][dj][2 * half], acc[0][dj][2 * half + 1]);
    }
  }
  __syncthreads();

  // Merge and write: each thread takes 4 columns of a row at a time.
  constexpr int kVectors = kHeadDim / 4;
  const bool partial = p.plan.num_splits > 1;
  const int64_t rows_total = p.total_q * p.num_heads;
  for (int c = threadIdx.x; c < kBlockM * kVectors; c += kThreads) {
    const int row = c / kVectors;
    const int col = (c % kVectors) * 4;
    if (row >= rows_valid) break;  // a thread's rows only grow
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, merge_m[w * kBlockM + row]);
    const float m_ref = m == -INFINITY ? 0.f : m * scale_log2;
    float l = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = ptx::Exp2(merge_m[w * kBlockM + row] * scale_log2 - m_ref);
      l += weight * merge_l[w * kBlockM + row];
      const float4 part = *reinterpret_cast<const float4*>(
          merge_acc + (w * kBlockM + row) * Traits::kAccPitch + col);
      o.x += weight * part.x;
      o.y += weight * part.y;
      o.z += weight * part.z;
      o.w += weight * part.w;
    }
    const float inv_l = InverseRowSum(l);
    const int i = packed0 + row;
    const int head = kv_head * group + i % group;
    const int64_t token = seq.q_start + i / group;
    if (!partial) {
      Element* out =
          static_cast<Element*>(p.o) + token * p.o_token_stride + head * p.o_head_stride + col;
      *reinterpret_cast<uint2*>(out) = make_uint2(ptx::PackPair<Element>(o.x * inv_l, o.y * inv_l),
                                                  ptx::PackPair<Element>(o.z * inv_l, o.w * inv_l));
      if (col == 0 && p.lse != nullptr) p.lse[head * p.total_q + token] = RowLse(m, l, p.scale);
    } else {
      const int64_t at = split * rows_total + token * p.num_heads + head;
      *reinterpret_cast<float4*>(p.o_partial + at * kHeadDim + col) =
          make_float4(o.x * inv_l, o.y * inv_l, o.z * inv_l, o.w * inv_l);
      if (col == 0) p.lse_partial[at] = RowLse(m, l, p.scale);
    }
  }
  if (!partial) return;

  __shared__ int64_t row_ids[kBlockM];  // the rows' (token * num_heads + head)
  __shared__ float lse_scratch[kBlockM];
  __shared__ int last_flag;
  if (threadIdx.x < rows_valid) {
    const int i = packed0 + threadIdx.x;
    row_ids[threadIdx.x] = (seq.q_start + i / group) * p.num_heads + kv_head * group + i % group;
  }
  int* counter = p.split_counters +
                 (static_cast<int64_t>(blockIdx.z) * p.num_kv_heads + kv_head) * m_blocks + m_block;
  if (ArriveLastOfSplits(counter, p.plan.num_splits, &last_flag)) {
    CombineSplits<Element, kHeadDim, kThreads>(p, rows_valid, row_ids, lse_scratch);
  }
}

}  // namespace attn::cuda
