// Compile-time shape of one paged decode instantiation: tile sizes, warps, fragment counts and
// the shared-memory layout. No code, only constants; plain C++ so that the host plan
// (paged_forward.cc) sizes occupancy from the same numbers the kernel uses.
#pragma once

#include "cuda/fused/heuristics.h"

namespace attn::cuda {

// A decode CTA: 16 packed query rows (one MMA row tile) and 4 warps.
inline constexpr int kPagedDecodeRows = 16;
inline constexpr int kPagedDecodeWarps = 4;

// The decode kernel's shared memory, in bytes: Q's 16 packed rows, then kStages stages of K and
// V; after the main loop the stages hold each warp's m, l and acc for the merge.
struct PagedDecodeLayout {
  int row_pitch;  // elements: rows padded by 16 bytes, conflict-free ldmatrix without a swizzle
  int acc_pitch;  // floats of a merge row, padded by 4
  int q_tile_bytes;
  int kv_tile_bytes;
  int smem_bytes;
};

constexpr PagedDecodeLayout PagedDecodeSharedLayout(int head_dim, int element_bytes) {
  constexpr int kRows = kPagedDecodeRows, kWarps = kPagedDecodeWarps;
  const PagedDecodeShape shape = PagedDecodeTileShape(head_dim);
  PagedDecodeLayout l{};
  l.row_pitch = head_dim + 16 / element_bytes;
  l.acc_pitch = head_dim + 4;
  l.q_tile_bytes = kRows * l.row_pitch * element_bytes;
  l.kv_tile_bytes = shape.block_n * l.row_pitch * element_bytes;
  const int stages = shape.stages * 2 * l.kv_tile_bytes;
  const int merge = kWarps * kRows * (l.acc_pitch + 2) * 4;
  l.smem_bytes = l.q_tile_bytes + (stages > merge ? stages : merge);
  return l;
}

template <int kHeadDim_, int kElementBytes = 2>
struct PagedDecodeTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr PagedDecodeShape kShape = PagedDecodeTileShape(kHeadDim);
  static constexpr int kBlockM = kPagedDecodeRows;
  static constexpr int kBlockN = kShape.block_n;
  static constexpr int kStages = kShape.stages;
  static constexpr int kWarps = kPagedDecodeWarps;
  static constexpr int kThreads = kWarps * 32;
  // Each warp takes its quarter of a stage's keys for all kBlockM rows; the warps' row states
  // merge once, at the end.
  static constexpr int kWarpKeys = kBlockN / kWarps;
  static constexpr int kNTiles = kWarpKeys / 8;   // 8-key MMA tiles of S per warp
  static constexpr int kDTiles = kHeadDim / 8;    // 8-column MMA tiles of O
  static constexpr int kKSteps = kHeadDim / 16;   // k-steps of Q K^T
  static constexpr int kPSteps = kWarpKeys / 16;  // k-steps of P V
  // Q stays in registers as MMA fragments up to head_dim 128 (32 registers); at 256 it is read
  // from shared memory every stage, leaving the registers to the 128 accumulators.
  static constexpr bool kQInRegisters = kHeadDim <= 128;

  static constexpr PagedDecodeLayout kLayout = PagedDecodeSharedLayout(kHeadDim, kElementBytes);
  static constexpr int kRowPitch = kLayout.row_pitch;
  static constexpr int kChunksPerRow = kHeadDim * kElementBytes / 16;
  static constexpr int kQTileBytes = kLayout.q_tile_bytes;
  static constexpr int kKVTileBytes = kLayout.kv_tile_bytes;
  static constexpr int kStageBytes = 2 * kKVTileBytes;  // K then V
  static constexpr int kAccPitch = kLayout.acc_pitch;
  static constexpr int kSmemBytes = kLayout.smem_bytes;

  static_assert(kHeadDim % 16 == 0, "head_dim must be a multiple of 16");
  static_assert(kWarpKeys % 16 == 0, "each warp's keys are whole k-steps of P V");
  static_assert(kDTiles % 2 == 0, "fragments are loaded in pairs");
  static_assert(kStages >= 2, "a stage loads while another is read");
};

}  // namespace attn::cuda
