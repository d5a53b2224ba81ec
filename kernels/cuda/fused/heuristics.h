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

}  // namespace attn::cuda
