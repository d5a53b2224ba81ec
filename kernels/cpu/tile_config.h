// Tile sizes of the CPU tiled engine, in one place.
#pragma once

namespace attn::cpu {

// Query rows per work item (forward) and per inner step (backward). Each forward item converts
// every K/V tile it streams to float, so taller blocks amortise that. Measured with
// attn_cpu_bench (N = 2048, d = 64, 8 heads, 2 threads, GFLOP per CPU-second, two runs each, the
// shared build machine loaded): 64 rows: forward 41-49, backward 60-65; 128 rows: forward 60-70,
// backward 86-91; 256 rows: forward 57-73, backward 72-82. With d = 256 a worker's float scratch
// (Q block, K^T and V tiles, accumulator, S) is about 420 KiB, inside the 1 MiB L2.
inline constexpr int kBlockQ = 128;
// Keys per streamed K/V tile; 64 floats are four 512-bit vectors, so the row loops over a tile
// run without a remainder on AVX-512.
inline constexpr int kBlockK = 64;
// Keys per backward work item (whole K/V tiles). Each item converts every query block it meets
// and adds its dQ contribution into the shared accumulator, so wider key blocks amortise both;
// perf showed those two at about a sixth of the backward with one tile per item. Against one or
// four tiles per item the bench (same setting as above) could not separate 128 keys from the load
// noise of the shared machine (backward 56-91 GFLOP per CPU-second for all three).
inline constexpr int kBackwardKeys = 2 * kBlockK;
// Query tokens per work item of the element-wise passes (D = rowsum(dO * O), dQ store).
inline constexpr int kRowsPerItem = 256;
// Mutex stripes guarding the shared dQ accumulator in the backward pass.
inline constexpr int kDqLockStripes = 64;

}  // namespace attn::cpu
