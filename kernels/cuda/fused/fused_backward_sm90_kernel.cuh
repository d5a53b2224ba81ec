// The Hopper backward (sm_90a): the algorithm of fused_backward_kernel.cuh (see fused_backward.h)
// with its loads on the copy engine, its five matrix products on warpgroup MMA, and each query
// tile's dQ added into the float32 accumulator by bulk reductions of whole rows instead of
// per-element atomics.
//
// A CTA owns kBlockN = 128 keys of one (sequence, KV head) and runs three warpgroups:
//   - a producer (warpgroup 0, one warp of which works): K and V by TMA once, then per query
//     tile Q and dO by TMA and the tile's LSE (base 2) and D by plain loads, into a kStages
//     ring of `full` / `empty` mbarriers;
//   - two consumer warpgroups of 64 keys each, which per query tile of kBlockM rows compute
//       S^T = K Q^T and dP^T = V dO^T               (both queued at once)
//       P^T = exp2(S^T scale log2(e) - LSE)  and  dS^T = P^T (dP^T - D)
//       dV += P^T dO  and  dK += dS^T Q            (P^T, dS^T from registers)
//       dS^T into shared memory; the two warpgroups meet
//       dQ[:, half] = dS K[:, half]                 (each warpgroup half of head_dim)
//       dQ scale into shared memory (float32); the two meet; one warp adds the tile's rows to
//       the accumulator (cp.reduce.async.bulk), in key-block order when deterministic.
// Keys are the MMA rows (S^T rather than S) so that P^T and dS^T come out of the accumulators
// in the A-fragment layout dV's and dK's MMAs read from registers; dQ reads dS^T and K where
// they lie, both MN-major.
//
// Deterministic mode: the CTAs that meet one (sequence, head, query tile) add its dQ rows in
// key-block order, each waiting on a counter of the tile until the blocks below it are done.
// Blocks of one (KV head, sequence) are launched in key-block order (blockIdx.x runs fastest),
// so the block waited for is resident or finished.
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "attn/mask.h"
#include "cuda/common/element_convert.cuh"
#include "cuda/fused/fused_backward.h"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/sequence.cuh"
#include "cuda/fused/tma.cuh"
#include "cuda/fused/wgmma.cuh"

namespace attn::cuda {

template <typename Element_, int kHeadDim_>
struct FusedBackwardSm90Traits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kSm90BackwardBlockM;  // query rows per tile
  static constexpr int kBlockN = 128;                  // keys per CTA, 64 per consumer warpgroup
  static constexpr int kStages = 2;                    // query tiles in flight
  static constexpr int kConsumerWarpGroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpGroups;
  static constexpr int kThreads = 128 + kConsumerThreads;  // the producer warpgroup first
  static constexpr int kColumnBlocks = kHeadDim / 64;      // 128-byte column blocks of a row
  static constexpr int kDTiles = kHeadDim / 8;             // 8-column tiles of dK, dV
  static constexpr int kQTiles = kBlockM / 8;              // 8-query column tiles of S^T
  static constexpr int kDqColumns = kHeadDim / kConsumerWarpGroups;  // each warpgroup's dQ
  // Staged dQ rows are padded by 16 bytes (fewer bank conflicts; rows stay 16-byte aligned for
  // the bulk reduction).
  static constexpr int kDqRowFloats = kHeadDim + 4;
  static constexpr int kKVTileBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQTileBytes = kBlockM * kHeadDim * 2;
  // K, V, the Q stages, the dO stages and dS^T (128-byte swizzled, each tile and column block
  // 1024-byte aligned); staged dQ; per stage the LSE and D rows; the mbarriers: K/V full, then
  // per stage full and empty.
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKVTileBytes;
  static constexpr int kQOffset = 2 * kKVTileBytes;
  static constexpr int kDoOffset = kQOffset + kStages * kQTileBytes;
  static constexpr int kDsOffset = kDoOffset + kStages * kQTileBytes;
  static constexpr int kDqOffset = kDsOffset + kBlockN * kBlockM * 2;
  static constexpr int kLseOffset = kDqOffset + kBlockM * kDqRowFloats * 4;
  static constexpr int kDeltaOffset = kLseOffset + kStages * kBlockM * 4;
  static constexpr int kBarrierOffset = kDeltaOffset + kStages * kBlockM * 4;
  static constexpr int kSmemBytes = kBarrierOffset + 8 * (1 + 2 * kStages);
  static_assert(kHeadDim == 64 || kHeadDim == 128, "wgmma shapes for head_dim 64 and 128");
  static_assert(kBlockM == 64, "dS^T is one 128-byte column block; S^T tiles are m64n64");
  static_assert(kQTileBytes % 1024 == 0 && kDsOffset % 1024 == 0, "swizzled tiles aligned");
  static_assert(kSmemBytes <= 227 * 1024, "Hopper's shared memory per CTA");
  static_assert(sizeof(Element) == 2, "16-bit storage");
};

// The kernel's parameter block: the plain params, the workspace, and the tensor maps of Q, K, V
// and dO (made on the host, read by the copy engine from parameter space).
struct FusedBackwardTmaParams {
  FusedBackwardParams p;
  const float* delta = nullptr;     // D [num_heads, total_q]
  float* dq_accum = nullptr;        // [total_q, num_heads, head_dim]
  int* dq_tile_counters = nullptr;  // deterministic mode: [batch, num_heads, query tiles]
  int64_t query_tiles = 0;          // per (sequence, head): ceil(max_seqlen_q / kBlockM)
  bool aligned_outputs = false;     // dK, dV rows 4-byte aligned for paired stores
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
  CUtensorMap do_map;
};

namespace sm90_backward {

// Named barrier ids (0 is __syncthreads): both consumer warpgroups' dS^T stored, and their dQ
// halves staged.
inline constexpr uint32_t kDsStoredBarrier = 1;
inline constexpr uint32_t kDqStagedBarrier = 2;

template <typename Traits>
struct Barriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t kv_full() const { return base; }
  __device__ __forceinline__ uint32_t full(int stage) const { return base + 8 * (1 + stage); }
  __device__ __forceinline__ uint32_t empty(int stage) const {
    return base + 8 * (1 + Traits::kStages + stage);
  }
};

__device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }

// The query tiles a key block meets, head by head of its KV head's group: per_head of them from
// first_row0 on (the rows whose window can reach the block; per-element masks trim the rest).
struct QueryTiles {
  int64_t first_row0 = 0, per_head = 0, count = 0;
  int group = 1;

  __device__ QueryTiles(const FusedBackwardParams& p, const SequenceView<int64_t>& seq, int64_t k0,
                        int64_t keys, int block_m) {
    const int64_t shift = seq.seqlen_k - seq.seqlen_q;
    int64_t first_row = 0, end_row = seq.seqlen_q;
    if (p.window_right >= 0) first_row = Max64(0, k0 - p.window_right - shift);
    if (p.window_left >= 0) end_row = Min64(seq.seqlen_q, k0 + keys + p.window_left - shift);
    first_row0 = first_row / block_m * block_m;
    per_head = end_row > first_row0 ? (end_row - first_row0 + block_m - 1) / block_m : 0;
    group = p.num_heads / p.num_kv_heads;
    count = per_head * group;
  }
  __device__ int head(int64_t t, int kv_head) const {
    return kv_head * group + static_cast<int>(t / per_head);
  }
  __device__ int64_t row0(int64_t t, int block_m) const {
    return first_row0 + (t % per_head) * block_m;
  }
};

// The lowest key block that meets query tile [row0, row0 + block_m): where the dQ of the tile
// starts in deterministic order. Only the left window bounds it (see QueryTiles).
__device__ __forceinline__ int64_t FirstKeyBlockOf(const FusedBackwardParams& p,
                                                   const SequenceView<int64_t>& seq, int64_t row0,
                                                   int block_n) {
  if (p.window_left < 0) return 0;
  const int64_t first_key = row0 + seq.seqlen_k - seq.seqlen_q - p.window_left;
  return first_key > 0 ? first_key / block_n : 0;
}

__device__ __forceinline__ int LoadAcquire(const int* counter) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
  return value;
}

__device__ __forceinline__ void IncrementRelease(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

// The stage and phase parity of the t-th tile of the ring.
template <int kStages>
__device__ __forceinline__ int StageOf(int64_t t) {
  return static_cast<int>(t % kStages);
}
template <int kStages>
__device__ __forceinline__ uint32_t ParityOf(int64_t t) {
  return static_cast<uint32_t>((t / kStages) & 1);
}

// Queues X^T = A B^T for a warpgroup's 64 rows of A (K or V) against a tile of 64 rows of B (Q
// or dO), both K-major over head_dim: head_dim / 16 k-steps of 32 bytes in the swizzled rows.
template <typename Traits>
__device__ __forceinline__ void IssueTransposedScores(float (&x)[Traits::kBlockM / 2],
                                                      uint32_t a_rows, uint32_t b_tile) {
#pragma unroll
  for (int ks = 0; ks < Traits::kHeadDim / 16; ++ks) {
    const uint32_t column = (ks % 4) * 32;
    const uint64_t desc_a =
        wgmma::MakeDescriptor(a_rows + (ks / 4) * Traits::kBlockN * 128 + column, 0);
    const uint64_t desc_b =
        wgmma::MakeDescriptor(b_tile + (ks / 4) * Traits::kBlockM * 128 + column, 0);
    wgmma::MmaSS_64(x, desc_a, desc_b, ks > 0, typename Traits::Element{});
  }
}

// Queues acc += A^T B over the tile's 64 query rows: A^T (P^T or dS^T) from registers, B (dO or
// Q) read MN-major from its stage.
template <typename Traits>
__device__ __forceinline__ void IssueKeyGradient(float (&acc)[Traits::kHeadDim / 2],
                                                 const uint32_t (&a)[Traits::kBlockM / 16][4],
                                                 uint32_t b_tile) {
#pragma unroll
  for (int ks = 0; ks < Traits::kBlockM / 16; ++ks) {
    const uint64_t desc_b = wgmma::MakeDescriptor(b_tile + ks * 16 * 128, Traits::kBlockM * 128);
    if constexpr (Traits::kHeadDim == 128) {
      wgmma::MmaRS_128(acc, a[ks], desc_b, typename Traits::Element{});
    } else {
      wgmma::MmaRS_64(acc, a[ks], desc_b, typename Traits::Element{});
    }
  }
}

// Queues dQ[:, columns] = dS K[:, columns] over the block's 128 keys, dS read from the stored
// dS^T and K from its tile, both MN-major (16 keys a k-step, 2 KiB of rows).
template <typename Traits>
__device__ __forceinline__ void IssueQueryGradient(float (&dq)[Traits::kDqColumns / 2],
                                                   uint32_t ds_tile, uint32_t k_tile,
                                                   int first_column) {
  const uint32_t k_columns =
      k_tile + (first_column / 64) * Traits::kBlockN * 128 + (first_column % 64) * 2;
#pragma unroll
  for (int ks = 0; ks < Traits::kBlockN / 16; ++ks) {
    const uint64_t desc_ds = wgmma::MakeDescriptor(ds_tile + ks * 16 * 128, Traits::kBlockN * 128);
    const uint64_t desc_k = wgmma::MakeDescriptor(k_columns + ks * 16 * 128, Traits::kBlockN * 128);
    if constexpr (Traits::kDqColumns == 64) {
      wgmma::MmaSSMnMajor_64(dq, desc_ds, desc_k, ks > 0, typename Traits::Element{});
    } else {
      wgmma::MmaSSMnMajor_32(dq, desc_ds, desc_k, ks > 0, typename Traits::Element{});
    }
  }
}

// Accumulator pairs (fp32, m64nN layout) to the 16-bit A fragments of an RS MMA.
template <typename Element, int kTiles>
__device__ __forceinline__ void PackFragments(const float (&x)[kTiles * 4],
                                              uint32_t (&a)[kTiles / 2][4]) {
#pragma unroll
  for (int ks = 0; ks < kTiles / 2; ++ks) {
    a[ks][0] = ptx::PackPair<Element>(x[8 * ks + 0], x[8 * ks + 1]);
    a[ks][1] = ptx::PackPair<Element>(x[8 * ks + 2], x[8 * ks + 3]);
    a[ks][2] = ptx::PackPair<Element>(x[8 * ks + 4], x[8 * ks + 5]);
    a[ks][3] = ptx::PackPair<Element>(x[8 * ks + 6], x[8 * ks + 7]);
  }
}

// Where the CTA's tiles sit in the tensor maps' (column, row, head, sequence) coordinates: a
// uniform batch addresses its sequence by the fourth coordinate, a variable-length one by the
// sequence's first token.
struct TileOrigin {
  int q_row, k_row, sequence;
};

// The producer warp: K and V once, then each query tile's Q and dO (TMA, lane 0) and its LSE and
// D rows (every lane), into the next stage once the consumers have released it. LSE goes to
// base 2; a row outside the sequence or one that saw no key gets +inf, so that its P is 0.
template <typename Traits>
__device__ __forceinline__ void ProduceTiles(const FusedBackwardTmaParams& params,
                                             const Barriers<Traits>& bars, uint32_t smem,
                                             float* lse_rows, float* delta_rows,
                                             const SequenceView<int64_t>& seq,
                                             const QueryTiles& tiles, const TileOrigin& at,
                                             int64_t k0, int kv_head) {
  const FusedBackwardParams& p = params.p;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    tma::PrefetchTensorMap(&params.q_map);
    tma::PrefetchTensorMap(&params.do_map);
    tma::ArriveExpectBytes(bars.kv_full(), 2 * Traits::kKVTileBytes);
#pragma unroll
    for (int cb = 0; cb < Traits::kColumnBlocks; ++cb) {
      const uint32_t block = cb * Traits::kBlockN * 128;
      tma::Load4d(smem + Traits::kKOffset + block, &params.k_map, bars.kv_full(), cb * 64,
                  at.k_row + static_cast<int>(k0), kv_head, at.sequence);
      tma::Load4d(smem + Traits::kVOffset + block, &params.v_map, bars.kv_full(), cb * 64,
                  at.k_row + static_cast<int>(k0), kv_head, at.sequence);
    }
  }
  const float log2e = static_cast<float>(M_LOG2E);
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int stage = StageOf<Traits::kStages>(t);
    const int head = tiles.head(t, kv_head);
    const int64_t row0 = tiles.row0(t, Traits::kBlockM);
    tma::Wait(bars.empty(stage), ParityOf<Traits::kStages>(t) ^ 1);
    if (lane == 0) {
      tma::ExpectBytes(bars.full(stage), 2 * Traits::kQTileBytes);
      const uint32_t q_stage = smem + Traits::kQOffset + stage * Traits::kQTileBytes;
      const uint32_t do_stage = smem + Traits::kDoOffset + stage * Traits::kQTileBytes;
#pragma unroll
      for (int cb = 0; cb < Traits::kColumnBlocks; ++cb) {
        const uint32_t block = cb * Traits::kBlockM * 128;
        const int row = at.q_row + static_cast<int>(row0);
        tma::Load4d(q_stage + block, &params.q_map, bars.full(stage), cb * 64, row, head,
                    at.sequence);
        tma::Load4d(do_stage + block, &params.do_map, bars.full(stage), cb * 64, row, head,
                    at.sequence);
      }
    }
    const int64_t rows = Min64(Traits::kBlockM, seq.seqlen_q - row0);
#pragma unroll
    for (int r = lane; r < Traits::kBlockM; r += 32) {
      float lse = INFINITY, delta = 0.f;
      if (r < rows) {
        const int64_t at_row = head * p.total_q + seq.q_start + row0 + r;
        const float stored = p.lse[at_row];
        lse = stored == -INFINITY ? INFINITY : stored * log2e;
        delta = params.delta[at_row];
      }
      lse_rows[stage * Traits::kBlockM + r] = lse;
      delta_rows[stage * Traits::kBlockM + r] = delta;
    }
    tma::Arrive(bars.full(stage));
  }
}

}  // namespace sm90_backward

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    FusedBackwardSm90Kernel(const __grid_constant__ FusedBackwardTmaParams params) {
#ifdef ATTN_WGMMA_AVAILABLE
  using namespace sm90_backward;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr int kQTiles = Traits::kQTiles;
  constexpr int kDqColumns = Traits::kDqColumns;
  constexpr int kConsumerThreads = Traits::kConsumerThreads;
  const FusedBackwardParams& p = params.p;

  const SequenceView<int64_t> seq = SequenceOf<int64_t>(p, blockIdx.z);
  const int64_t k0 = int64_t{blockIdx.x} * kBlockN;
  if (k0 >= seq.seqlen_k) return;
  const int64_t keys = Min64(kBlockN, seq.seqlen_k - k0);
  const int kv_head = blockIdx.y;
  const QueryTiles tiles(p, seq, k0, keys, kBlockM);

  extern __shared__ __align__(1024) unsigned char swizzled_smem[];
  const uint32_t smem = ptx::SharedAddress(swizzled_smem);
  float* lse_rows = reinterpret_cast<float*>(swizzled_smem + Traits::kLseOffset);
  float* delta_rows = reinterpret_cast<float*>(swizzled_smem + Traits::kDeltaOffset);
  float* dq_staged = reinterpret_cast<float*>(swizzled_smem + Traits::kDqOffset);
  const Barriers<Traits> bars{smem + Traits::kBarrierOffset};

  if (threadIdx.x == 0) {
    tma::InitBarrier(bars.kv_full(), 1);
#pragma unroll
    for (int stage = 0; stage < kStages; ++stage) {
      tma::InitBarrier(bars.full(stage), 32);                      // the producer warp's lanes
      tma::InitBarrier(bars.empty(stage), kConsumerThreads / 32);  // one per consumer warp
    }
    tma::FenceBarrierInit();
  }
  __syncthreads();

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    tma::ReleaseRegisters<kSm90TmaProducerRegisters>();
    if (threadIdx.x < 32 && tiles.count > 0) {
      const bool varlen = p.cu_seqlens_q != nullptr;
      const TileOrigin at{varlen ? static_cast<int>(seq.q_start) : 0,
                          varlen ? static_cast<int>(seq.k_start) : 0,
                          varlen ? 0 : static_cast<int>(blockIdx.z)};
      ProduceTiles<Traits>(params, bars, smem, lse_rows, delta_rows, seq, tiles, at, k0, kv_head);
    }
    return;
  }
  tma::ClaimRegisters<kSm90TmaConsumerRegisters>();

  const int consumer = warp_group - 1;
  const int warp = (threadIdx.x % 128) / 32;  // within the warpgroup: 16 of its 64 keys
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;
  const int pair = (lane % 4) * 2;
  const int key_row = consumer * 64 + warp * 16 + quad_row;  // in the block; + 8 for the second
  // The first warp of consumer 0 adds the staged dQ rows to the accumulator.
  const bool reducer = consumer == 0 && warp == 0;
  const uint32_t k_tile = smem + Traits::kKOffset;
  const uint32_t v_tile = smem + Traits::kVOffset;
  const uint32_t ds_tile = smem + Traits::kDsOffset;
  const float scale_log2 = p.scale * static_cast<float>(M_LOG2E);
  const int64_t shift = seq.seqlen_k - seq.seqlen_q;

  float dk[kHeadDim / 2], dv[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dk[i] = dv[i] = 0.f;

  if (tiles.count > 0) tma::Wait(bars.kv_full(), 0);
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int stage = StageOf<kStages>(t);
    const int head = tiles.head(t, kv_head);
    const int64_t row0 = tiles.row0(t, kBlockM);
    const int64_t rows = Min64(kBlockM, seq.seqlen_q - row0);
    const uint32_t q_stage = smem + Traits::kQOffset + stage * Traits::kQTileBytes;
    const uint32_t do_stage = smem + Traits::kDoOffset + stage * Traits::kQTileBytes;
    tma::Wait(bars.full(stage), ParityOf<kStages>(t));

    float s[kBlockM / 2], dp[kBlockM / 2];
    wgmma::Fence();
    IssueTransposedScores<Traits>(s, k_tile + consumer * 64 * 128, q_stage);
    wgmma::CommitGroup();
    IssueTransposedScores<Traits>(dp, v_tile + consumer * 64 * 128, do_stage);
    wgmma::CommitGroup();

    // P^T = exp2(S^T scale log2(e) - LSE); the mask where the tile crosses the window's edges,
    // the sequence's last key or the block's end (rows past the sequence have LSE = +inf).
    const float* lse = lse_rows + stage * kBlockM;
    const float* delta = delta_rows + stage * kBlockM;
    const int64_t last_row = row0 + rows - 1;
    const bool masked = keys < kBlockN ||
                        (p.window_right >= 0 && k0 + kBlockN - 1 > row0 + shift + p.window_right) ||
                        (p.window_left >= 0 && k0 < last_row + shift - p.window_left);
    wgmma::WaitGroup<1>();
    wgmma::FenceOperands(s);
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
      const float2 row_lse = *reinterpret_cast<const float2*>(lse + j * 8 + pair);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& x = s[j * 4 + e];
        x = ptx::Exp2(fmaf(x, scale_log2, -(e % 2 == 0 ? row_lse.x : row_lse.y)));
        if (masked) {
          const int64_t key = k0 + key_row + (e / 2) * 8;
          const KeyRange visible = VisibleKeys(row0 + j * 8 + pair + e % 2, seq.seqlen_q,
                                               seq.seqlen_k, p.window_left, p.window_right);
          if (key < visible.begin || key >= visible.end) x = 0.f;
        }
      }
    }
    // dS^T = P^T (dP^T - D).
    wgmma::WaitGroup<0>();
    wgmma::FenceOperands(dp);
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
      const float2 row_delta = *reinterpret_cast<const float2*>(delta + j * 8 + pair);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dp[j * 4 + e] = s[j * 4 + e] * (dp[j * 4 + e] - (e % 2 == 0 ? row_delta.x : row_delta.y));
      }
    }
    uint32_t p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
    PackFragments<Element, kQTiles>(s, p_frag);
    PackFragments<Element, kQTiles>(dp, ds_frag);

    wgmma::Fence();
    IssueKeyGradient<Traits>(dv, p_frag, do_stage);
    IssueKeyGradient<Traits>(dk, ds_frag, q_stage);
    wgmma::CommitGroup();

    // dS^T (keys x queries, one swizzled column block) for dQ, while dV and dK run. The last
    // tile's dQ MMAs are done reading it: both warpgroups waited for them before the
    // kDqStagedBarrier that each passed since.
#pragma unroll
    for (int ks = 0; ks < kBlockM / 16; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = ks * 16 + half * 8 + pair;
        *reinterpret_cast<uint32_t*>(swizzled_smem + Traits::kDsOffset +
                                     wgmma::SwizzledByteOffset(key_row, col, kBlockN)) =
            ds_frag[ks][2 * half];
        *reinterpret_cast<uint32_t*>(swizzled_smem + Traits::kDsOffset +
                                     wgmma::SwizzledByteOffset(key_row + 8, col, kBlockN)) =
            ds_frag[ks][2 * half + 1];
      }
    }
    wgmma::FenceSharedForAsyncProxy();
    // The staged dQ of the last tile must be read out before it is overwritten below.
    if (reducer) tma::BulkWaitRead();
    tma::NamedBarrierSync(kDsStoredBarrier, kConsumerThreads);

    float dq[kDqColumns / 2];
    wgmma::Fence();
    IssueQueryGradient<Traits>(dq, ds_tile, k_tile, consumer * kDqColumns);
    wgmma::CommitGroup();
    wgmma::WaitGroup<0>();
    wgmma::FenceOperands(dq);
    wgmma::FenceOperands(dk);
    wgmma::FenceOperands(dv);
    // Q, dO, LSE and D of this stage are no longer read.
    if (lane == 0) tma::Arrive(bars.empty(stage));

#pragma unroll
    for (int n = 0; n < kDqColumns / 8; ++n) {
      const int col = consumer * kDqColumns + n * 8 + pair;
      const int row = warp * 16 + quad_row;
      *reinterpret_cast<float2*>(dq_staged + row * Traits::kDqRowFloats + col) =
          make_float2(dq[n * 4] * p.scale, dq[n * 4 + 1] * p.scale);
      *reinterpret_cast<float2*>(dq_staged + (row + 8) * Traits::kDqRowFloats + col) =
          make_float2(dq[n * 4 + 2] * p.scale, dq[n * 4 + 3] * p.scale);
    }
    tma::FenceSharedForBulk();
    tma::NamedBarrierSync(kDqStagedBarrier, kConsumerThreads);

    if (reducer) {
      float* dq_rows = params.dq_accum + ((seq.q_start + row0) * p.num_heads + head) * kHeadDim;
      const int64_t row_stride = int64_t{p.num_heads} * kHeadDim;
      const uint32_t staged = smem + Traits::kDqOffset;
      constexpr uint32_t kRowBytes = kHeadDim * 4;
      if (!p.deterministic) {
        for (int r = lane; r < rows; r += 32) {
          tma::ReduceAddF32(dq_rows + r * row_stride, staged + r * Traits::kDqRowFloats * 4,
                            kRowBytes);
        }
        tma::BulkCommit();
      } else if (lane == 0) {
        // After the key blocks below this one that meet the tile, then count this one in.
        int* counter = params.dq_tile_counters +
                       (int64_t{blockIdx.z} * p.num_heads + head) * params.query_tiles +
                       row0 / kBlockM;
        const int64_t turn = blockIdx.x - FirstKeyBlockOf(p, seq, row0, kBlockN);
        while (LoadAcquire(counter) != turn) {
        }
        tma::FenceGlobalAfterBulk();
        for (int r = 0; r < rows; ++r) {
          tma::ReduceAddF32(dq_rows + r * row_stride, staged + r * Traits::kDqRowFloats * 4,
                            kRowBytes);
        }
        tma::BulkCommit();
        tma::BulkWait();
        tma::FenceGlobalAfterBulk();
        IncrementRelease(counter);
      }
      __syncwarp();  // the warp's next wgmma needs all its lanes
    }
  }
  // Shared memory must outlive the reductions reading it.
  if (reducer) tma::BulkWaitRead();

    // dK (scaled) and dV of the block's keys, from registers to the dtype.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = key_row + half * 8;
    if (r >= keys) continue;
    const int64_t token = seq.k_start + k0 + r;
    Element* dk_row =
        static_cast<Element*>(p.dk) + token * p.dk_token_stride + kv_head * p.dk_head_stride;
    Element* dv_row =
        static_cast<Element*>(p.dv) + token * p.dv_token_stride + kv_head * p.dv_head_stride;
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) {
      const int c = n * 8 + pair;
      const float k_lo = dk[n * 4 + 2 * half] * p.scale, k_hi = dk[n * 4 + 2 * half + 1] * p.scale;
      const float v_lo = dv[n * 4 + 2 * half], v_hi = dv[n * 4 + 2 * half + 1];
      if (params.aligned_outputs) {
        *reinterpret_cast<uint32_t*>(dk_row + c) = ptx::PackPair<Element>(k_lo, k_hi);
        *reinterpret_cast<uint32_t*>(dv_row + c) = ptx::PackPair<Element>(v_lo, v_hi);
      } else {
        dk_row[c] = FromFloat<Element>(k_lo);
        dk_row[c + 1] = FromFloat<Element>(k_hi);
        dv_row[c] = FromFloat<Element>(v_lo);
        dv_row[c + 1] = FromFloat<Element>(v_hi);
      }
    }
  }
#endif  // ATTN_WGMMA_AVAILABLE
}

}  // namespace attn::cuda
