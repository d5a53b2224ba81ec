// The Hopper backward (sm_90a): the algorithm of fused_backward_kernel.cuh (see fused_backward.h)
// with its loads on the copy engine, its five matrix products on warpgroup MMA, and each query
// tile's dQ added into the float32 accumulator by bulk reductions of whole rows instead of
// per-element atomics.
//
// A CTA owns kBlockN = 128 keys of one (sequence, KV head) and runs three warpgroups:
//   - the producer warpgroup: one thread loads K and V by TMA once, then each query tile's Q and
//     dO into a kStages ring of `full` / `empty` mbarriers; a second warp adds each tile's
//     staged dQ rows into the accumulator (cp.reduce.async.bulk), in key-block order when
//     deterministic, so that the consumers never wait on global memory;
//   - two consumer warpgroups of 64 keys each, which per query tile of kBlockM rows compute
//       S^T = K Q^T and dP^T = V dO^T               (both queued at once)
//       P^T = exp2(S^T scale log2(e) - LSE)  and  dS^T = P^T (dP^T - D)
//       dV += P^T dO  and  dK += dS^T Q            (P^T, dS^T from registers)
//       dS^T into shared memory; the two warpgroups meet
//       dQ[:, half] = dS K[:, half]                 (each warpgroup half of head_dim)
//       dQ scale staged in shared memory (float32) for the dQ warp.
//     They load the next tile's LSE (base 2) and D rows themselves while this tile's products
//     run, into one of two slots that the barrier after dS^T publishes.
// Keys are the MMA rows (S^T rather than S) so that P^T and dS^T come out of the accumulators
// in the A-fragment layout dV's and dK's MMAs read from registers; dQ reads dS^T and K where
// they lie, both MN-major.
//
// Deterministic mode (dq_order.cuh): the dQ warp adds a tile's rows in key-block order.
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "attn/mask.h"
#include "cuda/common/element_convert.cuh"
#include "cuda/fused/backward_tiles.cuh"
#include "cuda/fused/dq_order.cuh"
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
  static constexpr int kBlockM = Sm90BackwardBlockM(kHeadDim);  // query rows per tile
  static constexpr int kBlockN = 128;  // keys per CTA, 64 per consumer warpgroup
  static constexpr int kStages = 2;    // query tiles in flight
  static constexpr int kConsumerWarpGroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpGroups;
  static constexpr int kThreads = 128 + kConsumerThreads;  // the producer warpgroup first
  static constexpr int kColumnBlocks = kHeadDim / 64;      // 128-byte column blocks of a row
  static constexpr int kDTiles = kHeadDim / 8;             // 8-column tiles of dK, dV
  static constexpr int kQTiles = kBlockM / 8;              // 8-query column tiles of S^T
  static constexpr int kQuerySlices = kBlockM / 64;        // m64 slices of dQ
  static constexpr int kDqColumns = kHeadDim / kConsumerWarpGroups;  // each warpgroup's dQ
  // Staged dQ rows are padded by 16 bytes (fewer bank conflicts; rows stay 16-byte aligned for
  // the bulk reduction).
  static constexpr int kDqRowFloats = kHeadDim + 4;
  static constexpr int kKVTileBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQTileBytes = kBlockM * kHeadDim * 2;
  // K, V, the Q stages, the dO stages and dS^T (128-byte swizzled, each tile and column block
  // 1024-byte aligned); staged dQ; two slots of LSE rows and of D rows; the mbarriers: K/V
  // full, then per stage full and empty.
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKVTileBytes;
  static constexpr int kQOffset = 2 * kKVTileBytes;
  static constexpr int kDoOffset = kQOffset + kStages * kQTileBytes;
  static constexpr int kDsOffset = kDoOffset + kStages * kQTileBytes;
  static constexpr int kDqOffset = kDsOffset + kBlockN * kBlockM * 2;
  static constexpr int kLseOffset = kDqOffset + kBlockM * kDqRowFloats * 4;
  static constexpr int kDeltaOffset = kLseOffset + 2 * kBlockM * 4;
  static constexpr int kBarrierOffset = kDeltaOffset + 2 * kBlockM * 4;
  static constexpr int kSmemBytes = kBarrierOffset + 8 * (1 + 2 * kStages);
  static_assert(kHeadDim == 64 || kHeadDim == 128, "wgmma shapes for head_dim 64 and 128");
  static_assert(kBlockM == 64 || kBlockM == 128, "S^T tiles are m64n64 or m64n128");
  static_assert(2 * kBlockM <= kConsumerThreads, "a consumer thread loads one LSE or D row");
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
  int* dq_tile_counters = nullptr;  // deterministic mode: [batch, num_heads, query_tiles]
  int64_t query_tiles = 0;          // per (sequence, head), of kDqCounterRows rows
  bool aligned_outputs = false;     // dK, dV rows 4-byte aligned for paired stores
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
  CUtensorMap do_map;
};

namespace sm90_backward {

// Named barrier ids (0 is __syncthreads): both consumer warpgroups' dS^T stored (and the next
// tile's LSE and D rows); their dQ halves staged, for the dQ warp; the staged dQ read out, for
// the consumers.
inline constexpr uint32_t kDsStoredBarrier = 1;
inline constexpr uint32_t kDqStagedBarrier = 2;
inline constexpr uint32_t kDqFreeBarrier = 3;
inline constexpr uint32_t kDqHandoffThreads = 256 + 32;  // the consumers and the dQ warp

template <typename Traits>
struct Barriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t kv_full() const { return base; }
  __device__ __forceinline__ uint32_t full(int stage) const { return base + 8 * (1 + stage); }
  __device__ __forceinline__ uint32_t empty(int stage) const {
    return base + 8 * (1 + Traits::kStages + stage);
  }
};

// The stage and phase parity of the t-th tile of the ring.
template <int kStages>
__device__ __forceinline__ int StageOf(int64_t t) {
  return static_cast<int>(t % kStages);
}
template <int kStages>
__device__ __forceinline__ uint32_t ParityOf(int64_t t) {
  return static_cast<uint32_t>((t / kStages) & 1);
}

// Queues X^T = A B^T for a warpgroup's 64 rows of A (K or V) against a tile of kBlockM rows of
// B (Q or dO), both K-major over head_dim: head_dim / 16 k-steps of 32 bytes in the swizzled rows.
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
    if constexpr (Traits::kBlockM == 128) {
      wgmma::MmaSS_128(x, desc_a, desc_b, ks > 0, typename Traits::Element{});
    } else {
      wgmma::MmaSS_64(x, desc_a, desc_b, ks > 0, typename Traits::Element{});
    }
  }
}

// Queues acc += A^T B over the tile's kBlockM query rows: A^T (P^T or dS^T) from registers, B (dO
// or Q) read MN-major from its stage.
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

// The producer thread: K and V once, then each query tile's Q and dO into the next stage once
// the consumers have released it.
template <typename Traits>
__device__ __forceinline__ void ProduceTiles(const FusedBackwardTmaParams& params,
                                             const Barriers<Traits>& bars, uint32_t smem,
                                             const QueryTiles& tiles, const TileOrigin& at,
                                             int64_t k0, int kv_head) {
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
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int stage = StageOf<Traits::kStages>(t);
    const int head = tiles.head(t, kv_head);
    const int row = at.q_row + static_cast<int>(tiles.row0(t, Traits::kBlockM));
    tma::Wait(bars.empty(stage), ParityOf<Traits::kStages>(t) ^ 1);
    tma::ArriveExpectBytes(bars.full(stage), 2 * Traits::kQTileBytes);
    const uint32_t q_stage = smem + Traits::kQOffset + stage * Traits::kQTileBytes;
    const uint32_t do_stage = smem + Traits::kDoOffset + stage * Traits::kQTileBytes;
#pragma unroll
    for (int cb = 0; cb < Traits::kColumnBlocks; ++cb) {
      const uint32_t block = cb * Traits::kBlockM * 128;
      tma::Load4d(q_stage + block, &params.q_map, bars.full(stage), cb * 64, row, head,
                  at.sequence);
      tma::Load4d(do_stage + block, &params.do_map, bars.full(stage), cb * 64, row, head,
                  at.sequence);
    }
  }
}

// The dQ warp: for each tile, once the consumers have staged it, adds its rows into the
// accumulator, then hands the staging back once the copy engine has read it. Deterministic:
// lane 0 alone, after the key blocks below this one that meet the tile, then counts this one
// in.
template <typename Traits>
__device__ __forceinline__ void ReduceQueryGradients(const FusedBackwardTmaParams& params,
                                                     uint32_t staged,
                                                     const SequenceView<int64_t>& seq,
                                                     const QueryTiles& tiles, int kv_head) {
  const FusedBackwardParams& p = params.p;
  const int lane = threadIdx.x % 32;
  constexpr uint32_t kRowBytes = Traits::kHeadDim * 4;
  constexpr uint32_t kStagedRowBytes = Traits::kDqRowFloats * 4;
  const int64_t row_stride = int64_t{p.num_heads} * Traits::kHeadDim;
  tma::NamedBarrierArrive(kDqFreeBarrier, kDqHandoffThreads);
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int head = tiles.head(t, kv_head);
    const int64_t row0 = tiles.row0(t, Traits::kBlockM);
    const int rows = static_cast<int>(Min64(Traits::kBlockM, seq.seqlen_q - row0));
    float* dq_rows =
        params.dq_accum + ((seq.q_start + row0) * p.num_heads + head) * Traits::kHeadDim;
    tma::NamedBarrierSync(kDqStagedBarrier, kDqHandoffThreads);
    if (!p.deterministic) {
      for (int r = lane; r < rows; r += 32) {
        tma::ReduceAddF32(dq_rows + r * row_stride, staged + r * kStagedRowBytes, kRowBytes);
      }
      tma::BulkCommit();
      tma::BulkWaitRead();
    } else if (lane == 0) {
      int* counter =
          DqTileCounter(params.dq_tile_counters, params.query_tiles, p.num_heads, head, row0);
      WaitForTurn(counter, DqTurn(p, seq, row0, Traits::kBlockN));
      tma::FenceGlobalAfterBulk();
      for (int r = 0; r < rows; ++r) {
        tma::ReduceAddF32(dq_rows + r * row_stride, staged + r * kStagedRowBytes, kRowBytes);
      }
      tma::BulkCommit();
      tma::BulkWait();
      tma::FenceGlobalAfterBulk();
      PassTurn(counter);
    }
    __syncwarp();
    // Every barrier's arrivals match its waits: the consumers wait once per tile.
    if (t + 1 < tiles.count) tma::NamedBarrierArrive(kDqFreeBarrier, kDqHandoffThreads);
  }
  tma::BulkWait();  // the last rows added before the warp (and the staging) goes
}

// One consumer thread's share of a tile's LSE (base 2) and D rows, loaded while the tile before
// runs: thread i < kBlockM loads LSE row i, thread kBlockM + i D row i. A row outside the
// sequence or one that saw no key gets LSE +inf, so that its P is 0.
template <typename Traits>
struct RowStatistics {
  float value = 0.f;
  int row = -1;      // within the tile; -1: this thread loads nothing
  bool lse = false;  // LSE rather than D

  __device__ void Load(const FusedBackwardTmaParams& params, const SequenceView<int64_t>& seq,
                       const QueryTiles& tiles, int kv_head, int64_t t, int consumer_thread) {
    row = -1;
    if (t >= tiles.count || consumer_thread >= 2 * Traits::kBlockM) return;
    lse = consumer_thread < Traits::kBlockM;
    row = consumer_thread % Traits::kBlockM;
    const int64_t row0 = tiles.row0(t, Traits::kBlockM);
    value = lse ? INFINITY : 0.f;
    if (row0 + row < seq.seqlen_q) {
      const int64_t at = tiles.head(t, kv_head) * params.p.total_q + seq.q_start + row0 + row;
      value = lse ? params.p.lse[at] : params.delta[at];
    }
  }
  __device__ void Store(float* lse_slot, float* delta_slot) const {
    if (row < 0) return;
    if (lse) {
      lse_slot[row] = value == -INFINITY ? INFINITY : value * static_cast<float>(M_LOG2E);
    } else {
      delta_slot[row] = value;
    }
  }
};

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
  float* lse_slots = reinterpret_cast<float*>(swizzled_smem + Traits::kLseOffset);
  float* delta_slots = reinterpret_cast<float*>(swizzled_smem + Traits::kDeltaOffset);
  float* dq_staged = reinterpret_cast<float*>(swizzled_smem + Traits::kDqOffset);
  const Barriers<Traits> bars{smem + Traits::kBarrierOffset};

  if (threadIdx.x == 0) {
    tma::InitBarrier(bars.kv_full(), 1);
#pragma unroll
    for (int stage = 0; stage < kStages; ++stage) {
      tma::InitBarrier(bars.full(stage), 1);
      tma::InitBarrier(bars.empty(stage), kConsumerThreads / 32);  // one per consumer warp
    }
    tma::FenceBarrierInit();
  }
  __syncthreads();

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    tma::ReleaseRegisters<kSm90BackwardProducerRegisters>();
    if (tiles.count > 0) {
      if (threadIdx.x == 0) {
        const bool varlen = p.cu_seqlens_q != nullptr;
        const TileOrigin at{varlen ? static_cast<int>(seq.q_start) : 0,
                            varlen ? static_cast<int>(seq.k_start) : 0,
                            varlen ? 0 : static_cast<int>(blockIdx.z)};
        ProduceTiles<Traits>(params, bars, smem, tiles, at, k0, kv_head);
      } else if (threadIdx.x / 32 == 1) {
        ReduceQueryGradients<Traits>(params, smem + Traits::kDqOffset, seq, tiles, kv_head);
      }
    }
    return;
  }
  tma::ClaimRegisters<kSm90BackwardConsumerRegisters>();

  const int consumer = warp_group - 1;
  const int consumer_thread = threadIdx.x - 128;
  const int warp = (threadIdx.x % 128) / 32;  // within the warpgroup: 16 of its 64 keys
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;
  const int pair = (lane % 4) * 2;
  const int key_row = consumer * 64 + warp * 16 + quad_row;  // in the block; + 8 for the second
  const uint32_t k_tile = smem + Traits::kKOffset;
  const uint32_t v_tile = smem + Traits::kVOffset;
  const uint32_t ds_tile = smem + Traits::kDsOffset;
  const float scale_log2 = p.scale * static_cast<float>(M_LOG2E);
  const int64_t shift = seq.seqlen_k - seq.seqlen_q;

  float dk[kHeadDim / 2], dv[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dk[i] = dv[i] = 0.f;

  if (tiles.count > 0) {
    // Tile 0's LSE and D rows into slot 0; later tiles' load while the tile before runs.
    RowStatistics<Traits> next;
    next.Load(params, seq, tiles, kv_head, 0, consumer_thread);
    next.Store(lse_slots, delta_slots);
    tma::NamedBarrierSync(kDsStoredBarrier, kConsumerThreads);
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

    float s[kBlockM / 2], dp[kBlockM / 2];
    wgmma::Fence();
    IssueTransposedScores<Traits>(s, k_tile + consumer * 64 * 128, q_stage);
    wgmma::CommitGroup();
    IssueTransposedScores<Traits>(dp, v_tile + consumer * 64 * 128, do_stage);
    wgmma::CommitGroup();
    RowStatistics<Traits> next;
    next.Load(params, seq, tiles, kv_head, t + 1, consumer_thread);

    // P^T = exp2(S^T scale log2(e) - LSE); the mask where the tile crosses the window's edges,
    // the sequence's last key or the block's end (rows past the sequence have LSE = +inf).
    const float* lse = lse_slots + slot * kBlockM;
    const float* delta = delta_slots + slot * kBlockM;
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

    // dS^T (keys x queries, kBlockM / 64 swizzled column blocks) for dQ, while dV and dK run.
    // The last tile's dQ MMAs are done reading it: both warpgroups waited for them before the
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
    // The next tile's rows go to the other slot, last read in the tile before this one.
    next.Store(lse_slots + (1 - slot) * kBlockM, delta_slots + (1 - slot) * kBlockM);
    tma::NamedBarrierSync(kDsStoredBarrier, kConsumerThreads);

    float dq[Traits::kQuerySlices][kDqColumns / 2];
    wgmma::Fence();
#pragma unroll
    for (int m = 0; m < Traits::kQuerySlices; ++m) {
      IssueQueryGradient<Traits>(dq[m], ds_tile + m * kBlockN * 128, k_tile, consumer * kDqColumns);
    }
    wgmma::CommitGroup();
    wgmma::WaitGroup<0>();
#pragma unroll
    for (int m = 0; m < Traits::kQuerySlices; ++m) wgmma::FenceOperands(dq[m]);
    wgmma::FenceOperands(dk);
    wgmma::FenceOperands(dv);
    // Q, dO of this stage are no longer read.
    if (lane == 0) tma::Arrive(bars.empty(stage));

    // The dQ warp has read out the last tile's staged rows.
    tma::NamedBarrierSync(kDqFreeBarrier, kDqHandoffThreads);
#pragma unroll
    for (int m = 0; m < Traits::kQuerySlices; ++m) {
#pragma unroll
      for (int n = 0; n < kDqColumns / 8; ++n) {
        const int col = consumer * kDqColumns + n * 8 + pair;
        const int row = m * 64 + warp * 16 + quad_row;
        *reinterpret_cast<float2*>(dq_staged + row * Traits::kDqRowFloats + col) =
            make_float2(dq[m][n * 4] * p.scale, dq[m][n * 4 + 1] * p.scale);
        *reinterpret_cast<float2*>(dq_staged + (row + 8) * Traits::kDqRowFloats + col) =
            make_float2(dq[m][n * 4 + 2] * p.scale, dq[m][n * 4 + 3] * p.scale);
      }
    }
    wgmma::FenceSharedForAsyncProxy();
    tma::NamedBarrierArrive(kDqStagedBarrier, kDqHandoffThreads);
  }

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
