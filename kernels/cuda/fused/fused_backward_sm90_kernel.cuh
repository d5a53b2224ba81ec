// The Hopper backward (sm_90a): the algorithm of fused_backward_kernel.cuh (see fused_backward.h)
// with its loads on the copy engine, its five matrix products on warpgroup MMA, and each query
// tile's dQ added into the float32 accumulator by the copy engine, a few tensor boxes a tile,
// instead of per-element atomics.
//
// A CTA owns kBlockN = 128 keys of one (sequence, KV head) and runs three warpgroups:
//   - the producer warpgroup: one thread loads K and V by TMA once, then each query tile's Q and
//     dO into a kStages ring of `full` / `empty` mbarriers; a second warp adds each tile's
//     staged dQ into the accumulator (cp.reduce.async.bulk.tensor, 64-row x 32-column boxes),
//     in key-block order when deterministic, so that the consumers never wait on global memory;
//   - two consumer warpgroups of 64 keys each, which per query tile t of kBlockM rows compute
//       S^T = K Q^T and dP^T = V dO^T               (both queued at once)
//       P^T = exp2(S^T scale log2(e) - LSE)  and  dS^T = P^T (dP^T - D)
//       dV += P^T dO  and  dK += dS^T Q            (P^T, dS^T from registers)
//       dQ of tile t - 1 = dS K                     (64 x 64 of it per warpgroup)
//       dS^T of tile t into one of two shared buffers
//       dQ of tile t - 1, scaled, staged in shared memory (float32) for the dQ warp.
//     dQ needs both warpgroups' dS^T, so it runs a tile late: by then the other warpgroup has
//     long stored its half, and the two warpgroups never wait for each other inside a tile.
//     Running apart, one's exponentials and elementwise work overlap the other's MMAs. Each
//     warpgroup loads the next tile's LSE (base 2) and D rows itself while this tile's products
//     run, into the other of its two slots.
// Keys are the MMA rows (S^T rather than S) so that P^T and dS^T come out of the accumulators
// in the A-fragment layout dV's and dK's MMAs read from registers; dQ reads dS^T and K where
// they lie, both MN-major.
//
// Deterministic mode (dq_order.cuh): the dQ warp adds a tile's boxes in key-block order.
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attn/mask.h"
#include "cuda/common/element_convert.cuh"
#include "cuda/fused/backward_tiles.cuh"
#include "cuda/fused/dq_order.cuh"
#include "cuda/fused/fused_backward.h"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/sequence.cuh"
#include "cuda/fused/staged_rows.cuh"
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
  // Tiles hold whole 128-byte column blocks of 64 elements, as in the forward. At head_dim 96
  // the second block is half used: the copy engine zero-fills columns 96..127 of K, V, Q and dO
  // (past the tensor maps' head_dim), S^T and dP^T stop at column 96, and dV, dK and dQ run 128
  // wide, their last 32 columns (zero) never stored.
  static constexpr int kColumnBlocks = (kHeadDim + 63) / 64;
  static constexpr int kTileColumns = 64 * kColumnBlocks;  // of the tiles and accumulators
  static constexpr int kDTiles = kTileColumns / 8;         // 8-column tiles of dK, dV
  static constexpr int kQTiles = kBlockM / 8;              // 8-query column tiles of S^T
  static constexpr int kQuerySlices = kBlockM / 64;        // m64 slices of a tile's queries
  // Each warpgroup computes 64 x 64 of a tile's dQ: a query slice of every column when the tile
  // has a slice per warpgroup (head_dim 64), else half the columns of the one slice.
  static constexpr bool kDqSplitsRows = kQuerySlices == kConsumerWarpGroups;
  static constexpr int kDqColumns =
      kDqSplitsRows ? kTileColumns : kTileColumns / kConsumerWarpGroups;
  // A warpgroup's staged 64 x 64 dQ block: two boxes of the accumulator's tensor map, 64 rows of
  // 32 floats (128 bytes) each, stored 128-byte swizzled as the copy engine reads them (the
  // swizzle also spreads the consumers' stores over the banks).
  static constexpr int kDqBoxColumns = 32;
  static constexpr int kDqBoxBytes = 64 * kDqBoxColumns * 4;
  static constexpr int kDqBlockBytes = 64 * kDqColumns * 4;
  // Whole boxes: the zero-filled columns count towards the transaction bytes.
  static constexpr int kKVTileBytes = kBlockN * kTileColumns * 2;
  static constexpr int kQTileBytes = kBlockM * kTileColumns * 2;
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  // A slot of row statistics: the tile's LSE (base 2) rows, then its D rows.
  static constexpr int kStatsFloats = 2 * kBlockM;
  // K, V, the Q stages, the dO stages and two dS^T buffers (128-byte swizzled, each tile and
  // column block 1024-byte aligned); staged dQ; per warpgroup two slots of row statistics; the
  // mbarriers: K/V full, then per stage full and empty.
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKVTileBytes;
  static constexpr int kQOffset = 2 * kKVTileBytes;
  static constexpr int kDoOffset = kQOffset + kStages * kQTileBytes;
  static constexpr int kDsOffset = kDoOffset + kStages * kQTileBytes;
  static constexpr int kDqOffset = kDsOffset + 2 * kDsBytes;
  static constexpr int kStatsOffset = kDqOffset + kConsumerWarpGroups * kDqBlockBytes;
  static constexpr int kBarrierOffset = kStatsOffset + kConsumerWarpGroups * 2 * kStatsFloats * 4;
  // Then each consumer warp's 8 staged rows of dK and dV (staged_rows.cuh), one after the other.
  static constexpr int kStagingOffset = (kBarrierOffset + 8 * (1 + 2 * kStages) + 15) / 16 * 16;
  static constexpr int kWarpStagingBytes = attn::cuda::kWarpStagingBytes<kHeadDim * 2>;
  static constexpr int kSmemBytes = kStagingOffset + kConsumerThreads / 32 * kWarpStagingBytes;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128,
                "dK and dV are m64n64 or m64n128 (head_dim 96 and 128)");
  static_assert(kBlockM == 64 || kBlockM == 128, "S^T tiles are m64n64 or m64n128");
  static_assert(kDqColumns == 64, "dQ MMAs are m64n64");
  static_assert(kStatsFloats % 128 == 0, "a warpgroup's threads load a slot in whole passes");
  static_assert(kQTileBytes % 1024 == 0 && kDsOffset % 1024 == 0 && kDsBytes % 1024 == 0,
                "swizzled tiles aligned");
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
  bool aligned_outputs = false;     // dK, dV rows 16-byte aligned (staged and paired stores)
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
  CUtensorMap do_map;
  CUtensorMap dq_map;  // dq_accum, float32, boxes of 64 rows x 32 columns
};

namespace sm90_backward {

// Named barrier ids (0 is __syncthreads), per consumer warpgroup w:
//   kStatsBarrier + w: w's own threads (its dS^T stores and next tile's row statistics placed);
//   kDsStoredBarrier + 2 w + (t % 2): w has stored tile t's dS^T and its dQ MMAs of tile t - 1
//     are done with the other buffer; w arrives, the other warpgroup syncs before its dQ MMAs
//     of tile t (two ids, so that an arrival never meets the previous tile's unconsumed one);
//   kDqStagedBarrier + w, kDqFreeBarrier + w: w's dQ rows staged for the dQ warp / read out.
inline constexpr uint32_t kStatsBarrier = 1;
inline constexpr uint32_t kDsStoredBarrier = 3;
inline constexpr uint32_t kDqStagedBarrier = 7;
inline constexpr uint32_t kDqFreeBarrier = 9;
inline constexpr uint32_t kDsStoredThreads = 256;        // both consumer warpgroups
inline constexpr uint32_t kDqHandoffThreads = 128 + 32;  // a consumer warpgroup and the dQ warp

template <typename Traits>
struct Barriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t kv_full() const { return base; }
  __device__ __forceinline__ uint32_t full(int stage) const { return base + 8 * (1 + stage); }
  __device__ __forceinline__ uint32_t empty(int stage) const {
    return base + 8 * (1 + Traits::kStages + stage);
  }
  // By one thread, before the CTA's first __syncthreads: a stage is released by
  // `empty_arrivals` arrivals.
  __device__ __forceinline__ void Init(uint32_t empty_arrivals) const {
    tma::InitBarrier(kv_full(), 1);
#pragma unroll
    for (int stage = 0; stage < Traits::kStages; ++stage) {
      tma::InitBarrier(full(stage), 1);
      tma::InitBarrier(empty(stage), empty_arrivals);
    }
    tma::FenceBarrierInit();
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
// B (Q or dO), both K-major over head_dim: head_dim / 16 k-steps of 32 bytes in the swizzled rows
// (at 96, none over the zero-filled columns).
template <typename Traits>
__device__ __forceinline__ void IssueTransposedScores(float (&x)[Traits::kBlockM / 2],
                                                      uint32_t a_rows, uint32_t b_tile) {
  const uint64_t a = wgmma::MakeDescriptor(a_rows, 0), b = wgmma::MakeDescriptor(b_tile, 0);
#pragma unroll
  for (int ks = 0; ks < Traits::kHeadDim / 16; ++ks) {
    const uint32_t column = (ks % 4) * 32;
    const uint64_t desc_a = wgmma::DescriptorPlus(a, (ks / 4) * Traits::kBlockN * 128 + column);
    const uint64_t desc_b = wgmma::DescriptorPlus(b, (ks / 4) * Traits::kBlockM * 128 + column);
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
__device__ __forceinline__ void IssueKeyGradient(float (&acc)[Traits::kTileColumns / 2],
                                                 const uint32_t (&a)[Traits::kBlockM / 16][4],
                                                 uint32_t b_tile) {
  const uint64_t b = wgmma::MakeDescriptor(b_tile, Traits::kBlockM * 128);
#pragma unroll
  for (int ks = 0; ks < Traits::kBlockM / 16; ++ks) {
    const uint64_t desc_b = wgmma::DescriptorPlus(b, ks * 16 * 128);
    if constexpr (Traits::kTileColumns == 128) {
      wgmma::MmaRS_128(acc, a[ks], desc_b, typename Traits::Element{});
    } else {
      wgmma::MmaRS_64(acc, a[ks], desc_b, typename Traits::Element{});
    }
  }
}

// Queues a 64 x 64 block of dQ = dS K over the block's 128 keys: the query slice that starts at
// ds_slice of the stored dS^T, K's columns from first_column, both read MN-major (16 keys a
// k-step, 2 KiB of rows).
template <typename Traits>
__device__ __forceinline__ void IssueQueryGradient(float (&dq)[Traits::kDqColumns / 2],
                                                   uint32_t ds_slice, uint32_t k_tile,
                                                   int first_column) {
  const uint32_t k_columns =
      k_tile + (first_column / 64) * Traits::kBlockN * 128 + (first_column % 64) * 2;
  const uint64_t ds = wgmma::MakeDescriptor(ds_slice, Traits::kBlockN * 128);
  const uint64_t k = wgmma::MakeDescriptor(k_columns, Traits::kBlockN * 128);
#pragma unroll
  for (int ks = 0; ks < Traits::kBlockN / 16; ++ks) {
    const uint64_t desc_ds = wgmma::DescriptorPlus(ds, ks * 16 * 128);
    const uint64_t desc_k = wgmma::DescriptorPlus(k, ks * 16 * 128);
    wgmma::MmaSSMnMajor_64(dq, desc_ds, desc_k, ks > 0, typename Traits::Element{});
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

  __device__ static TileOrigin Of(const FusedBackwardParams& p, const SequenceView<int64_t>& seq) {
    const bool varlen = p.cu_seqlens_q != nullptr;
    return {varlen ? static_cast<int>(seq.q_start) : 0, varlen ? static_cast<int>(seq.k_start) : 0,
            varlen ? 0 : static_cast<int>(blockIdx.z)};
  }
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

// Where consumer warpgroup w's 64 x 64 block of a tile's dQ lies: its first row and column.
template <typename Traits>
__device__ __forceinline__ int DqFirstRow(int w) {
  return Traits::kDqSplitsRows ? 64 * w : 0;
}
template <typename Traits>
__device__ __forceinline__ int DqFirstColumn(int w) {
  return Traits::kDqSplitsRows ? 0 : Traits::kDqColumns * w;
}

// The dQ warp: for each tile and each consumer warpgroup, once the warpgroup has staged its
// block, one lane adds the block's two boxes into the accumulator, then hands the staging back
// once the copy engine has read it. Rows of a box past the sequence carry zeros (their P is 0):
// the map drops those past a uniform batch's sequence or the batch's end, and a variable-length
// sequence's next tokens add +0, which leaves every value, and so determinism, as it was.
// Deterministic: after the key blocks below this one that meet the tile, then counts this one
// in once both blocks have landed.
template <typename Traits>
__device__ __forceinline__ void ReduceQueryGradients(const FusedBackwardTmaParams& params,
                                                     uint32_t staged,
                                                     const SequenceView<int64_t>& seq,
                                                     const QueryTiles& tiles, const TileOrigin& at,
                                                     int kv_head) {
  constexpr int kGroups = Traits::kConsumerWarpGroups;
  const FusedBackwardParams& p = params.p;
  const bool leader = threadIdx.x % 32 == 0;
  tma::PrefetchTensorMap(&params.dq_map);
#pragma unroll
  for (int w = 0; w < kGroups; ++w) tma::NamedBarrierArrive(kDqFreeBarrier + w, kDqHandoffThreads);
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int head = tiles.head(t, kv_head);
    const int64_t row0 = tiles.row0(t, Traits::kBlockM);
    const int64_t rows = Min64(Traits::kBlockM, seq.seqlen_q - row0);
    int* counter = nullptr;
#pragma unroll
    for (int w = 0; w < kGroups; ++w) {
      const int first_row = DqFirstRow<Traits>(w);
      tma::NamedBarrierSync(kDqStagedBarrier + w, kDqHandoffThreads);
      if (leader) {
        if (p.deterministic && w == 0) {
          counter =
              DqTileCounter(params.dq_tile_counters, params.query_tiles, p.num_heads, head, row0);
          WaitForTurn(counter, DqTurn(p, seq, row0, Traits::kBlockN));
          tma::FenceGlobalAfterBulk();
        }
        if (first_row < rows) {
#pragma unroll
          for (int b = 0; b < Traits::kDqColumns / Traits::kDqBoxColumns; ++b) {
            // At head_dim 96 the last box lies past the accumulator's columns: nothing to add.
            const int column = DqFirstColumn<Traits>(w) + b * Traits::kDqBoxColumns;
            if (column >= Traits::kHeadDim) continue;
            tma::ReduceAdd4d(&params.dq_map,
                             staged + w * Traits::kDqBlockBytes + b * Traits::kDqBoxBytes, column,
                             at.q_row + static_cast<int>(row0) + first_row, head, at.sequence);
          }
        }
        tma::BulkCommit();
        if (!p.deterministic || w + 1 < kGroups) {
          tma::BulkWaitRead();
        } else {
          tma::BulkWait();
          tma::FenceGlobalAfterBulk();
          PassTurn(counter);
        }
      }
      __syncwarp();
      // Every barrier's arrivals match its waits: the warpgroup waits once per tile.
      if (t + 1 < tiles.count) tma::NamedBarrierArrive(kDqFreeBarrier + w, kDqHandoffThreads);
    }
  }
  tma::BulkWait();  // the last rows added before the warp (and the staging) goes
}

// Tile t's dS^T buffer, of two: an offset into shared memory.
template <typename Traits>
__device__ __forceinline__ uint32_t DsBuffer(int64_t t) {
  return static_cast<uint32_t>(Traits::kDsOffset + (t % 2) * Traits::kDsBytes);
}

// A consumer warpgroup's 64 x 64 block of tile t's dQ, once the other warpgroup has stored its
// half of the tile's dS^T.
template <typename Traits>
__device__ __forceinline__ void IssueQueryGradientBlock(float (&dq)[Traits::kDqColumns / 2],
                                                        uint32_t smem, int64_t t, int consumer) {
  const int other = 1 - consumer;
  tma::NamedBarrierSync(kDsStoredBarrier + 2 * other + t % 2, kDsStoredThreads);
  wgmma::Fence();
  IssueQueryGradient<Traits>(
      dq, smem + DsBuffer<Traits>(t) + (DqFirstRow<Traits>(consumer) / 64) * Traits::kBlockN * 128,
      smem + Traits::kKOffset, DqFirstColumn<Traits>(consumer));
  wgmma::CommitGroup();
}

// A warpgroup's 64-row block of dQ (m64nN accumulators), scaled, into shared memory as boxes
// of the accumulator's tensor map read it: element (r, c) at box c / 32, row r, its 16-byte
// chunk swizzled.
//
// A thread holds two columns of rows r and r + 8 in each 8-column tile, 8 bytes a row; a warp's
// 8-byte stores go to shared memory a half-warp (rows q..q+3 of 8) at a time. With every thread
// on the same tile, the swizzle gives rows q and q ^ 1 the tile's two chunks in swapped places,
// the same banks: 4 wavefronts a store, not 2 (Nsight Compute: 3.5-way conflicts over the
// backward's shared stores). So the thread of row q stores tile n ^ (q % 4) in its n-th store of
// a box, which puts a half-warp's 16 stores on 16 different bank pairs. The registers are
// permuted by two swaps on the thread's own bits, not indexed at run time.
//
// kSpreadBanks chooses that order; the kernels take it where it measured faster (H200,
// 2026-12-03, two rounds beside the tile order in one call: 0.99-1.09x at head_dim 64 and
// 1.01-1.02x at 256, 0.92-1.00x at 128, where the tile order stays, as at 96, which runs 128's
// shapes).
template <int kColumns, bool kSpreadBanks>
__device__ __forceinline__ void StoreStagedQueryGradient(const float (&dq)[kColumns / 2],
                                                         unsigned char* block, float scale) {
  constexpr int kBoxColumns = 32, kBoxBytes = 64 * kBoxColumns * 4;
  constexpr int kTiles = kColumns / 8;
  static_assert(kColumns % kBoxColumns == 0, "whole boxes of four 8-column tiles");
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;
  const int row = (threadIdx.x % 128) / 32 * 16 + quad_row;  // + 8 for the second pair
  const int pair = (lane % 4) * 2;
  const int turn = kSpreadBanks ? quad_row % 4 : 0;  // tile n ^ turn in a box's n-th store

  float v[kColumns / 2];
#pragma unroll
  for (int i = 0; i < kColumns / 2; ++i) v[i] = dq[i] * scale;
#pragma unroll
  for (int bit = 1; bit <= (kSpreadBanks ? 2 : 0); bit *= 2) {
    const bool swap = (turn & bit) != 0;
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
      if (n & bit) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float a = v[n * 4 + e], b = v[(n + bit) * 4 + e];
        v[n * 4 + e] = swap ? b : a;
        v[(n + bit) * 4 + e] = swap ? a : b;
      }
    }
  }
  // Where the n-th store of each box goes (tile n ^ turn, row `row`), for n = 0..3.
  uint32_t offset[4];
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int chunk = (n ^ turn) * 2 + pair / 4;
    offset[n] = row * 128 + ((chunk ^ (row % 8)) * 16) + (pair % 4) * 4;
  }
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    unsigned char* at = block + (n / 4) * kBoxBytes + offset[n % 4];
    *reinterpret_cast<float2*>(at) = make_float2(v[n * 4], v[n * 4 + 1]);
    *reinterpret_cast<float2*>(at + 8 * 128) = make_float2(v[n * 4 + 2], v[n * 4 + 3]);
  }
}

// The block, scaled, into the warpgroup's staging for the dQ warp once the warp has read out the
// one before.
template <typename Traits>
__device__ __forceinline__ void StageQueryGradientBlock(const float (&dq)[Traits::kDqColumns / 2],
                                                        unsigned char* staged, int consumer,
                                                        float scale) {
  static_assert(Traits::kDqBoxColumns == 32, "the accumulator's boxes are 128 bytes wide");
  tma::NamedBarrierSync(kDqFreeBarrier + consumer, kDqHandoffThreads);
  StoreStagedQueryGradient<Traits::kDqColumns, Traits::kHeadDim == 64>(
      dq, staged + consumer * Traits::kDqBlockBytes, scale);
  wgmma::FenceSharedForAsyncProxy();
  tma::NamedBarrierArrive(kDqStagedBarrier + consumer, kDqHandoffThreads);
}

// One consumer thread's share of a tile's row statistics, loaded while the tile before runs:
// each warpgroup keeps its own slots, [LSE (base 2) rows | D rows], and its thread i loads
// entries i, i + 128, ... A row outside the sequence or one that saw no key gets LSE +inf, so
// that its P is 0.
template <typename Traits>
struct RowStatistics {
  static constexpr int kLoads = Traits::kStatsFloats / 128;
  float value[kLoads];
  bool loaded = false;

  __device__ void Load(const FusedBackwardTmaParams& params, const SequenceView<int64_t>& seq,
                       const QueryTiles& tiles, int kv_head, int64_t t, int group_thread) {
    loaded = t < tiles.count;
    if (!loaded) return;
    const int64_t row0 = tiles.row0(t, Traits::kBlockM);
    const int64_t first = tiles.head(t, kv_head) * params.p.total_q + seq.q_start + row0;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int entry = group_thread + 128 * i;
      const bool lse = entry < Traits::kBlockM;
      const int row = entry % Traits::kBlockM;
      value[i] = lse ? INFINITY : 0.f;
      if (row0 + row < seq.seqlen_q) {
        value[i] = lse ? params.p.lse[first + row] : params.delta[first + row];
      }
    }
  }
  __device__ void Store(float* slot, int group_thread) const {
    if (!loaded) return;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int entry = group_thread + 128 * i;
      float v = value[i];
      if (entry < Traits::kBlockM) v = v == -INFINITY ? INFINITY : v * static_cast<float>(M_LOG2E);
      slot[entry] = v;
    }
  }
};

// A thread's fragment of S^T (keys x kQTiles 8-query tiles, m64nN accumulators) to P^T = exp2(S^T
// scale log2(e) - LSE), zero where the tile needs the mask and the element is hidden, and its
// fragment of dP^T to dS^T = P^T (dP^T - D). `lse` and `delta` point at the statistics of the
// fragment's first query column; waits for S^T, then for dP^T, the last two MMA groups.
template <int kQTiles>
__device__ __forceinline__ void ScoresToGradients(float (&s)[kQTiles * 4], float (&dp)[kQTiles * 4],
                                                  const float* lse, const float* delta, int pair,
                                                  float scale_log2, bool masked,
                                                  const ElementMask& mask) {
  wgmma::WaitGroup<1>();
  wgmma::FenceOperands(s);
#pragma unroll
  for (int j = 0; j < kQTiles; ++j) {
    const float2 row_lse = *reinterpret_cast<const float2*>(lse + j * 8 + pair);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float& x = s[j * 4 + e];
      x = ptx::Exp2(fmaf(x, scale_log2, -(e % 2 == 0 ? row_lse.x : row_lse.y)));
      // Element (key_row + 8 (e / 2), row j 8 + pair + e % 2) of the thread's fragment.
      if (masked && !mask.Visible((e / 2) * 8, j * 8 + e % 2)) x = 0.f;
    }
  }
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
}

// A thread's rows of dK (scaled) and dV (m64nN accumulators) to the dtype: the first kColumns
// columns of the accumulators (head_dim 96 leaves the zero ones behind) at the rows' columns
// from first_column, for its two key rows of the block that lie inside it. With 16-byte aligned
// outputs and a staging buffer (the warp's, staged_rows.cuh) through shared memory, 16 bytes a
// store; otherwise (staging 0: none, as at head_dim 256) from registers.
template <typename Element, int kColumns, int kAccumulators>
__device__ __forceinline__ void StoreKeyGradients(const FusedBackwardTmaParams& params,
                                                  const SequenceView<int64_t>& seq,
                                                  const float (&dk)[kAccumulators],
                                                  const float (&dv)[kAccumulators], int64_t k0,
                                                  int64_t keys, int kv_head, int key_row, int pair,
                                                  int first_column, uint32_t staging = 0) {
  static_assert(kColumns / 2 <= kAccumulators, "columns the accumulators hold");
  const FusedBackwardParams& p = params.p;
  if (staging != 0 && params.aligned_outputs) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int first_row = key_row - lane / 4 + half * 8;  // of the warp's 8 in this pass
      const int64_t token = seq.k_start + k0 + first_row;
      const int valid_rows = static_cast<int>(Min64(keys - first_row, 8));
      StoreStagedRows<Element, kColumns>(dk, half, p.scale, staging,
                                         static_cast<Element*>(p.dk) + token * p.dk_token_stride +
                                             kv_head * p.dk_head_stride + first_column,
                                         p.dk_token_stride, valid_rows, lane);
      StoreStagedRows<Element, kColumns>(dv, half, 1.f, staging,
                                         static_cast<Element*>(p.dv) + token * p.dv_token_stride +
                                             kv_head * p.dv_head_stride + first_column,
                                         p.dv_token_stride, valid_rows, lane);
    }
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = key_row + half * 8;
    if (r >= keys) continue;
    const int64_t token = seq.k_start + k0 + r;
    Element* dk_row = static_cast<Element*>(p.dk) + token * p.dk_token_stride +
                      kv_head * p.dk_head_stride + first_column;
    Element* dv_row = static_cast<Element*>(p.dv) + token * p.dv_token_stride +
                      kv_head * p.dv_head_stride + first_column;
#pragma unroll
    for (int n = 0; n < kColumns / 8; ++n) {
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
  constexpr int kStatsFloats = Traits::kStatsFloats;
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
  unsigned char* dq_staged = swizzled_smem + Traits::kDqOffset;
  const Barriers<Traits> bars{smem + Traits::kBarrierOffset};

  if (threadIdx.x == 0) bars.Init(kConsumerThreads / 32);  // a stage: one per consumer warp
  __syncthreads();

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    tma::ReleaseRegisters<kSm90BackwardProducerRegisters>();
    if (tiles.count > 0) {
      const TileOrigin at = TileOrigin::Of(p, seq);
      if (threadIdx.x == 0) {
        ProduceTiles<Traits>(params, bars, smem, tiles, at, k0, kv_head);
      } else if (threadIdx.x / 32 == 1) {
        ReduceQueryGradients<Traits>(params, smem + Traits::kDqOffset, seq, tiles, at, kv_head);
      }
    }
    return;
  }
  tma::ClaimRegisters<kSm90BackwardConsumerRegisters>();

  const int consumer = warp_group - 1;
  const int group_thread = threadIdx.x % 128;
  const int warp = group_thread / 32;  // within the warpgroup: 16 of its 64 keys
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;
  const int pair = (lane % 4) * 2;
  const int key_row = consumer * 64 + warp * 16 + quad_row;  // in the block; + 8 for the second
  const uint32_t k_tile = smem + Traits::kKOffset;
  const uint32_t v_tile = smem + Traits::kVOffset;
  float* stats =
      reinterpret_cast<float*>(swizzled_smem + Traits::kStatsOffset) + consumer * 2 * kStatsFloats;
  const float scale_log2 = p.scale * static_cast<float>(M_LOG2E);
  const int64_t shift = seq.seqlen_k - seq.seqlen_q;

  float dk[kDTiles * 4], dv[kDTiles * 4];
#pragma unroll
  for (int i = 0; i < kDTiles * 4; ++i) dk[i] = dv[i] = 0.f;

  // dK (scaled) and dV of the block's keys, from registers to the dtype: head_dim columns (at 96
  // the accumulators' last 32, zero, stay behind).
  // From head_dim 96 they go out while the last tile's dQ runs: on the H200 1.00-1.02x the
  // order after it at 128, 0.98-0.99x at 64 (bf16, two rounds each, same call).
  constexpr bool kStoreUnderLastDq = kHeadDim > 64;
  const auto store_key_gradients = [&] {
    StoreKeyGradients<Element, kHeadDim>(
        params, seq, dk, dv, k0, keys, kv_head, key_row, pair, 0,
        ConsumerWarpStaging(smem + Traits::kStagingOffset, Traits::kWarpStagingBytes));
  };

  if (tiles.count > 0) {
    // Tile 0's row statistics into slot 0; later tiles' load while the tile before runs.
    RowStatistics<Traits> next;
    next.Load(params, seq, tiles, kv_head, 0, group_thread);
    next.Store(stats, group_thread);
    tma::NamedBarrierSync(kStatsBarrier + consumer, 128);
    tma::Wait(bars.kv_full(), 0);
  }
  // One query tile; with_dq: and the dQ of the tile before. (A compile-time flag, not a branch:
  // ptxas serialises wgmma whose issue is conditional.)
  const auto run_tile = [&](auto with_dq, int64_t t) {
    constexpr bool kWithDq = decltype(with_dq)::value;
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
    next.Load(params, seq, tiles, kv_head, t + 1, group_thread);

    // P^T = exp2(S^T scale log2(e) - LSE); the mask where the tile crosses the window's edges,
    // the sequence's last key or the block's end (rows past the sequence have LSE = +inf).
    const float* lse = stats + slot * kStatsFloats;
    const float* delta = lse + kBlockM;
    const int64_t last_row = row0 + rows - 1;
    const bool masked = keys < kBlockN ||
                        (p.window_right >= 0 && k0 + kBlockN - 1 > row0 + shift + p.window_right) ||
                        (p.window_left >= 0 && k0 < last_row + shift - p.window_left);
    const ElementMask mask(p.window_left, p.window_right, k0 + key_row, row0 + pair, seq.seqlen_q,
                           seq.seqlen_k, k0 + keys);
    ScoresToGradients<kQTiles>(s, dp, lse, delta, pair, scale_log2, masked, mask);
    uint32_t p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
    PackFragments<Element, kQTiles>(s, p_frag);
    PackFragments<Element, kQTiles>(dp, ds_frag);

    wgmma::Fence();
    IssueKeyGradient<Traits>(dv, p_frag, do_stage);
    IssueKeyGradient<Traits>(dk, ds_frag, q_stage);
    wgmma::CommitGroup();
    // The tile before's dQ, behind dV and dK on the tensor cores.
    float dq[kDqColumns / 2];
    if constexpr (kWithDq) IssueQueryGradientBlock<Traits>(dq, smem, t - 1, consumer);

    // dS^T (keys x queries, kBlockM / 64 swizzled column blocks) into this tile's buffer, while
    // the MMAs run. Its last readers, the dQ MMAs of tile t - 2, are done: this warpgroup's
    // waited for them in tile t - 1, the other's before its kDsStoredBarrier arrival of tile
    // t - 1, which IssueQueryGradientBlock above synced on.
    unsigned char* ds_stored = swizzled_smem + DsBuffer<Traits>(t);
#pragma unroll
    for (int ks = 0; ks < kBlockM / 16; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = ks * 16 + half * 8 + pair;
        *reinterpret_cast<uint32_t*>(ds_stored + wgmma::SwizzledByteOffset(key_row, col, kBlockN)) =
            ds_frag[ks][2 * half];
        *reinterpret_cast<uint32_t*>(ds_stored +
                                     wgmma::SwizzledByteOffset(key_row + 8, col, kBlockN)) =
            ds_frag[ks][2 * half + 1];
      }
    }
    wgmma::FenceSharedForAsyncProxy();
    // The next tile's statistics go to the other slot, last read in the tile before this one.
    next.Store(stats + (1 - slot) * kStatsFloats, group_thread);
    tma::NamedBarrierSync(kStatsBarrier + consumer, 128);

    wgmma::WaitGroup<0>();
    if constexpr (kWithDq) wgmma::FenceOperands(dq);
    wgmma::FenceOperands(dk);
    wgmma::FenceOperands(dv);
    // Q, dO of this stage are no longer read; this tile's dS^T is stored and the tile before's
    // buffer no longer read by this warpgroup.
    if (lane == 0) tma::Arrive(bars.empty(stage));
    tma::NamedBarrierArrive(kDsStoredBarrier + 2 * consumer + slot, kDsStoredThreads);
    if constexpr (kWithDq) StageQueryGradientBlock<Traits>(dq, dq_staged, consumer, p.scale);
  };
  if (tiles.count > 0) {
    for (int64_t t = 0; t < tiles.count; ++t) {
      if (t == 0) {
        run_tile(std::false_type{}, t);
      } else {
        run_tile(std::true_type{}, t);
      }
    }
    float dq[kDqColumns / 2];
    IssueQueryGradientBlock<Traits>(dq, smem, tiles.count - 1, consumer);
    if constexpr (kStoreUnderLastDq) store_key_gradients();
    wgmma::WaitGroup<0>();
    wgmma::FenceOperands(dq);
    StageQueryGradientBlock<Traits>(dq, dq_staged, consumer, p.scale);
  } else if (kStoreUnderLastDq) {
    store_key_gradients();  // zeros: no query tile meets the block
  }
  if constexpr (!kStoreUnderLastDq) store_key_gradients();

#endif  // ATTN_WGMMA_AVAILABLE
}

}  // namespace attn::cuda
