// The Hopper backward at head_dim 256 (sm_90a): the algorithm and the producer of
// fused_backward_sm90_kernel.cuh with the work split the other way between the two consumer
// warpgroups, since a warpgroup owning 64 keys would keep 256 float32 accumulators of dK and dV
// a thread.
//
// A CTA owns kBlockN = 64 keys; both consumer warpgroups compute with all of them. Per query
// tile t of 64 rows, consumer warpgroup w
//   - computes S^T = K Q^T and dP^T = V dO^T for the tile's queries 32 w .. 32 w + 31
//     (m64n32 each), then P^T and dS^T of those, and stores them into shared memory;
//   - adds into dV and dK of its head_dim columns 128 w .. 128 w + 127 (m64n128): first its own
//     queries' share with P^T and dS^T from registers, then, once the other warpgroup has stored
//     its half, the other queries' share from shared memory;
//   - computes dQ = dS K of the tile's 64 rows for its 128 columns (two m64n64 blocks);
//   - once both warpgroups are done with the stage's Q and dO, stages its dQ block, scaled,
//     into that stage (warpgroup 0 over Q, 1 over dO), from where the dQ warp adds it into the
//     accumulator and then releases the stage to the producer.
// Staging dQ in the spent stage is what fits: K and V (64 KiB), two stages of Q and dO
// (128 KiB), P^T and dS^T (16 KiB) leave no room for the 64 KiB of a tile's dQ.
#pragma once

#include <cmath>
#include <cstdint>

#include "attn/mask.h"
#include "cuda/common/element_convert.cuh"
#include "cuda/fused/backward_tiles.cuh"
#include "cuda/fused/dq_order.cuh"
#include "cuda/fused/fused_backward.h"
#include "cuda/fused/fused_backward_sm90_kernel.cuh"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/sequence.cuh"
#include "cuda/fused/tma.cuh"
#include "cuda/fused/wgmma.cuh"

namespace attn::cuda {

template <typename Element_, int kHeadDim_>
struct FusedBackwardSm90WideTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Sm90BackwardBlockM(kHeadDim);  // query rows per tile
  static constexpr int kBlockN = 64;                            // keys per CTA
  static constexpr int kStages = 2;                             // query tiles in flight
  static constexpr int kConsumerWarpGroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpGroups;
  static constexpr int kThreads = 128 + kConsumerThreads;  // the producer warpgroup first
  static constexpr int kColumnBlocks = kHeadDim / 64;
  static constexpr int kGroupQueries = kBlockM / kConsumerWarpGroups;   // of S^T and dP^T
  static constexpr int kGroupColumns = kHeadDim / kConsumerWarpGroups;  // of dK, dV and dQ
  static constexpr int kQTiles = kGroupQueries / 8;  // 8-query column tiles of S^T
  static constexpr int kDqColumns = 64;              // a dQ block (m64n64)
  static constexpr int kDqBlocks = kGroupColumns / kDqColumns;
  static constexpr int kDqBoxColumns = 32;  // the accumulator's boxes: 64 rows x 128 bytes
  static constexpr int kDqBoxBytes = 64 * kDqBoxColumns * 4;
  static constexpr int kKVTileBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQTileBytes = kBlockM * kHeadDim * 2;
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;  // P^T or dS^T
  static constexpr int kStatsFloats = 2 * kBlockM;        // a slot: LSE (base 2) rows, D rows
  // K, V, the Q stages, the dO stages, P^T and dS^T (128-byte swizzled, 1024-byte aligned); per
  // warpgroup two slots of row statistics; the mbarriers: K/V full, then per stage full and
  // empty.
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKVTileBytes;
  static constexpr int kQOffset = 2 * kKVTileBytes;
  static constexpr int kDoOffset = kQOffset + kStages * kQTileBytes;
  static constexpr int kPOffset = kDoOffset + kStages * kQTileBytes;
  static constexpr int kDsOffset = kPOffset + kDsBytes;
  static constexpr int kStatsOffset = kDsOffset + kDsBytes;
  static constexpr int kBarrierOffset = kStatsOffset + kConsumerWarpGroups * 2 * kStatsFloats * 4;
  static constexpr int kSmemBytes = kBarrierOffset + 8 * (1 + 2 * kStages);
  static_assert(kHeadDim == 256, "the 128-column halves of dK, dV and dQ are m64n128");
  static_assert(kBlockM == 64 && kGroupQueries == 32, "S^T halves are m64n32");
  static_assert(64 * kGroupColumns * 4 == kQTileBytes, "a warpgroup's dQ fills one spent tile");
  static_assert(kStatsFloats % 128 == 0, "a warpgroup's threads load a slot in whole passes");
  static_assert(kSmemBytes <= 227 * 1024, "Hopper's shared memory per CTA");
  static_assert(sizeof(Element) == 2, "16-bit storage");
};

namespace sm90_backward_wide {

// Named barrier ids (0 is __syncthreads), per consumer warpgroup w:
//   kStatsBarrier + w: w's own threads (tile 0's row statistics placed);
//   kScoresStoredBarrier + w: w has stored its half of the tile's P^T and dS^T (both consumer
//     warpgroups; w arrives, the other syncs);
//   kStageReadBarrier: both consumer warpgroups are done with the tile (its stage's Q and dO,
//     P^T, dS^T, the statistics slot) and have placed the next tile's statistics;
//   kDqStagedBarrier + 2 w + (t % 2): w's dQ of tile t staged for the dQ warp (two ids, so that
//     an arrival never meets the previous tile's unconsumed one: the stage of tile t + 2, where
//     the next arrival on the id goes, is only loaded after the dQ warp read tile t's);
//   kScoresFreeBarrier + w: w's last dQ block of tile t no longer reads dS^T (w arrives, the
//     other syncs before storing its half of tile t + 1's).
// One id per w suffices for the scores: w's next arrival follows the stage-read barrier that
// the other warpgroup reaches only after its sync.
inline constexpr uint32_t kStatsBarrier = 1;
inline constexpr uint32_t kScoresStoredBarrier = 3;
inline constexpr uint32_t kStageReadBarrier = 5;
inline constexpr uint32_t kDqStagedBarrier = 6;
inline constexpr uint32_t kScoresFreeBarrier = 10;
inline constexpr uint32_t kConsumerThreads = 256;
inline constexpr uint32_t kDqHandoffThreads = 128 + 32;  // a consumer warpgroup and the dQ warp

// Queues X^T = A B^T for the block's 64 rows of A (K or V) against 32 rows of B (Q or dO), both
// K-major over head_dim in 128-byte swizzled column blocks.
template <typename Traits>
__device__ __forceinline__ void IssueTransposedScoresHalf(float (&x)[Traits::kGroupQueries / 2],
                                                          uint32_t a_tile, uint32_t b_rows) {
  const uint64_t a = wgmma::MakeDescriptor(a_tile, 0), b = wgmma::MakeDescriptor(b_rows, 0);
#pragma unroll
  for (int ks = 0; ks < Traits::kHeadDim / 16; ++ks) {
    const uint32_t column = (ks % 4) * 32;
    const uint64_t desc_a = wgmma::DescriptorPlus(a, (ks / 4) * Traits::kBlockN * 128 + column);
    const uint64_t desc_b = wgmma::DescriptorPlus(b, (ks / 4) * Traits::kBlockM * 128 + column);
    wgmma::MmaSS_32(x, desc_a, desc_b, ks > 0, typename Traits::Element{});
  }
}

// Queues acc += A^T B over 32 queries: A^T (P^T or dS^T) from registers, or from its stored
// tile starting at those queries' columns; B (dO or Q) from those queries' rows at the
// warpgroup's first column block, MN-major.
template <typename Traits>
__device__ __forceinline__ void IssueKeyGradientFromRegisters(
    float (&acc)[Traits::kGroupColumns / 2], const uint32_t (&a)[Traits::kGroupQueries / 16][4],
    uint32_t b_rows) {
  const uint64_t b = wgmma::MakeDescriptor(b_rows, Traits::kBlockM * 128);
#pragma unroll
  for (int ks = 0; ks < Traits::kGroupQueries / 16; ++ks) {
    const uint64_t desc_b = wgmma::DescriptorPlus(b, ks * 16 * 128);
    wgmma::MmaRS_128(acc, a[ks], desc_b, typename Traits::Element{});
  }
}
template <typename Traits>
__device__ __forceinline__ void IssueKeyGradientFromShared(float (&acc)[Traits::kGroupColumns / 2],
                                                           uint32_t a_columns, uint32_t b_rows) {
  const uint64_t a = wgmma::MakeDescriptor(a_columns, 0);
  const uint64_t b = wgmma::MakeDescriptor(b_rows, Traits::kBlockM * 128);
#pragma unroll
  for (int ks = 0; ks < Traits::kGroupQueries / 16; ++ks) {
    const uint64_t desc_a = wgmma::DescriptorPlus(a, ks * 32);
    const uint64_t desc_b = wgmma::DescriptorPlus(b, ks * 16 * 128);
    wgmma::MmaSSMnMajorB_128(acc, desc_a, desc_b, 1, typename Traits::Element{});
  }
}

// Where warpgroup w stages a tile's dQ: over the tile's spent Q (w = 0) or dO (w = 1).
template <typename Traits>
__device__ __forceinline__ uint32_t DqStagingOffset(int w, int stage) {
  return static_cast<uint32_t>((w == 0 ? Traits::kQOffset : Traits::kDoOffset) +
                               stage * Traits::kQTileBytes);
}

// The dQ warp: for each tile, once each consumer warpgroup has staged its 64 x 128 block, one
// lane adds its four boxes into the accumulator; once both blocks are read out (deterministic:
// added, after the key blocks below this one that meet the tile) it releases the stage to the
// producer. Rows past the sequence carry zeros, as in the kernel of 128 keys.
template <typename Traits>
__device__ __forceinline__ void ReduceStagedQueryGradients(
    const FusedBackwardTmaParams& params, const sm90_backward::Barriers<Traits>& bars,
    uint32_t smem, const SequenceView<int64_t>& seq, const QueryTiles& tiles,
    const sm90_backward::TileOrigin& at, int kv_head) {
  constexpr int kGroups = Traits::kConsumerWarpGroups;
  const FusedBackwardParams& p = params.p;
  const bool leader = threadIdx.x % 32 == 0;
  tma::PrefetchTensorMap(&params.dq_map);
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int stage = sm90_backward::StageOf<Traits::kStages>(t);
    const int head = tiles.head(t, kv_head);
    const int64_t row0 = tiles.row0(t, Traits::kBlockM);
    int* counter = nullptr;
#pragma unroll
    for (int w = 0; w < kGroups; ++w) {
      tma::NamedBarrierSync(kDqStagedBarrier + 2 * w + static_cast<int>(t % 2), kDqHandoffThreads);
      if (leader) {
        if (p.deterministic && w == 0) {
          counter =
              DqTileCounter(params.dq_tile_counters, params.query_tiles, p.num_heads, head, row0);
          WaitForTurn(counter, DqTurn(p, seq, row0, Traits::kBlockN));
          tma::FenceGlobalAfterBulk();
        }
        const uint32_t staged = smem + DqStagingOffset<Traits>(w, stage);
#pragma unroll
        for (int b = 0; b < Traits::kGroupColumns / Traits::kDqBoxColumns; ++b) {
          tma::ReduceAdd4d(&params.dq_map, staged + b * Traits::kDqBoxBytes,
                           w * Traits::kGroupColumns + b * Traits::kDqBoxColumns,
                           at.q_row + static_cast<int>(row0), head, at.sequence);
        }
        tma::BulkCommit();
      }
    }
    if (leader) {
      if (!p.deterministic) {
        tma::BulkWaitRead();
      } else {
        tma::BulkWait();
        tma::FenceGlobalAfterBulk();
        PassTurn(counter);
      }
      tma::Arrive(bars.empty(stage));
    }
    __syncwarp();
  }
  tma::BulkWait();  // the last rows added before the warp goes
}

}  // namespace sm90_backward_wide

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    FusedBackwardSm90WideKernel(const __grid_constant__ FusedBackwardTmaParams params) {
#ifdef ATTN_WGMMA_AVAILABLE
  using namespace sm90_backward_wide;
  using sm90_backward::Barriers;
  using sm90_backward::ParityOf;
  using sm90_backward::StageOf;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kQTiles = Traits::kQTiles;
  constexpr int kGroupQueries = Traits::kGroupQueries;
  constexpr int kGroupColumns = Traits::kGroupColumns;
  constexpr int kStatsFloats = Traits::kStatsFloats;
  const FusedBackwardParams& p = params.p;

  const SequenceView<int64_t> seq = SequenceOf<int64_t>(p, blockIdx.z);
  const int64_t k0 = int64_t{blockIdx.x} * kBlockN;
  if (k0 >= seq.seqlen_k) return;
  const int64_t keys = Min64(kBlockN, seq.seqlen_k - k0);
  const int kv_head = blockIdx.y;
  const QueryTiles tiles(p, seq, k0, keys, kBlockM);

  extern __shared__ __align__(1024) unsigned char swizzled_smem[];
  const uint32_t smem = ptx::SharedAddress(swizzled_smem);
  const Barriers<Traits> bars{smem + Traits::kBarrierOffset};

  if (threadIdx.x == 0) bars.Init(1);  // a stage: the dQ warp, once the stage's dQ is read out
  __syncthreads();

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    tma::ReleaseRegisters<kSm90BackwardProducerRegisters>();
    if (tiles.count > 0) {
      const sm90_backward::TileOrigin at = sm90_backward::TileOrigin::Of(p, seq);
      if (threadIdx.x == 0) {
        sm90_backward::ProduceTiles<Traits>(params, bars, smem, tiles, at, k0, kv_head);
      } else if (threadIdx.x / 32 == 1) {
        ReduceStagedQueryGradients<Traits>(params, bars, smem, seq, tiles, at, kv_head);
      }
    }
    return;
  }
  tma::ClaimRegisters<kSm90BackwardConsumerRegisters>();

  const int consumer = warp_group - 1;
  const int other = 1 - consumer;
  const int group_thread = threadIdx.x % 128;
  const int lane = threadIdx.x % 32;
  const int pair = (lane % 4) * 2;
  const int key_row = group_thread / 32 * 16 + lane / 4;  // in the block; + 8 for the second
  const int own_queries = consumer * kGroupQueries;       // of the tile, for S^T and dP^T
  const int other_queries = other * kGroupQueries;
  // This warpgroup's columns of dK, dV and dQ: two 64-column blocks of the tiles.
  const uint32_t column_blocks = consumer * (kGroupColumns / 64) * kBlockM * 128;
  const uint32_t k_tile = smem + Traits::kKOffset;
  const uint32_t v_tile = smem + Traits::kVOffset;
  const uint32_t p_tile = smem + Traits::kPOffset;
  const uint32_t ds_tile = smem + Traits::kDsOffset;
  float* stats =
      reinterpret_cast<float*>(swizzled_smem + Traits::kStatsOffset) + consumer * 2 * kStatsFloats;
  const float scale_log2 = p.scale * static_cast<float>(M_LOG2E);
  const int64_t shift = seq.seqlen_k - seq.seqlen_q;

  float dk[kGroupColumns / 2], dv[kGroupColumns / 2];
#pragma unroll
  for (int i = 0; i < kGroupColumns / 2; ++i) dk[i] = dv[i] = 0.f;

  if (tiles.count > 0) {
    sm90_backward::RowStatistics<Traits> first;
    first.Load(params, seq, tiles, kv_head, 0, group_thread);
    first.Store(stats, group_thread);
    tma::NamedBarrierSync(kStatsBarrier + consumer, 128);
    tma::Wait(bars.kv_full(), 0);
  }
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int stage = StageOf<kStages>(t);
    const int slot = static_cast<int>(t % 2);
    const int64_t row0 = tiles.row0(t, kBlockM);
    const int64_t rows = Min64(kBlockM, seq.seqlen_q - row0);
    const uint32_t q_stage = smem + Traits::kQOffset + stage * Traits::kQTileBytes;
    const uint32_t do_stage = smem + Traits::kDoOffset + stage * Traits::kQTileBytes;
    tma::Wait(bars.full(stage), ParityOf<kStages>(t));

    float s[kGroupQueries / 2], dp[kGroupQueries / 2];
    wgmma::Fence();
    IssueTransposedScoresHalf<Traits>(s, k_tile, q_stage + own_queries * 128);
    wgmma::CommitGroup();
    IssueTransposedScoresHalf<Traits>(dp, v_tile, do_stage + own_queries * 128);
    wgmma::CommitGroup();
    sm90_backward::RowStatistics<Traits> next;
    next.Load(params, seq, tiles, kv_head, t + 1, group_thread);

    // P^T = exp2(S^T scale log2(e) - LSE); the mask where the tile crosses the window's edges,
    // the sequence's last key or the block's end (rows past the sequence have LSE = +inf).
    const float* lse = stats + slot * kStatsFloats + own_queries;
    const float* delta = lse + kBlockM;
    const int64_t last_row = row0 + rows - 1;
    const bool masked = keys < kBlockN ||
                        (p.window_right >= 0 && k0 + kBlockN - 1 > row0 + shift + p.window_right) ||
                        (p.window_left >= 0 && k0 < last_row + shift - p.window_left);
    const ElementMask mask(p.window_left, p.window_right, k0 + key_row, row0 + own_queries + pair,
                           seq.seqlen_q, seq.seqlen_k, k0 + keys);
    sm90_backward::ScoresToGradients<kQTiles>(s, dp, lse, delta, pair, scale_log2, masked, mask);
    uint32_t p_frag[kGroupQueries / 16][4], ds_frag[kGroupQueries / 16][4];
    sm90_backward::PackFragments<Element, kQTiles>(s, p_frag);
    sm90_backward::PackFragments<Element, kQTiles>(dp, ds_frag);

    // This warpgroup's queries of P^T and dS^T (keys x queries, one swizzled column block) for
    // the other's dV and dK and both dQ blocks. Their last readers, tile t - 1's products, are
    // done: both warpgroups waited for theirs before the stage-read barrier, but for the other's
    // second dQ block.
    if (t > 0) tma::NamedBarrierSync(kScoresFreeBarrier + other, kConsumerThreads);
    unsigned char* p_stored = swizzled_smem + Traits::kPOffset;
    unsigned char* ds_stored = swizzled_smem + Traits::kDsOffset;
#pragma unroll
    for (int ks = 0; ks < kGroupQueries / 16; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = own_queries + ks * 16 + half * 8 + pair;
        const int upper = wgmma::SwizzledByteOffset(key_row, col, kBlockN);
        const int lower = wgmma::SwizzledByteOffset(key_row + 8, col, kBlockN);
        *reinterpret_cast<uint32_t*>(p_stored + upper) = p_frag[ks][2 * half];
        *reinterpret_cast<uint32_t*>(p_stored + lower) = p_frag[ks][2 * half + 1];
        *reinterpret_cast<uint32_t*>(ds_stored + upper) = ds_frag[ks][2 * half];
        *reinterpret_cast<uint32_t*>(ds_stored + lower) = ds_frag[ks][2 * half + 1];
      }
    }
    wgmma::FenceSharedForAsyncProxy();
    tma::NamedBarrierArrive(kScoresStoredBarrier + consumer, kConsumerThreads);

    // dV += P^T dO and dK += dS^T Q over this warpgroup's queries, then the other's.
    wgmma::Fence();
    IssueKeyGradientFromRegisters<Traits>(dv, p_frag, do_stage + column_blocks + own_queries * 128);
    IssueKeyGradientFromRegisters<Traits>(dk, ds_frag, q_stage + column_blocks + own_queries * 128);
    wgmma::CommitGroup();
    tma::NamedBarrierSync(kScoresStoredBarrier + other, kConsumerThreads);
    wgmma::Fence();
    IssueKeyGradientFromShared<Traits>(dv, p_tile + other_queries * 2,
                                       do_stage + column_blocks + other_queries * 128);
    IssueKeyGradientFromShared<Traits>(dk, ds_tile + other_queries * 2,
                                       q_stage + column_blocks + other_queries * 128);
    wgmma::CommitGroup();
    // dQ = dS K of the tile's rows, this warpgroup's columns, a 64-column block at a time (the
    // accumulators of both would not fit beside dK's and dV's), once the products reading P^T
    // and dS^T from registers are done.
    wgmma::WaitGroup<1>();
    float dq[Traits::kDqColumns / 2];
    sm90_backward::IssueQueryGradient<Traits>(dq, ds_tile, k_tile, consumer * kGroupColumns);
    wgmma::CommitGroup();
    next.Store(stats + (1 - slot) * kStatsFloats, group_thread);

    wgmma::WaitGroup<0>();
    wgmma::FenceOperands(dq);
    wgmma::FenceOperands(dk);
    wgmma::FenceOperands(dv);
    tma::NamedBarrierSync(kStageReadBarrier, kConsumerThreads);
    // The stage's Q and dO are spent: this warpgroup's dQ goes over one of them.
    unsigned char* staged = swizzled_smem + DqStagingOffset<Traits>(consumer, stage);
    constexpr int kDqBlockBytes =
        (Traits::kDqColumns / Traits::kDqBoxColumns) * Traits::kDqBoxBytes;
    static_assert(Traits::kDqBlocks == 2, "two dQ blocks a warpgroup");
    sm90_backward::StoreStagedQueryGradient<Traits::kDqColumns, true>(dq, staged, p.scale);
    wgmma::Fence();
    sm90_backward::IssueQueryGradient<Traits>(dq, ds_tile, k_tile,
                                              consumer * kGroupColumns + Traits::kDqColumns);
    wgmma::CommitGroup();
    wgmma::WaitGroup<0>();
    wgmma::FenceOperands(dq);
    // This warpgroup no longer reads dS^T: the other may store the next tile's.
    if (t + 1 < tiles.count)
      tma::NamedBarrierArrive(kScoresFreeBarrier + consumer, kConsumerThreads);
    sm90_backward::StoreStagedQueryGradient<Traits::kDqColumns, true>(dq, staged + kDqBlockBytes,
                                                                      p.scale);
    wgmma::FenceSharedForAsyncProxy();
    tma::NamedBarrierArrive(kDqStagedBarrier + 2 * consumer + slot, kDqHandoffThreads);
  }

  // dK (scaled) and dV of the block's keys, this warpgroup's columns, to the dtype.
  sm90_backward::StoreKeyGradients<Element, kGroupColumns>(params, seq, dk, dv, k0, keys, kv_head,
                                                           key_row, pair, consumer * kGroupColumns);
#endif  // ATTN_WGMMA_AVAILABLE
}

}  // namespace attn::cuda
