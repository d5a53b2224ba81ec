// The warp-specialised fused attention forward for Hopper (sm_90a): the algorithm of
// fused_forward_kernel.cuh with its loads on the copy engine and its two matrix products on
// warpgroup MMA, arranged so that the softmax runs while the tensor cores work.
//
// A CTA owns kBlockM = 128 query rows of one (sequence, head) and runs three warpgroups:
//   - a producer (warpgroup 0, 24 registers a thread after setmaxnreg), one thread of which
//     issues TMA copies: Q once, then K and V tiles into kStages-deep rings of 128-byte-
//     swizzled shared-memory stages, each stage a `full` mbarrier (bytes landed) and an `empty`
//     one (both consumers done with it);
//   - two consumer warpgroups (240 registers) of 64 query rows each, which take turns on the
//     tensor cores (named barriers: a warpgroup issues its MMAs, then hands the turn over and
//     runs its softmax while the other's MMAs execute) and within a turn issue the next tile's
//     S = Q K^T before this tile's acc += P V, so that each warpgroup's softmax of tile j
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
// the first (BlockMask), as in the other kernels. O = acc / l is staged through the
// warpgroup's own rows of the Q tile; LSE = m * scale + log(l).
//
// The producer is the only code that knows where K and V rows live. It asks a K/V source (the
// kernel's second template parameter) to fill a stage with the keys of a tile: DenseKvTiles
// here copies one box per column block from the K and V tensor maps; the paged source
// (paged_tma_source.cuh) looks the tile's pages up in the block table. The consumers are the
// same for every source.
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "cuda/fused/block_mask.cuh"
#include "cuda/fused/fused_forward.h"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/online_softmax.cuh"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/query_block.cuh"
#include "cuda/fused/tma.cuh"
#include "cuda/fused/wgmma.cuh"

namespace attn::cuda {

template <typename Element_, int kHeadDim_, int kBlockN_, int kStages_>
struct FusedForwardSm90TmaTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWarpGroups = 2;
  static constexpr int kBlockM = 64 * kConsumerWarpGroups;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpGroups;
  static constexpr int kThreads = 128 + kConsumerThreads;  // the producer warpgroup first
  // Tiles hold whole 128-byte column blocks of 64 elements. At head_dim 96 the second block is
  // half used: the copy engine zero-fills columns 96..127 (past the tensor map's head_dim), Q K^T
  // stops at column 96, and P V runs 128 wide, its last 32 accumulator columns never stored.
  static constexpr int kColumnBlocks = (kHeadDim + 63) / 64;
  static constexpr int kTileColumns = 64 * kColumnBlocks;  // of Q, K, V in shared memory, and acc
  static constexpr int kNTiles = kBlockN / 8;              // 8-key column tiles of S
  static constexpr int kDTiles = kTileColumns / 8;         // 8-column tiles of acc
  static constexpr int kQTileBytes = kBlockM * kTileColumns * 2;
  static constexpr int kKVTileBytes = kBlockN * kTileColumns * 2;
  // Q (also the O epilogue's staging), the K stages, the V stages, each tile and column block
  // 1024-byte aligned as the 128-byte swizzle requires; then the mbarriers: Q's, and per stage
  // K full, K empty, V full, V empty.
  static constexpr int kKOffset = kQTileBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKVTileBytes;
  static constexpr int kBarrierOffset = kVOffset + kStages * kKVTileBytes;
  static constexpr int kSmemBytes = kBarrierOffset + 8 * (1 + 4 * kStages);
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 256,
                "P V is m64n64, n128 (head_dim 96 and 128) or n256");
  static_assert(kBlockN == 64 || kBlockN == 80 || kBlockN == 128 || kBlockN == 176 ||
                    kBlockN == 192,
                "S tiles are m64n64, n80, n128, n176 or n192");
  static_assert(kBlockN * 128 % 1024 == 0, "every column block starts 1024-byte aligned");
  static_assert(kStages >= 2, "a stage loads while another is read");
  static_assert(kSmemBytes <= 227 * 1024, "Hopper's shared memory per CTA");
  static_assert(sizeof(Element) == 2, "16-bit storage");
};

// The kernel's parameter block: the plain params and the tensor maps of Q, K and V (made on the
// host, read by the copy engine from parameter space).
struct FusedForwardTmaParams {
  FusedForwardParams p;
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
};

namespace sm90_tma {

// Named barrier ids (0 is __syncthreads): the tensor-core turn of each consumer warpgroup, and
// each one's epilogue.
inline constexpr uint32_t kTurnBarrier = 1;
inline constexpr uint32_t kEpilogueBarrier = 3;

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
};

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

// Queues S = Q K^T for the warpgroup's 64 rows (q_rows) against one K stage: head_dim / 16
// k-steps of 32 bytes inside the 128-byte swizzled rows (at 96, none over the zero-filled
// columns).
template <typename Traits>
__device__ __forceinline__ void IssueScores(float (&s)[Traits::kBlockN / 2], uint32_t q_rows,
                                            uint32_t k_tile) {
#pragma unroll
  for (int ks = 0; ks < Traits::kHeadDim / 16; ++ks) {
    const uint32_t column = (ks % 4) * 32;
    const uint64_t desc_q =
        wgmma::MakeDescriptor(q_rows + (ks / 4) * Traits::kBlockM * 128 + column, 0);
    const uint64_t desc_k =
        wgmma::MakeDescriptor(k_tile + (ks / 4) * Traits::kBlockN * 128 + column, 0);
    ScoreMma<Traits::kBlockN>(s, desc_q, desc_k, ks > 0, typename Traits::Element{});
  }
}

// Queues acc += P V against one V stage, P from registers and V read MN-major.
template <typename Traits>
__device__ __forceinline__ void IssueValues(float (&acc)[Traits::kTileColumns / 2],
                                            const uint32_t (&p)[Traits::kBlockN / 16][4],
                                            uint32_t v_tile) {
#pragma unroll
  for (int ps = 0; ps < Traits::kBlockN / 16; ++ps) {
    const uint64_t desc_v = wgmma::MakeDescriptor(v_tile + ps * 16 * 128, Traits::kBlockN * 128);
    if constexpr (Traits::kTileColumns == 256) {
      wgmma::MmaRS_256(acc, p[ps], desc_v, typename Traits::Element{});
    } else if constexpr (Traits::kTileColumns == 128) {
      wgmma::MmaRS_128(acc, p[ps], desc_v, typename Traits::Element{});
    } else {
      wgmma::MmaRS_64(acc, p[ps], desc_v, typename Traits::Element{});
    }
  }
}

// P (fp32, in the score registers) to the 16-bit A fragments of P V.
template <typename Traits>
__device__ __forceinline__ void PackProbabilities(const float (&s)[Traits::kNTiles][4],
                                                  uint32_t (&p)[Traits::kBlockN / 16][4]) {
  using Element = typename Traits::Element;
#pragma unroll
  for (int ps = 0; ps < Traits::kBlockN / 16; ++ps) {
    p[ps][0] = ptx::PackPair<Element>(s[2 * ps][0], s[2 * ps][1]);
    p[ps][1] = ptx::PackPair<Element>(s[2 * ps][2], s[2 * ps][3]);
    p[ps][2] = ptx::PackPair<Element>(s[2 * ps + 1][0], s[2 * ps + 1][1]);
    p[ps][3] = ptx::PackPair<Element>(s[2 * ps + 1][2], s[2 * ps + 1][3]);
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
          varlen ? 0 : static_cast<int>(blockIdx.z)};
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
      tma::Load4d(tile + cb * Traits::kBlockN * 128, map, full, cb * 64, k_row + key0, kv_head,
                  q.sequence);
    }
  }
};

// The producer: Q, then K and V tiles in the order the consumers finish with them (K_0, K_1,
// V_0, K_2, V_1, ...), each into the next stage of its ring once both consumers have released
// that stage. Every producer thread of the source runs it; thread 0 issues Q's copies.
template <typename Traits, typename Source>
__device__ __forceinline__ void ProduceTiles(const Source& source, const Barriers<Traits>& bars,
                                             uint32_t q_tile, uint32_t k_tiles, uint32_t v_tiles,
                                             int n_block_last, int num_tiles) {
  constexpr int kBlockN = Traits::kBlockN;
  if (Source::kProducerThreads == 1 || threadIdx.x == 0) {
    tma::PrefetchTensorMap(&source.params.q_map);
    tma::PrefetchTensorMap(&source.params.k_map);
    tma::PrefetchTensorMap(&source.params.v_map);
    tma::ArriveExpectBytes(bars.q_full(), Traits::kQTileBytes);
#pragma unroll
    for (int cb = 0; cb < Traits::kColumnBlocks; ++cb) {
      tma::Load4d(q_tile + cb * Traits::kBlockM * 128, &source.params.q_map, bars.q_full(), cb * 64,
                  source.q.row, source.q.head, source.q.sequence);
    }
  }
  const auto load_k = [&](int it) {
    const int stage = StageOf<Traits::kStages>(it);
    tma::Wait(bars.k_empty(stage), ParityOf<Traits::kStages>(it) ^ 1);
    source.LoadKeys(k_tiles + stage * Traits::kKVTileBytes, bars.k_full(stage),
                    (n_block_last - it) * kBlockN);
  };
  const auto load_v = [&](int it) {
    const int stage = StageOf<Traits::kStages>(it);
    tma::Wait(bars.v_empty(stage), ParityOf<Traits::kStages>(it) ^ 1);
    source.LoadValues(v_tiles + stage * Traits::kKVTileBytes, bars.v_full(stage),
                      (n_block_last - it) * kBlockN);
  };
  load_k(0);
  for (int it = 1; it < num_tiles; ++it) {
    load_k(it);
    load_v(it - 1);
  }
  load_v(num_tiles - 1);
}

}  // namespace sm90_tma

template <typename Traits, typename Source = sm90_tma::DenseKvTiles<Traits>>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    FusedForwardSm90TmaKernel(const __grid_constant__ typename Source::Params params) {
#ifdef ATTN_WGMMA_AVAILABLE
  using namespace sm90_tma;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr int kStages = Traits::kStages;
  constexpr int kConsumerThreads = Traits::kConsumerThreads;
  const FusedForwardParams& p = params.p;

  const QueryBlock<kBlockM> block(p);
  if (block.empty()) return;
  const SequenceView<int>& seq = block.seq;
  const int row0 = block.row0;
  const int rows_in_block = block.rows();
  const BlockMask<kBlockN> mask(p, seq, row0, rows_in_block);
  const int n_block_last = mask.n_block_max - 1;
  const int num_tiles = mask.n_block_max - mask.n_block_min;

  // Named as in the other Hopper kernels: one name for the 1024-byte-aligned dynamic tile
  // in a translation unit, where the portable kernel declares its own, 128-byte-aligned.
  extern __shared__ __align__(1024) unsigned char swizzled_smem[];
  const uint32_t q_tile = ptx::SharedAddress(swizzled_smem);
  const uint32_t k_tiles = q_tile + Traits::kKOffset;
  const uint32_t v_tiles = q_tile + Traits::kVOffset;
  const Barriers<Traits> bars{q_tile + Traits::kBarrierOffset};

  if (threadIdx.x == 0) {
    tma::InitBarrier(bars.q_full(), 1);
#pragma unroll
    for (int stage = 0; stage < kStages; ++stage) {
      tma::InitBarrier(bars.k_full(stage), 1);
      tma::InitBarrier(bars.v_full(stage), 1);
      // One arrival per consumer warp.
      tma::InitBarrier(bars.k_empty(stage), kConsumerThreads / 32);
      tma::InitBarrier(bars.v_empty(stage), kConsumerThreads / 32);
    }
    tma::FenceBarrierInit();
  }
  __syncthreads();

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    tma::ReleaseRegisters<kSm90TmaProducerRegisters>();
    if (threadIdx.x < Source::kProducerThreads && num_tiles > 0) {
      const Source source(params, block);
      ProduceTiles<Traits>(source, bars, q_tile, k_tiles, v_tiles, n_block_last, num_tiles);
    }
    return;
  }
  tma::ClaimRegisters<kSm90TmaConsumerRegisters>();

  const int consumer = warp_group - 1;
  const int warp = (threadIdx.x % 128) / 32;  // within the warpgroup: owns 16 of its 64 rows
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;
  const int quad_col = lane % 4;
  const int local_row = consumer * 64 + warp * 16 + quad_row;  // + 8 for the second row
  const int thread_row_pos = row0 + local_row + mask.shift;
  const uint32_t q_rows = q_tile + consumer * 64 * 128;
  // A stage is released by one lane of each warp once the warpgroup's MMAs reading it are done.
  const auto release = [&](uint32_t empty) {
    if (lane == 0) tma::Arrive(empty);
  };
  const uint32_t my_turn = kTurnBarrier + consumer;
  const uint32_t next_turn = kTurnBarrier + (consumer + 1) % Traits::kConsumerWarpGroups;

  float acc[1][kDTiles][4];
#pragma unroll
  for (int dj = 0; dj < kDTiles; ++dj)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][dj][e] = 0.f;
  auto& acc_flat = reinterpret_cast<float(&)[Traits::kTileColumns / 2]>(acc[0]);
  float s[1][kNTiles][4];
  auto& s_flat = reinterpret_cast<float(&)[kBlockN / 2]>(s[0]);
  uint32_t p_frag[kBlockN / 16][4];
  float alpha[2];
  OnlineSoftmax<1, kNTiles, kDTiles> softmax;
  softmax.Init();
  const float scale_log2 = p.scale * static_cast<float>(M_LOG2E);

  // S of tile `it` (landed in s) to P, with the mask where the tile needs one.
  const auto scores_to_probabilities = [&](int it) {
    const int key0 = (n_block_last - it) * kBlockN;
    if (mask.TileNeedsMask(key0))
      mask.template Apply<kNTiles>(s[0], key0, thread_row_pos, quad_col);
    softmax.UpdateStatistics(s, scale_log2, alpha);
  };

  if (num_tiles > 0) {
    // Consumer 0 takes the first turn; the last consumer never hands its final turn on, so
    // that every barrier's arrivals match its waits.
    if (consumer == 0) tma::NamedBarrierArrive(my_turn, kConsumerThreads);
    tma::Wait(bars.q_full(), 0);

    tma::Wait(bars.k_full(0), 0);
    tma::NamedBarrierSync(my_turn, kConsumerThreads);
    wgmma::Fence();
    IssueScores<Traits>(s_flat, q_rows, k_tiles);
    wgmma::CommitGroup();
    tma::NamedBarrierArrive(next_turn, kConsumerThreads);
    wgmma::WaitGroup<0>();
    wgmma::FenceOperands(s_flat);
    release(bars.k_empty(0));
    scores_to_probabilities(0);  // acc is still 0: no rescale
    PackProbabilities<Traits>(s[0], p_frag);

    for (int it = 1; it < num_tiles; ++it) {
      const int stage = StageOf<kStages>(it);
      const int previous = StageOf<kStages>(it - 1);
      tma::Wait(bars.k_full(stage), ParityOf<kStages>(it));
      tma::Wait(bars.v_full(previous), ParityOf<kStages>(it - 1));
      tma::NamedBarrierSync(my_turn, kConsumerThreads);
      wgmma::Fence();
      IssueScores<Traits>(s_flat, q_rows, k_tiles + stage * Traits::kKVTileBytes);
      wgmma::CommitGroup();
      IssueValues<Traits>(acc_flat, p_frag, v_tiles + previous * Traits::kKVTileBytes);
      wgmma::CommitGroup();
      tma::NamedBarrierArrive(next_turn, kConsumerThreads);
      wgmma::WaitGroup<1>();  // S of this tile; P V of the last still running
      wgmma::FenceOperands(s_flat);
      release(bars.k_empty(stage));
      scores_to_probabilities(it);
      wgmma::WaitGroup<0>();
      wgmma::FenceOperands(acc_flat);
      release(bars.v_empty(previous));
      softmax.Rescale(acc, alpha);
      PackProbabilities<Traits>(s[0], p_frag);
    }

    const int last = StageOf<kStages>(num_tiles - 1);
    tma::Wait(bars.v_full(last), ParityOf<kStages>(num_tiles - 1));
    tma::NamedBarrierSync(my_turn, kConsumerThreads);
    wgmma::Fence();
    IssueValues<Traits>(acc_flat, p_frag, v_tiles + last * Traits::kKVTileBytes);
    wgmma::CommitGroup();
    if (consumer + 1 < Traits::kConsumerWarpGroups) {
      tma::NamedBarrierArrive(next_turn, kConsumerThreads);
    }
    wgmma::WaitGroup<0>();
    wgmma::FenceOperands(acc_flat);
    // The last V stage is not released: the producer has nothing more to load.
  }

  // Epilogue: O = acc / l (0 for rows that saw no key), staged through the warpgroup's own rows
  // of the Q tile (its last Q K^T is done), then 16-byte stores of the rows inside the sequence;
  // only head_dim columns of each.
  float* lse = block.lse(p);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float l = QuadSum(softmax.l[half]);
    const float inv_l = InverseRowSum(l);
    const int row = local_row + half * 8;
#pragma unroll
    for (int dj = 0; dj < kHeadDim / 8; ++dj) {
      const int col = dj * 8 + quad_col * 2;
      *reinterpret_cast<uint32_t*>(swizzled_smem + wgmma::SwizzledByteOffset(row, col, kBlockM)) =
          ptx::PackPair<Element>(acc[0][dj][2 * half] * inv_l, acc[0][dj][2 * half + 1] * inv_l);
    }
    if (lse != nullptr && quad_col == 0 && row < rows_in_block) {
      lse[row] = RowLse(softmax.m[half], l, p.scale);
    }
  }
  tma::NamedBarrierSync(kEpilogueBarrier + consumer, 128);
  Element* o = static_cast<Element*>(p.o) + (seq.q_start + row0) * p.o_token_stride +
               block.head * p.o_head_stride;
  constexpr int kChunksPerRow = kHeadDim / 8;
  static_assert(64 * kChunksPerRow % 128 == 0, "each thread stores whole chunks");
#pragma unroll
  for (int i = 0; i < 64 * kChunksPerRow / 128; ++i) {
    const int c = threadIdx.x % 128 + i * 128;
    const int row = consumer * 64 + c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    if (row < rows_in_block) {
      *reinterpret_cast<uint4*>(o + row * p.o_token_stride + col) = *reinterpret_cast<const uint4*>(
          swizzled_smem + wgmma::SwizzledByteOffset(row, col, kBlockM));
    }
  }
#endif  // ATTN_WGMMA_AVAILABLE
}

}  // namespace attn::cuda
