// Tile sizes of the CPU tiled engine, in one place.
#pragma once

namespace attn::cpu {

// Query rows per work item (forward) and per inner step (backward). With d = 256 a worker's
// float scratch (Q block, K^T and V tiles, accumulator) stays near 256 KiB, inside the L2 of the
// build machine's EPYC cores; d = 64 uses a quarter of that.
inline constexpr int kBlockQ = 64;
// Keys per streamed K/V tile; 64 floats are four 512-bit vectors, so the row loops over a tile
// run without a remainder on AVX-512.
inline constexpr int kBlockK = 64;
// Query tokens per work item of the element-wise passes (D = rowsum(dO * O), dQ store).
inline constexpr int kRowsPerItem = 256;
// Mutex stripes guarding the shared dQ accumulator in the backward pass.
inline constexpr int kDqLockStripes = 64;

}  // namespace attn::cpu
