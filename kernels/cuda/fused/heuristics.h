// Tile shapes of the fused forward kernel, per head dimension: the one place tuning lives.
#pragma once

namespace attn::cuda {

struct FusedTileShape {
  int block_m;  // query rows per CTA
  int block_n;  // keys per K/V tile
  int warps;    // each warp owns block_m / warps consecutive query rows
};

// Starting points follow the register budget: a warp keeps (rows/16) x (head_dim/8) x 4 fp32
// output accumulators plus (rows/16) x (block_n/8) x 4 scores, under 255 registers at two CTAs
// per SM. Measurements that changed these are recorded in docs/cuda-fused.md.
constexpr FusedTileShape FusedForwardTileShape(int head_dim) {
  // 128 x 128 tiles for head_dim <= 64 spill (255 registers, 72-byte stack at 64): the 128
  // score accumulators plus row bookkeeping do not fit beside the output fragments.
  if (head_dim <= 64) return {128, 64, 4};
  if (head_dim <= 128) return {128, 64, 4};
  return {64, 64, 4};  // 256: 128 accumulators per thread already
}

// The Hopper kernel's tiles, for the head dims the table gives it (capabilities.h); its 128
// query rows are fixed: two warpgroups of 64.
struct Sm90TileShape {
  int block_n;      // keys per K/V tile
  int ctas_per_sm;  // resident CTAs the register budget is sized for
};

// Measured on the H200, bf16, 2026-11-30 (docs/cuda-fused.md): at head_dim 64, two resident
// CTAs (128 registers a thread, a few spilled) beat one by 10-28%: one CTA's softmax overlaps
// the other's MMAs. At 128, 64-key tiles with two CTAs tie with 128-key tiles and one CTA.
constexpr Sm90TileShape Sm90FusedTileShape(int head_dim) {
  return head_dim <= 64 ? Sm90TileShape{128, 2} : Sm90TileShape{128, 1};
}

}  // namespace attn::cuda
