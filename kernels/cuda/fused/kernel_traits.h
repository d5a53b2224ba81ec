// Compile-time shape of one fused-forward instantiation: tile sizes, warps, register fragment
// counts and the shared-memory layout. No code, only constants.
#pragma once

#include "cuda/fused/heuristics.h"

namespace attn::cuda {

// The shape defaults to the heuristic; benchmarks may instantiate others to compare.
template <typename Element_, int kHeadDim_,
          FusedTileShape kShape_ = FusedForwardTileShape(kHeadDim_)>
struct FusedForwardTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr FusedTileShape kShape = kShape_;
  static constexpr int kBlockM = kShape.block_m;
  static constexpr int kBlockN = kShape.block_n;
  static constexpr int kWarps = kShape.warps;
  static constexpr int kThreads = kWarps * 32;

  static constexpr int kRowsPerWarp = kBlockM / kWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;  // 16-row MMA tiles per warp
  static constexpr int kNTiles = kBlockN / 8;        // 8-key MMA tiles of S per row tile
  static constexpr int kDTiles = kHeadDim / 8;       // 8-column MMA tiles of O per row tile
  static constexpr int kKSteps = kHeadDim / 16;      // k-steps of Q K^T
  static constexpr int kPSteps = kBlockN / 16;       // k-steps of P V

  // Rows of every shared tile are padded by 16 bytes: with that pitch the 8 row addresses of an
  // ldmatrix land in 8 distinct 4-bank groups for every head_dim used (32..256), so fragment
  // loads are conflict-free without a swizzle.
  static constexpr int kRowPitch = kHeadDim + 16 / static_cast<int>(sizeof(Element));
  static constexpr int kChunksPerRow = kHeadDim * static_cast<int>(sizeof(Element)) / 16;
  static constexpr int kQTileBytes = kBlockM * kRowPitch * static_cast<int>(sizeof(Element));
  static constexpr int kKVTileBytes = kBlockN * kRowPitch * static_cast<int>(sizeof(Element));
  // Q (reused for the O epilogue), then one K tile and one V tile.
  static constexpr int kSmemBytes = kQTileBytes + 2 * kKVTileBytes;

  static_assert(kHeadDim % 16 == 0, "head_dim must be a multiple of 16");
  static_assert(kRowsPerWarp % 16 == 0, "each warp owns whole 16-row MMA tiles");
  static_assert(kBlockN % 16 == 0 && kDTiles % 2 == 0, "fragments are loaded in pairs");
};

}  // namespace attn::cuda
