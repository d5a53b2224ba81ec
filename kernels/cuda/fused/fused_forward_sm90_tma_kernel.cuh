// The warp-specialised fused attention forward for Hopper (sm_90a): the algorithm of
// fused_forward_kernel.cuh with its loads on the copy engine and its two matrix products on
// warpgroup MMA, arranged so that the softmax runs while the tensor cores work.
//
// The grid is persistent (query_schedule.cuh): a CTA walks query blocks of kBlockM = 128 rows
// (192 at head_dim 64) of one (sequence, head) one after another, and runs three warpgroups
// (four at 64):
//   - a producer (warpgroup 0, 40 registers a thread after setmaxnreg, 24 at head_dim 256 and
//     32 at 64), one
//     thread of which draws the CTA's blocks from the queue, posts them to the consumers and
//     issues TMA copies: per block Q, and K and V tiles into kStages-deep rings of 128-byte-
//     swizzled shared-memory stages, each stage a `full` mbarrier (bytes landed) and an `empty`
//     one (every consumer done with it); Q has the same pair, so the next block's Q lands
//     while the consumers finish this one, and the rings run on from block to block;
//   - two consumer warpgroups (232 registers, 240 at 256; three of 160 at 64) of 64 query rows
//     each, which take turns on the tensor cores in a ring (named barriers: a warpgroup issues
//     its MMAs, then hands the turn to the next and runs its softmax while the others' MMAs
//     execute) and within a turn issue the next
//     tile's S = Q K^T before this tile's acc += P V, so that each warpgroup's softmax of tile j
//     overlaps its own P V of tile j - 1 as well:
//
//       turn 0:     S_0 = Q K_0^T
//                   m, l, P_0 from S_0
//       turn j:     S_j = Q K_j^T;  acc += P_{j-1} V_{j-1}      (both queued, asynchronous)
//                   wait S_j: mask, m, l, alpha, P_j from S_j    (P V still running)
//                   wait P V: acc *= alpha; P_j to 16 bits
//       turn T:     acc += P_{T-1} V_{T-1}
//
// P stays in registers as the A operand of P V. Tiles run from the last visible key tile to
// the first (BlockMask), as in the other kernels. O = acc / l goes to device memory through a
// few rows of shared memory per warp, in 16-byte pieces, or, at head_dim 128 with 128-key tiles,
// through a box per consumer that a store warp of the producer warpgroup has the copy engine
// store; LSE = m * scale + log(l).
//
// The same kernel runs the FP8 forward (fp8_forward.cu): e4m3 tiles (Element of one byte), both
// products on e4m3 instructions, V transposed in global memory, O in bf16.
//
// The producer is the only code that knows where K and V rows live. It asks a K/V source (the
// kernel's second template parameter) to fill a stage with the keys of a tile: DenseKvTiles
// here copies one box per column block from the K and V tensor maps; the paged source
// (paged_tma_source.cuh) looks the tile's pages up in the block table. The consumers are the
// same for every source.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/fused/block_mask.cuh"
#include "cuda/fused/fused_forward.h"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/online_softmax.cuh"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/query_block.cuh"
#include "cuda/fused/query_schedule.cuh"
#include "cuda/fused/staged_rows.cuh"
#include "cuda/fused/tma.cuh"
#include "cuda/fused/wgmma.cuh"

namespace attn::cuda {

template <typename Element_, int kHeadDim_, int kBlockN_, int kStages_,
          int kConsumerWarpGroups_ = 2>
struct FusedForwardSm90TmaTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWarpGroups = kConsumerWarpGroups_;
  static constexpr int kBlockM = 64 * kConsumerWarpGroups;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpGroups;
  static constexpr int kThreads = 128 + kConsumerThreads;  // the producer warpgroup first
  // Registers a thread of each role keeps after setmaxnreg (heuristics.h).
  static constexpr int kProducerRegisters = Sm90TmaProducerRegisters(kHeadDim, kConsumerWarpGroups);
  static constexpr int kConsumerRegisters = Sm90TmaConsumerRegisters(kHeadDim, kConsumerWarpGroups);
  // 16-bit elements, or e4m3 bytes: the FP8 forward (fp8_forward.cu), whose V arrives
  // transposed (its tiles are head_dim rows of kBlockN keys) and whose O is bf16.
  static constexpr bool kFp8 = sizeof(Element) == 1;
  using OutputElement = std::conditional_t<kFp8, __nv_bfloat16, Element>;
  // Tiles hold whole 128-byte column blocks (64 16-bit elements, 128 bytes). At head_dim 96 the
  // second block is half used: the copy engine zero-fills columns 96..127 (past the tensor
  // map's head_dim), Q K^T stops at column 96, and P V runs 128 wide, its last 32 accumulator
  // columns never stored.
  static constexpr int kBlockColumns = 128 / static_cast<int>(sizeof(Element));
  static constexpr int kColumnBlocks = (kHeadDim + kBlockColumns - 1) / kBlockColumns;
  static constexpr int kTileColumns = kBlockColumns * kColumnBlocks;  // of Q, K, V, and acc
  static constexpr int kNTiles = kBlockN / 8;                         // 8-key column tiles of S
  static constexpr int kDTiles = kTileColumns / 8;                    // 8-column tiles of acc
  static constexpr int kQTileBytes = kBlockM * kColumnBlocks * 128;
  static constexpr int kKVTileBytes = kBlockN * kColumnBlocks * 128;
  // Q K^T steps through 32 bytes of the rows at a time (k16 of 16-bit, k32 of e4m3), P V
  // through kPSteps register fragments of P, 16 keys each (32 for e4m3).
  static constexpr int kScoreSteps = kHeadDim * static_cast<int>(sizeof(Element)) / 32;
  static constexpr int kPSteps = kBlockN * static_cast<int>(sizeof(Element)) / 32;
  // e4m3 keeps P = exp(s - m) * 2^8, which spends its range better (P in (0, 256] rather than
  // (0, 1]: fewer of the small probabilities fall below its 2^-9); l carries the same factor,
  // so O = acc / l does not see it, and the LSE takes it out.
  static constexpr int kProbabilityLog2Scale = kFp8 ? 8 : 0;
  // Q, the K stages, the V stages, each tile and column block 1024-byte aligned as the 128-byte
  // swizzle requires; then the mbarriers: Q full, per stage K full, K empty, V full, V empty,
  // Q empty, and the two block slots' full and empty; then the two slots.
  static constexpr int kKOffset = kQTileBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKVTileBytes;
  static constexpr int kBarrierOffset = kVOffset + kStages * kKVTileBytes;
  static constexpr int kSlotOffset = kBarrierOffset + 8 * (6 + 4 * kStages);
  // The epilogue stages O through 8 rows of shared memory a consumer warp (staged_rows.cuh)
  // where they fit beside the stages; elsewhere (head_dim 256 with 80 keys) each thread stores
  // its fragment from registers, 4 bytes at a time.
  static constexpr int kStagingOffset = (kSlotOffset + 2 * 4 + 15) / 16 * 16;
  static constexpr int kOutputRowBytes = kHeadDim * static_cast<int>(sizeof(OutputElement));
  static constexpr int kWarpStagingBytes = attn::cuda::kWarpStagingBytes<kOutputRowBytes>;
  static constexpr int kStagingBytes = kConsumerThreads / 32 * kWarpStagingBytes;
  static constexpr bool kStagedEpilogue = kStagingOffset + kStagingBytes <= 227 * 1024;
  static constexpr int kStagedEnd =
      kStagedEpilogue ? kStagingOffset + kStagingBytes : kSlotOffset + 2 * 4;
  // After them, where they fit, each consumer warpgroup has a box of its 64 rows of O
  // (kColumnBlocks 128-byte-swizzled column blocks, the layout the copy engine reads); a warp of
  // the producer warpgroup stores it by the copy engine (the copy-engine epilogue, below).
  // 16-bit O only. Kernels whose K/V source has no O map (the paged prefill) keep the staged
  // rows.
  static constexpr int kOutputBoxOffset = (kStagedEnd + 1023) / 1024 * 1024;
  static constexpr int kGroupOutputBytes = 64 * 128 * kColumnBlocks;
  static constexpr int kOutputBoxRows = 16;  // the O map's box: a warp's rows
  static constexpr int kCopyEngineEnd = kOutputBoxOffset + kConsumerWarpGroups * kGroupOutputBytes;
  // Head_dim 128 only, where it measured faster at 512-1024 keys (1.03-1.07x, docs/cuda-fused.md,
  // "The copy-engine epilogue"); at 64 it ran level or up to 2-4% slower, and 96 was not measured.
  static constexpr bool kCopyEngineEpilogue =
      !kFp8 && kHeadDim == 128 && kCopyEngineEnd <= 227 * 1024;
  static constexpr int kSmemBytes = kCopyEngineEpilogue ? kCopyEngineEnd : kStagedEnd;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 256,
                "P V is m64n64, n128 (head_dim 96 and 128) or n256");
  static_assert(kBlockN == 64 || kBlockN == 80 || kBlockN == 128 || kBlockN == 176 ||
                    kBlockN == 192,
                "S tiles are m64n64, n80, n128, n176 or n192");
  static_assert(kBlockN * 128 % 1024 == 0, "every column block starts 1024-byte aligned");
  static_assert(kStages >= 2, "a stage loads while another is read");
  static_assert(kSmemBytes <= 227 * 1024, "Hopper's shared memory per CTA");
  static_assert(sizeof(Element) == 2 ||
                    (kFp8 && (kHeadDim == 128 || kHeadDim == 256) && kBlockN == 128),
                "16-bit storage, or e4m3 at head_dim 128 or 256 with 128-key tiles (a V^T tile "
                "is then one column block of head_dim rows, the size of a K tile)");
  static_assert(kConsumerWarpGroups == 2 || kConsumerWarpGroups == 3, "128 or 192 query rows");
  static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= 65536,
                "the register file");
};

// The kernel's parameter block: the plain params and the tensor maps of Q, K and V (made on the
// host, read by the copy engine from parameter space).
struct FusedForwardTmaParams {
  FusedForwardParams p;
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
  // O's map (boxes of a warp's 16 rows), for the copy-engine epilogue only.
  CUtensorMap o_map;
};

namespace sm90_tma {

// Named barrier ids (0 is __syncthreads): the tensor-core turn of each consumer warpgroup.
inline constexpr uint32_t kTurnBarrier = 1;
inline constexpr uint32_t kTurnThreads = 256;  // the warpgroup handing over and the one taking it
// The copy-engine epilogue, per consumer warpgroup w (up to three): w's rows of O are in its box
// (w arrives, its store warp syncs) / the box is free again (the other way round).
inline constexpr uint32_t kOutputStagedBarrier = 4;
inline constexpr uint32_t kOutputFreeBarrier = 7;
inline constexpr uint32_t kOutputHandoffThreads = 128 + 32;  // a consumer warpgroup, a store warp

// The mbarriers of the shared-memory tail (Traits::kBarrierOffset).
template <typename Traits>
struct Barriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t q_full() const { return base; }
  __device__ __forceinline__ uint32_t k_full(int stage) const { return base + 8 * (1 + stage); }
  __device__ __forceinline__ uint32_t k_empty(int stage) const {
    return base + 8 * (1 + Traits::kStages + stage);
  }
  __device__ __forceinline__ uint32_t v_full(int stage) const {
    return base + 8 * (1 + 2 * Traits::kStages + stage);
  }
  __device__ __forceinline__ uint32_t v_empty(int stage) const {
    return base + 8 * (1 + 3 * Traits::kStages + stage);
  }
  __device__ __forceinline__ uint32_t q_empty() const {
    return base + 8 * (1 + 4 * Traits::kStages);
  }
  __device__ __forceinline__ uint32_t slot_full(int slot) const {
    return base + 8 * (2 + 4 * Traits::kStages + slot);
  }
  __device__ __forceinline__ uint32_t slot_empty(int slot) const {
    return base + 8 * (4 + 4 * Traits::kStages + slot);
  }
};

// The producer's thread 0 draws each block's place in the queue (QueryBlockOrder) and posts it
// to the consumers through two shared-memory slots, taken in turn, each with a `full` and an
// `empty` mbarrier as the K/V stages; the last post is a place past the end. With two slots the
// producer runs up to a block ahead of the consumers.
__device__ __forceinline__ int SlotOf(int step) { return step % 2; }
__device__ __forceinline__ uint32_t SlotParityOf(int step) {
  return static_cast<uint32_t>((step / 2) & 1);
}

template <typename Traits>
__device__ __forceinline__ void PostQueryBlock(const Barriers<Traits>& bars, int* slots, int step,
                                               int place) {
  if (step >= 2) tma::Wait(bars.slot_empty(SlotOf(step)), SlotParityOf(step) ^ 1);
  slots[SlotOf(step)] = place;
  tma::Arrive(bars.slot_full(SlotOf(step)));
}

// The place of the CTA's step-th block, for the consumers: every consumer thread releases the
// slot once it has read it (its own read ordered before its own arrival, once a block).
template <typename Traits>
__device__ __forceinline__ int ReadQueryBlockSlot(const Barriers<Traits>& bars, const int* slots,
                                                  int step) {
  tma::Wait(bars.slot_full(SlotOf(step)), SlotParityOf(step));
  const int place = slots[SlotOf(step)];
  tma::Arrive(bars.slot_empty(SlotOf(step)));
  return place;
}

// The stage and phase parity of the it-th tile of a kStages-deep ring.
template <int kStages>
__device__ __forceinline__ int StageOf(int it) {
  return it % kStages;
}
template <int kStages>
__device__ __forceinline__ uint32_t ParityOf(int it) {
  return static_cast<uint32_t>((it / kStages) & 1);
}

template <int kBlockN, typename Element>
__device__ __forceinline__ void ScoreMma(float (&s)[kBlockN / 2], uint64_t desc_q, uint64_t desc_k,
                                         int accumulate, Element tag) {
  if constexpr (kBlockN == 64) {
    wgmma::MmaSS_64(s, desc_q, desc_k, accumulate, tag);
  } else if constexpr (kBlockN == 80) {
    wgmma::MmaSS_80(s, desc_q, desc_k, accumulate, tag);
  } else if constexpr (kBlockN == 128) {
    wgmma::MmaSS_128(s, desc_q, desc_k, accumulate, tag);
  } else if constexpr (kBlockN == 176) {
    wgmma::MmaSS_176(s, desc_q, desc_k, accumulate, tag);
  } else {
    wgmma::MmaSS_192(s, desc_q, desc_k, accumulate, tag);
  }
}

// Queues S = Q K^T for the warpgroup's 64 rows (q_rows) against one K stage: k-steps of 32
// bytes inside the 128-byte swizzled rows (at 96, none over the zero-filled columns).
template <typename Traits>
__device__ __forceinline__ void IssueScores(float (&s)[Traits::kBlockN / 2], uint32_t q_rows,
                                            uint32_t k_tile) {
  const uint64_t q = wgmma::MakeDescriptor(q_rows, 0), k = wgmma::MakeDescriptor(k_tile, 0);
#pragma unroll
  for (int ks = 0; ks < Traits::kScoreSteps; ++ks) {
    const uint32_t column = (ks % 4) * 32;
    const uint64_t desc_q = wgmma::DescriptorPlus(q, (ks / 4) * Traits::kBlockM * 128 + column);
    const uint64_t desc_k = wgmma::DescriptorPlus(k, (ks / 4) * Traits::kBlockN * 128 + column);
    ScoreMma<Traits::kBlockN>(s, desc_q, desc_k, ks > 0, typename Traits::Element{});
  }
}

// Queues acc += P V against one V stage, P from registers and V read MN-major; e4m3 reads the
// transposed V K-major, 32 keys (bytes of its rows) a step.
template <typename Traits>
__device__ __forceinline__ void IssueValues(float (&acc)[Traits::kTileColumns / 2],
                                            const uint32_t (&p)[Traits::kPSteps][4],
                                            uint32_t v_tile) {
  if constexpr (Traits::kFp8) {
    const uint64_t v = wgmma::MakeDescriptor(v_tile, 0);
#pragma unroll
    for (int ps = 0; ps < Traits::kPSteps; ++ps) {
      const uint64_t desc_v = wgmma::DescriptorPlus(v, ps * 32);
      if constexpr (Traits::kTileColumns == 256) {
        wgmma::MmaRS_256(acc, p[ps], desc_v, typename Traits::Element{});
      } else {
        wgmma::MmaRS_128(acc, p[ps], desc_v, typename Traits::Element{});
      }
    }
  } else {
    const uint64_t v = wgmma::MakeDescriptor(v_tile, Traits::kBlockN * 128);
#pragma unroll
    for (int ps = 0; ps < Traits::kPSteps; ++ps) {
      const uint64_t desc_v = wgmma::DescriptorPlus(v, ps * 16 * 128);
      if constexpr (Traits::kTileColumns == 256) {
        wgmma::MmaRS_256(acc, p[ps], desc_v, typename Traits::Element{});
      } else if constexpr (Traits::kTileColumns == 128) {
        wgmma::MmaRS_128(acc, p[ps], desc_v, typename Traits::Element{});
      } else {
        wgmma::MmaRS_64(acc, p[ps], desc_v, typename Traits::Element{});
      }
    }
  }
}

// P (fp32, in the score registers) to the 16-bit A fragments of P V.
//
// e4m3: an A fragment register holds four consecutive k of a row where a score tile gives a
// thread two, so each register takes the pairs of two score tiles as they lie, and P's k order
// within every 16 keys is the permutation Fp8ValueSlotKey (fp8_forward.h) of the key order. The
// transposed V is stored in the same order, so that P V sums the right products without a
// shuffle.
template <typename Traits>
__device__ __forceinline__ void PackProbabilities(const float (&s)[Traits::kNTiles][4],
                                                  uint32_t (&p)[Traits::kPSteps][4]) {
  using Element = typename Traits::Element;
  if constexpr (Traits::kFp8) {
#pragma unroll
    for (int ps = 0; ps < Traits::kPSteps; ++ps) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = 4 * ps + 2 * half;  // the first of the score tiles of registers 2 half, +1
        p[ps][2 * half] = ptx::PackE4m3Quad(s[t][0], s[t][1], s[t + 1][0], s[t + 1][1]);
        p[ps][2 * half + 1] = ptx::PackE4m3Quad(s[t][2], s[t][3], s[t + 1][2], s[t + 1][3]);
      }
    }
  } else {
#pragma unroll
    for (int ps = 0; ps < Traits::kPSteps; ++ps) {
      p[ps][0] = ptx::PackPair<Element>(s[2 * ps][0], s[2 * ps][1]);
      p[ps][1] = ptx::PackPair<Element>(s[2 * ps][2], s[2 * ps][3]);
      p[ps][2] = ptx::PackPair<Element>(s[2 * ps + 1][0], s[2 * ps + 1][1]);
      p[ps][3] = ptx::PackPair<Element>(s[2 * ps + 1][2], s[2 * ps + 1][3]);
    }
  }
}

// Where a CTA's Q tile sits in the Q map's (column, row, head, sequence) coordinates: a
// uniform batch addresses its sequence by the fourth coordinate, a variable-length one by the
// sequence's first token.
struct QueryTileAt {
  int row, head, sequence;
};

template <int kBlockM>
__device__ __forceinline__ QueryTileAt QueryTileOf(const FusedForwardParams& p,
                                                   const QueryBlock<kBlockM>& block) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  return {varlen ? static_cast<int>(block.seq.q_start) + block.row0 : block.row0, block.head,
          varlen ? 0 : block.batch};
}

// The dense K/V source: the K and V tensor maps in the same coordinates as Q's, a tile being
// one box per column block. A K/V source names its kernel parameters (Params, whose `p` is the
// FusedForwardParams and which hold q_map, k_map and v_map), how many producer threads run it
// (threads 0 .. kProducerThreads - 1, all inside warp 0; thread 0 issues Q's copies), and fills
// a stage with the keys [key0, key0 + kBlockN) of K or V, completing it on the stage's `full`
// barrier: one arrival and the bytes of its copies.
template <typename Traits>
struct DenseKvTiles {
  using Params = FusedForwardTmaParams;
  static constexpr int kProducerThreads = 1;

  const Params& params;
  QueryTileAt q;
  int k_row, kv_head;

  __device__ __forceinline__ DenseKvTiles(const Params& params,
                                          const QueryBlock<Traits::kBlockM>& block)
      : params(params),
        q(QueryTileOf(params.p, block)),
        k_row(params.p.cu_seqlens_q != nullptr ? static_cast<int>(block.seq.k_start) : 0),
        kv_head(block.kv_head(params.p)) {}

  __device__ __forceinline__ void LoadKeys(uint32_t tile, uint32_t full, int key0) const {
    Load(&params.k_map, tile, full, key0);
  }
  __device__ __forceinline__ void LoadValues(uint32_t tile, uint32_t full, int key0) const {
    Load(&params.v_map, tile, full, key0);
  }

 private:
  __device__ __forceinline__ void Load(const CUtensorMap* map, uint32_t tile, uint32_t full,
                                       int key0) const {
    tma::ArriveExpectBytes(full, Traits::kKVTileBytes);
#pragma unroll
    for (int cb = 0; cb < Traits::kColumnBlocks; ++cb) {
      tma::Load4d(tile + cb * Traits::kBlockN * 128, map, full, cb * Traits::kBlockColumns,
                  k_row + key0, kv_head, q.sequence);
    }
  }
};

// The producer: for each query block it draws and posts, its K and V tiles in the order the
// consumers finish with them (K_0, K_1, V_0, K_2, V_1, ...), each into the next stage of its
// ring once both consumers have released that stage, and Q after K_0: Q's buffer is free once
// both consumers' last Q K^T of the previous block is done, and K_0 can usually go before that.
// The rings' positions run on across blocks. Every producer thread of the source runs it;
// thread 0 draws, posts and issues Q's copies.
template <typename Traits, typename Source>
__device__ __forceinline__ void ProduceTiles(const typename Source::Params& params,
                                             const QueryBlockOrder& order,
                                             const Barriers<Traits>& bars, int* slots,
                                             uint32_t q_tile, uint32_t k_tiles, uint32_t v_tiles) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  const bool leader = threadIdx.x == 0;
  if (leader) {
    tma::PrefetchTensorMap(&params.q_map);
    tma::PrefetchTensorMap(&params.k_map);
    tma::PrefetchTensorMap(&params.v_map);
  }
  int ring = 0;     // K (and V) tiles loaded before this block's
  int q_loads = 0;  // Q tiles loaded before this block's
  // The next block's place is drawn when this block's K tile kDrawAheadTiles before its last is
  // issued (at once for shorter blocks): late enough that a CTA does not hold on to a block
  // another CTA could start sooner (drawn at the post, heavy causal blocks waited behind heavy
  // ones: 0.95x at 16384 keys), early enough that the atomic's round trip is over before the
  // consumers need the post (drawn after the last loads, they waited: 0.92-0.97x at d 128 up to
  // 4096 keys). The producer runs kStages tiles ahead of the consumers besides.
  constexpr int kDrawAheadTiles = 2;
  int next = static_cast<int>(blockIdx.x);
  for (int step = 0;; ++step) {
    int place = next;
    if (leader) PostQueryBlock(bars, slots, step, place);
    if constexpr (Source::kProducerThreads > 1) place = __shfl_sync(0xffffffffu, place, 0);
    if (place >= order.total) break;
    const QueryBlockIndex at = order[place];
    const QueryBlock<kBlockM> block(params.p, at.m_block, at.head, at.batch);
    const BlockMask<kBlockN> mask(params.p, block.seq, block.row0, block.rows());
    const int n_block_last = mask.n_block_max - 1;
    const int num_tiles = block.empty() ? 0 : mask.n_block_max - mask.n_block_min;
    const int draw_at = num_tiles - 1 - kDrawAheadTiles;  // the K tile after which to draw
    if (leader && draw_at < 1) next = DrawQueryBlock(params.p.tile_counters);
    if (num_tiles > 0) {
      const Source source(params, block);
      const auto load_k = [&](int it) {
        const int stage = StageOf<Traits::kStages>(ring + it);
        tma::Wait(bars.k_empty(stage), ParityOf<Traits::kStages>(ring + it) ^ 1);
        source.LoadKeys(k_tiles + stage * Traits::kKVTileBytes, bars.k_full(stage),
                        (n_block_last - it) * kBlockN);
      };
      const auto load_v = [&](int it) {
        const int stage = StageOf<Traits::kStages>(ring + it);
        tma::Wait(bars.v_empty(stage), ParityOf<Traits::kStages>(ring + it) ^ 1);
        source.LoadValues(v_tiles + stage * Traits::kKVTileBytes, bars.v_full(stage),
                          (n_block_last - it) * kBlockN);
      };
      load_k(0);
      if (q_loads > 0) tma::Wait(bars.q_empty(), (q_loads - 1) & 1);
      if (leader) {
        tma::ArriveExpectBytes(bars.q_full(), Traits::kQTileBytes);
#pragma unroll
        for (int cb = 0; cb < Traits::kColumnBlocks; ++cb) {
          tma::Load4d(q_tile + cb * kBlockM * 128, &params.q_map, bars.q_full(),
                      cb * Traits::kBlockColumns, source.q.row, source.q.head, source.q.sequence);
        }
      }
      for (int it = 1; it < num_tiles; ++it) {
        load_k(it);
        if (leader && it == draw_at) next = DrawQueryBlock(params.p.tile_counters);
        load_v(it - 1);
      }
      load_v(num_tiles - 1);
      ring += num_tiles;
      ++q_loads;
    }
  }
  if (leader) LeaveQueryQueue(params.p.tile_counters);
}

// The copy-engine epilogue. A consumer warpgroup writes its 64 rows of a block's O into its box
// (kColumnBlocks column blocks of 64 rows x 128 bytes, 128-byte swizzled), then hands the box to
// its store warp (warp 1 + w of the producer warpgroup), which has the copy
// engine store it and hands it back once the engine has read it. The consumers go on to their
// next block at once: the global stores, which cost them the most of a block's boundary
// (docs/cuda-fused.md, "What limits it now"), leave their path.
// Where a store warp's box goes, which it works out from the block's place.
struct OutputBoxHeader {
  // The box's first row in the O map's coordinates (in a variable-length batch, whose map is one
  // sequence of every token, that is the row's token); rows: of the box's 64 inside the block.
  int map_row, head, map_sequence, rows;
};

// Element (r, column block cb, 16-byte chunk c) of a box: the 128-byte swizzle puts chunk c of
// row r at c ^ (r % 8), as the copy engine reads it; a warp's 8 rows of one 4-byte store then
// fall in 32 distinct banks.
__device__ __forceinline__ uint32_t OutputBoxOffset(int r, int cb, int c) {
  return cb * 64 * 128 + r * 128 + ((c ^ (r % 8)) * 16);
}

// Rows [from, h.rows) of a variable-length block's box (the ones the O map would carry on into
// the next sequence) to O by the store warp's lanes: a 16-byte bulk copy a piece (O has a map,
// so its rows are 16-byte aligned). Only the copy engine reads the boxes, never the warp's
// lanes, so that the named barriers' arrivals order every access (a bar.arrive does not order
// plain loads for compute-sanitizer's racecheck).
template <typename Traits>
__device__ __forceinline__ void CopyOutputRows(const FusedForwardParams& p, uint32_t box,
                                               const OutputBoxHeader& h, int from, int lane) {
  using Output = typename Traits::OutputElement;
  constexpr int kPieces = Traits::kHeadDim / 8;  // 16-byte pieces of a row's head_dim columns
  Output* rows = static_cast<Output*>(p.o) + int64_t{h.map_row} * p.o_token_stride +
                 int64_t{h.head} * p.o_head_stride;
  for (int i = from * kPieces + lane; i < h.rows * kPieces; i += 32) {
    const int r = i / kPieces, c = i % kPieces;
    tma::StoreBulk(rows + r * p.o_token_stride + c * 8, box + OutputBoxOffset(r, c / 8, c % 8), 16);
  }
  tma::BulkCommit();
}

// Store warp `group`'s loop. It reads the CTA's block places as the consumers do (every lane
// releases the slot, as every consumer thread does), so that it knows each block's rows without
// a header from the consumers; for each block that has rows, it hands the box back (arrives:
// the previous block's copies have read it), waits for the consumer warpgroup's rows, and has
// the copy engine store them. The copy engine takes boxes of 16 rows: in a dense batch every box
// holding a row of the block (the map drops the rows past the sequence), in a variable-length
// one the full ones only, the lanes copying the rest. The consumers' writes and the copies are
// ordered by the named barriers and the consumers' proxy fence; no lane reads a box itself.
template <typename Traits>
__device__ __forceinline__ void StoreOutputBoxes(const FusedForwardTmaParams& params,
                                                 const QueryBlockOrder& order,
                                                 const Barriers<Traits>& bars, const int* slots,
                                                 uint32_t box, int group) {
  constexpr int kBoxRows = Traits::kOutputBoxRows;
  const FusedForwardParams& p = params.p;
  const int lane = threadIdx.x % 32;
  if (lane == 0) tma::PrefetchTensorMap(&params.o_map);
  for (int step = 0;; ++step) {
    const int place = ReadQueryBlockSlot(bars, slots, step);
    if (place >= order.total) break;
    const QueryBlockIndex at = order[place];
    const QueryBlock<Traits::kBlockM> block(p, at.m_block, at.head, at.batch);
    if (block.empty()) continue;
    const QueryTileAt at_o = QueryTileOf(p, block);
    const OutputBoxHeader h{at_o.row + 64 * group, block.head, at_o.sequence,
                            max(0, min(64, block.rows() - 64 * group))};
    tma::NamedBarrierArrive(kOutputFreeBarrier + group, kOutputHandoffThreads);
    tma::NamedBarrierSync(kOutputStagedBarrier + group, kOutputHandoffThreads);
    const int by_engine = p.cu_seqlens_q != nullptr ? h.rows / kBoxRows * kBoxRows : h.rows;
    if (lane == 0 && by_engine > 0) {
      for (int g = 0; g * kBoxRows < by_engine; ++g) {
#pragma unroll
        for (int cb = 0; cb < Traits::kColumnBlocks; ++cb) {
          tma::Store4d(&params.o_map, box + OutputBoxOffset(g * kBoxRows, cb, 0),
                       cb * Traits::kBlockColumns, h.map_row + g * kBoxRows, h.head,
                       h.map_sequence);
        }
      }
      tma::BulkCommit();
    }
    if (by_engine < h.rows) CopyOutputRows<Traits>(p, box, h, by_engine, lane);
    tma::BulkWaitRead();  // each lane's own copies have read the box
    __syncwarp();
  }
  tma::BulkWait();  // O written before the grid ends
}

}  // namespace sm90_tma

template <typename Traits, typename Source = sm90_tma::DenseKvTiles<Traits>>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    FusedForwardSm90TmaKernel(const __grid_constant__ typename Source::Params params) {
#ifdef ATTN_WGMMA_AVAILABLE
  using namespace sm90_tma;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr int kStages = Traits::kStages;
  constexpr int kConsumerThreads = Traits::kConsumerThreads;
  const FusedForwardParams& p = params.p;
  const QueryBlockOrder order = QueryBlockOrder::Of<kBlockM>(p);
  // The copy engine stores O where the traits have the boxes and the source's parameters carry
  // O's map (the dense source's).
  constexpr bool kCopyEngineEpilogue =
      Traits::kCopyEngineEpilogue && std::is_same_v<typename Source::Params, FusedForwardTmaParams>;

  // Named as in the other Hopper kernels: one name for the 1024-byte-aligned dynamic tile
  // in a translation unit, where the portable kernel declares its own, 128-byte-aligned.
  extern __shared__ __align__(1024) unsigned char swizzled_smem[];
  const uint32_t q_tile = ptx::SharedAddress(swizzled_smem);
  const uint32_t k_tiles = q_tile + Traits::kKOffset;
  const uint32_t v_tiles = q_tile + Traits::kVOffset;
  const Barriers<Traits> bars{q_tile + Traits::kBarrierOffset};
  int* const slots = reinterpret_cast<int*>(swizzled_smem + Traits::kSlotOffset);

  if (threadIdx.x == 0) {
    tma::InitBarrier(bars.q_full(), 1);
    // One arrival per consumer warp, as the stages' empty barriers.
    tma::InitBarrier(bars.q_empty(), kConsumerThreads / 32);
#pragma unroll
    for (int slot = 0; slot < 2; ++slot) {
      tma::InitBarrier(bars.slot_full(slot), 1);
      // Every consumer thread releases a slot, and every store warp's lane where they read them.
      tma::InitBarrier(
          bars.slot_empty(slot),
          kConsumerThreads + (kCopyEngineEpilogue ? 32 * Traits::kConsumerWarpGroups : 0));
    }
#pragma unroll
    for (int stage = 0; stage < kStages; ++stage) {
      tma::InitBarrier(bars.k_full(stage), 1);
      tma::InitBarrier(bars.v_full(stage), 1);
      tma::InitBarrier(bars.k_empty(stage), kConsumerThreads / 32);
      tma::InitBarrier(bars.v_empty(stage), kConsumerThreads / 32);
    }
    tma::FenceBarrierInit();
  }
  __syncthreads();

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    tma::ReleaseRegisters<Traits::kProducerRegisters>();
    if constexpr (kCopyEngineEpilogue) {
      const int group = static_cast<int>(threadIdx.x / 32) - 1;  // warps 1.. store O
      if (group >= 0) {
        if (group < Traits::kConsumerWarpGroups) {
          StoreOutputBoxes<Traits>(
              params, order, bars, slots,
              q_tile + Traits::kOutputBoxOffset + group * Traits::kGroupOutputBytes, group);
        }
        return;
      }
    }
    if (threadIdx.x < Source::kProducerThreads) {
      ProduceTiles<Traits, Source>(params, order, bars, slots, q_tile, k_tiles, v_tiles);
    }
    return;
  }
  tma::ClaimRegisters<Traits::kConsumerRegisters>();

  const int consumer = warp_group - 1;
  const int warp = (threadIdx.x % 128) / 32;  // within the warpgroup: owns 16 of its 64 rows
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;
  const int quad_col = lane % 4;
  const int local_row = consumer * 64 + warp * 16 + quad_row;  // + 8 for the second row
  const uint32_t q_rows = q_tile + consumer * 64 * 128;
  // A stage (or Q) is released by one lane of each warp once the warpgroup's MMAs reading it
  // are done.
  const auto release = [&](uint32_t empty) {
    if (lane == 0) tma::Arrive(empty);
  };
  const uint32_t my_turn = kTurnBarrier + consumer;
  const uint32_t next_turn = kTurnBarrier + (consumer + 1) % Traits::kConsumerWarpGroups;
  // The softmax scale of the raw products; e4m3 inputs are stored scaled (real = stored x
  // descale, a float each for Q, K, V: Source::Descales).
  float score_scale = p.scale;
  float value_scale = 1.f;
  if constexpr (Traits::kFp8) {
    const float* descale = Source::Descales(params);
    score_scale *= descale[0] * descale[1];
    value_scale = descale[2];
  }
  const float scale_log2 = score_scale * static_cast<float>(M_LOG2E);

  // The turns go round the consumers over the whole walk (each runs every block, with the same
  // number of turns). Consumer 0 takes the first; every turn hands on to the next, and consumer
  // 0 takes the last hand-over after the walk, so that every barrier's arrivals match its
  // waits. A turn's barrier counts the warpgroup handing over and the one taking it; a hand-over
  // never meets an unconsumed one, since the next comes round only after every other consumer
  // took its turn.
  if (consumer == 0) tma::NamedBarrierArrive(my_turn, kTurnThreads);

  int ring = 0;     // K/V tiles of the blocks before this one: the rings' position
  int q_loads = 0;  // Q tiles of the blocks before this one
  for (int step = 0;; ++step) {
    const int place = ReadQueryBlockSlot(bars, slots, step);
    if (place >= order.total) break;
    const QueryBlockIndex at = order[place];
    const QueryBlock<kBlockM> block(p, at.m_block, at.head, at.batch);
    if (block.empty()) continue;
    const SequenceView<int>& seq = block.seq;
    const int row0 = block.row0;
    const int rows_in_block = block.rows();
    const BlockMask<kBlockN> mask(p, seq, row0, rows_in_block);
    const int n_block_last = mask.n_block_max - 1;
    const int num_tiles = mask.n_block_max - mask.n_block_min;
    const int thread_row_pos = row0 + local_row + mask.shift;

    float acc[1][kDTiles][4];
#pragma unroll
    for (int dj = 0; dj < kDTiles; ++dj)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[0][dj][e] = 0.f;
    auto& acc_flat = reinterpret_cast<float(&)[Traits::kTileColumns / 2]>(acc[0]);
    float s[1][kNTiles][4];
    auto& s_flat = reinterpret_cast<float(&)[kBlockN / 2]>(s[0]);
    uint32_t p_frag[Traits::kPSteps][4];
    float alpha[2];
    OnlineSoftmax<1, kNTiles, kDTiles> softmax;
    softmax.Init();

    // S of tile `it` (landed in s) to P, with the mask where the tile needs one.
    const auto scores_to_probabilities = [&](int it) {
      const int key0 = (n_block_last - it) * kBlockN;
      if (mask.TileNeedsMask(key0))
        mask.template Apply<kNTiles>(s[0], key0, thread_row_pos, quad_col);
      softmax.template UpdateStatistics<Traits::kProbabilityLog2Scale>(s, scale_log2, alpha);
    };

    if (num_tiles > 0) {
      tma::Wait(bars.q_full(), q_loads & 1);

      tma::Wait(bars.k_full(StageOf<kStages>(ring)), ParityOf<kStages>(ring));
      tma::NamedBarrierSync(my_turn, kTurnThreads);
      wgmma::Fence();
      IssueScores<Traits>(s_flat, q_rows, k_tiles + StageOf<kStages>(ring) * Traits::kKVTileBytes);
      wgmma::CommitGroup();
      tma::NamedBarrierArrive(next_turn, kTurnThreads);
      wgmma::WaitGroup<0>();
      wgmma::FenceOperands(s_flat);
      release(bars.k_empty(StageOf<kStages>(ring)));
      if (num_tiles == 1) release(bars.q_empty());
      scores_to_probabilities(0);  // acc is still 0: no rescale
      PackProbabilities<Traits>(s[0], p_frag);

      for (int it = 1; it < num_tiles; ++it) {
        const int stage = StageOf<kStages>(ring + it);
        const int previous = StageOf<kStages>(ring + it - 1);
        tma::Wait(bars.k_full(stage), ParityOf<kStages>(ring + it));
        tma::Wait(bars.v_full(previous), ParityOf<kStages>(ring + it - 1));
        tma::NamedBarrierSync(my_turn, kTurnThreads);
        wgmma::Fence();
        IssueScores<Traits>(s_flat, q_rows, k_tiles + stage * Traits::kKVTileBytes);
        wgmma::CommitGroup();
        IssueValues<Traits>(acc_flat, p_frag, v_tiles + previous * Traits::kKVTileBytes);
        wgmma::CommitGroup();
        tma::NamedBarrierArrive(next_turn, kTurnThreads);
        wgmma::WaitGroup<1>();  // S of this tile; P V of the last still running
        wgmma::FenceOperands(s_flat);
        release(bars.k_empty(stage));
        // The block's last Q K^T is done: the producer may load the next block's Q.
        if (it == num_tiles - 1) release(bars.q_empty());
        scores_to_probabilities(it);
        wgmma::WaitGroup<0>();
        wgmma::FenceOperands(acc_flat);
        release(bars.v_empty(previous));
        softmax.Rescale(acc, alpha);
        PackProbabilities<Traits>(s[0], p_frag);
      }

      const int last = StageOf<kStages>(ring + num_tiles - 1);
      tma::Wait(bars.v_full(last), ParityOf<kStages>(ring + num_tiles - 1));
      tma::NamedBarrierSync(my_turn, kTurnThreads);
      wgmma::Fence();
      IssueValues<Traits>(acc_flat, p_frag, v_tiles + last * Traits::kKVTileBytes);
      wgmma::CommitGroup();
      tma::NamedBarrierArrive(next_turn, kTurnThreads);
      wgmma::WaitGroup<0>();
      wgmma::FenceOperands(acc_flat);
      release(bars.v_empty(last));
      ring += num_tiles;
      ++q_loads;
    }

    // Epilogue: O = acc / l (0 for rows that saw no key), the rows inside the sequence and the
    // head_dim columns of each: into the warpgroup's box for its store warp where the kernel has
    // the copy-engine epilogue, else staged through the warp's shared-memory rows where the
    // traits have them (a quad's 16 contiguous bytes of a row at a time otherwise cost the store
    // unit twice the sectors). Staging in Q's buffer instead would hold it past the block's last
    // Q K^T, and the next block's Q load behind this epilogue.
    using Output = typename Traits::OutputElement;
    float* lse = block.lse(p);
    Output* o = static_cast<Output*>(p.o) + (seq.q_start + row0) * p.o_token_stride +
                block.head * p.o_head_stride;
    // This warp's 8 rows of the staging buffer.
    [[maybe_unused]] const uint32_t staging =
        ConsumerWarpStaging(q_tile + Traits::kStagingOffset, Traits::kWarpStagingBytes);
    [[maybe_unused]] const uint32_t box =
        q_tile + Traits::kOutputBoxOffset + consumer * Traits::kGroupOutputBytes;
    // The store warp has had the copy engine read this warpgroup's previous block out of it.
    if constexpr (kCopyEngineEpilogue) {
      tma::NamedBarrierSync(kOutputFreeBarrier + consumer, kOutputHandoffThreads);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = QuadSum(softmax.l[half]);
      float inv_l = InverseRowSum(l);
      if constexpr (Traits::kFp8) {
        inv_l *= value_scale;
        l *= 1.f / (1 << Traits::kProbabilityLog2Scale);  // exact: a power of two
      }
      const int row = local_row + half * 8;
      if constexpr (kCopyEngineEpilogue) {
        const int box_row = warp * 16 + quad_row + half * 8;
#pragma unroll
        for (int n = 0; n < kHeadDim / 8; ++n) {
          ptx::StoreShared32(
              box + OutputBoxOffset(box_row, n / 8, n % 8) + quad_col * 4,
              ptx::PackPair<Output>(acc[0][n][2 * half] * inv_l, acc[0][n][2 * half + 1] * inv_l));
        }
      } else if constexpr (Traits::kStagedEpilogue) {
        const int first_row = local_row - quad_row + half * 8;  // of the warp's 8 in this pass
        StoreStagedRows<Output, kHeadDim>(acc_flat, half, inv_l, staging,
                                          o + first_row * p.o_token_stride, p.o_token_stride,
                                          rows_in_block - first_row, lane);
      } else if (row < rows_in_block) {
        Output* o_row = o + row * p.o_token_stride + quad_col * 2;
#pragma unroll
        for (int dj = 0; dj < kHeadDim / 8; ++dj) {
          *reinterpret_cast<uint32_t*>(o_row + dj * 8) =
              ptx::PackPair<Output>(acc[0][dj][2 * half] * inv_l, acc[0][dj][2 * half + 1] * inv_l);
        }
      }
      if (row < rows_in_block && lse != nullptr && quad_col == 0) {
        // 16-bit: p.scale re-read from parameter space rather than kept live in a register.
        lse[row] = RowLse(softmax.m[half], l, Traits::kFp8 ? score_scale : p.scale);
      }
    }
    if constexpr (kCopyEngineEpilogue) {
      wgmma::FenceSharedForAsyncProxy();
      tma::NamedBarrierArrive(kOutputStagedBarrier + consumer, kOutputHandoffThreads);
    }
  }
  if (consumer == 0) tma::NamedBarrierSync(my_turn, kTurnThreads);
#endif  // ATTN_WGMMA_AVAILABLE
}

}  // namespace attn::cuda
