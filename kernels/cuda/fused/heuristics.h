// Tile shapes of the fused forward kernel, per head dimension: the one place tuning lives.
#pragma once

#include <cstdint>

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

// The warp-specialised Hopper kernel (fused_forward_sm90_tma_kernel.cuh): one producer warp
// feeding K/V stages by TMA, two or three consumer warpgroups of 64 query rows each (kBlockM =
// 128 or 192). Every (dtype, head_dim) row of the table compiles a shape for full tiles and one
// for masked problems (causal or a window), the same one at 256, and a test or benchmark may
// run either on any problem (FusedForwardParams::block_n and consumer_warpgroups).
struct Sm90TmaTileShape {
  int block_n;                  // keys per K/V tile
  int stages;                   // K and V tiles in flight each
  int consumer_warpgroups = 2;  // of 64 query rows each
};

// Starting points from FlashAttention-3's choices on the H100 (128 x 176 at d 128, 128 x 128
// when causal; 192 x 192 at d 64) within the 227 KiB of shared memory: d 128 x 176 keys x 2
// stages of K and V take 176 KiB beside Q's 32. At head_dim 64 three consumer warpgroups (192
// query rows) with 128 keys and 3 stages: on the H200 (bf16 and fp16, 2026-12-02) 1.10-1.24x
// the two-warpgroup kernel's 192 keys unmasked and, causal, 1.06-1.26x its 128 keys from 2048
// keys, 0.88-0.94x at 512 and 1024; so the masked shape is that two-warpgroup one, 128 keys
// and 3 stages, which masked problems below 2048 keys run (Sm90TmaTakesMaskedShape). 192 keys
// beside 192 rows would not fit the 160 registers a consumer thread gets (96 scores, 48
// packed P).
// head_dim 96 runs the shapes of 128: its tiles are 128 columns wide in shared memory (the last
// 32 zero-filled by the copy engine). head_dim 256 takes FlashAttention-3's 80 keys, masked or
// not: 2 stages of K and V (160 KiB) beside Q's 64 fill 224 KiB, and the 128 accumulators plus
// 40 scores and 20 packed P a thread fit the consumers' 240 registers. Neither is measured yet.
constexpr Sm90TmaTileShape Sm90TmaFusedTileShape(int head_dim, bool masked) {
  if (head_dim <= 64) return masked ? Sm90TmaTileShape{128, 3, 2} : Sm90TmaTileShape{128, 3, 3};
  if (head_dim > 128) return Sm90TmaTileShape{80, 2};
  return masked ? Sm90TmaTileShape{128, 2} : Sm90TmaTileShape{176, 2};
}

// Whether a problem runs the masked shape of Sm90TmaFusedTileShape: masked ones, and at
// head_dim 128 unmasked ones of up to 1024 keys a sequence, where a block has few tiles and the
// 176-key ones leave a partial last tile (128-key ones divide those lengths). H200, 2026-12-02,
// 16k tokens, both shapes pinned, two rounds each in one call and one more in a second
// (docs/cuda-fused.md): 128 keys 1.05-1.06x the 176-key tiles at 512 keys (bf16, fp16), 1.02x
// at 1024 in fp16 and 0.96-1.07x in bf16 (the 1024 rows swing ±4% between rounds), level at 2048
// and 4096, 0.98-0.99x from 8192. head_dim 96 shares the shapes but was not measured: 176 stays.
// At 64 masked problems from 2048 keys run the full shape (three consumers, above).
constexpr bool Sm90TmaTakesMaskedShape(int head_dim, int64_t mean_keys, bool masked) {
  if (head_dim <= 64) return masked && mean_keys < 2048;
  return masked || (head_dim == 128 && mean_keys <= 1024);
}

// The FP8 forward (fp8_forward.h, head_dim 128 and 256): 128 keys, so that a tile of the
// transposed V (head_dim rows of key slots) is one 128-byte column block, the size of a K tile.
// At 128 three stages of 16 KiB K and V tiles beside Q's 16 KiB take 112 KiB; at 256 two stages
// of 32 KiB beside Q's 32 take 160 KiB, as the 16-bit kernel's two there. Not tuned.
constexpr Sm90TmaTileShape Sm90TmaFp8TileShape(int head_dim) {
  return head_dim > 128 ? Sm90TmaTileShape{128, 2, 2} : Sm90TmaTileShape{128, 3, 2};
}

// The same kernel over pages (the paged prefill, paged_tma_source.cuh): its key tiles are a
// power of two, so that with power-of-two pages a tile is a piece of one page or whole pages.
// At 64, 96 and 128 the masked shapes above, for masked and full problems alike (dense, the
// 128-key tile ran level with the 192-key one unmasked at 64 and 5-12% behind the 176-key one
// at 128, docs/cuda-fused.md); at 256, 64 keys: 128 would need 256 KiB of K and V stages beside
// Q's 64, and 2 stages of 32 KiB each fit in 192 KiB.
constexpr Sm90TmaTileShape Sm90TmaPagedTileShape(int head_dim) {
  if (head_dim <= 64) return {128, 3};
  if (head_dim <= 128) return {128, 2};
  return {64, 2};
}

// Whether kAuto runs the paged prefill on the warp-specialised kernel rather than the lockstep
// one (where both exist, head_dim 64 and 128). Over pages shorter than its 128-key tile it
// issues a copy per page piece: at head_dim 64 with 16-token pages that costs more than it saves
// (H200, bf16, 16k tokens, N = 1024-16384: 239-276 TFLOP/s against the lockstep kernel's
// 306-338 unmasked, 192-276 against 232-327 causal); with 64-token pages it wins (255-439
// against 235-339), as it does at 128 from 16-token pages (297-423 against 225-324).
// 32-token pages at 64 are not measured and stay on the lockstep kernel. docs/cuda-fused.md.
constexpr bool PagedPrefillPrefersTma(int head_dim, int page_tokens) {
  return head_dim > 64 || page_tokens >= 64;
}

// Registers a thread of each role keeps after setmaxnreg, the two summing to the CTA's 64512
// (384 threads x 168): 128 x 40 + 256 x 232, except at head_dim 256, whose consumers need 240
// for their 128 accumulators beside 40 scores and 20 packed P (128 x 24 + 256 x 240). The
// producer walks the persistent grid's blocks (block indices, mask bounds, ring positions, the
// queue's draws): at 24 registers ptxas spills 40-120 bytes of it (nvcc -Xptxas -v, CUDA
// 13.0), at 40 nothing at head_dim 64, 96 and 128.
// With three consumer warpgroups (512 threads, head_dim 64) the split is 128 x 32 + 384 x 160
// = 65536, neither role spilling.
constexpr int Sm90TmaProducerRegisters(int head_dim, int consumer_warpgroups) {
  if (consumer_warpgroups == 3) return 32;
  return head_dim > 128 ? 24 : 40;
}
constexpr int Sm90TmaConsumerRegisters(int head_dim, int consumer_warpgroups) {
  if (consumer_warpgroups == 3) return 160;
  return head_dim > 128 ? 240 : 232;
}

// kAuto on Hopper runs the warp-specialised kernel wherever the table has it (64, 96, 128 and
// 256), before the lockstep kernel (64, 128) and the portable one (docs/cuda-fused.md, "The
// warp-specialised Hopper kernel"). At 128 it is 1.3-1.7x the lockstep kernel everywhere; at 96
// and 256 the mma.sync kernel ran at 0.38-0.71x it. At 64 (H200, 16k tokens a batch, bf16 and
// fp16, 2026-12-02) three consumers are 1.18-1.27x the lockstep kernel unmasked and 1.16-1.22x
// causal from 2048 keys; causal below 2048 the two-consumer masked shape is 1.05-1.14x it (and
// 1.05-1.07x three consumers at 512 keys, 1.11-1.18x at 1024). Raw:
// docs/results/2026-12-02-h200-forward-d64-shapes.jsonl.

// ---- Paged K/V (paged_forward.h) ----

// The decode kernel (paged_decode_kernel.cuh) serves calls whose query rows per (sequence, KV
// head), the query heads of a group times the query tokens, fit in a few 16-row tiles; its CTAs
// of one (sequence, KV head) read the same pages at the same time, so the L2 serves the repeats.
// Beyond this the prefill kernel (one CTA per 128 query rows of one head) runs. 64 = GQA 4 with
// 16 query tokens, or GQA 8 with 8: both kernels then read each page group-size times (the
// decode kernel's row tiles through L2), the prefill kernel with tiles 7/8 empty. A count, not
// yet a measurement: the measured decode rows are 4 and 16 (16 x 8k keys, 4 query tokens of
// GQA 4: 3.62 TB/s).
inline constexpr int kPagedDecodeMaxRows = 64;

// Keys per pipeline stage of the decode kernel and the stages in flight. A stage holds K and V
// of kBlockN keys (about 32 KiB at every head_dim up to 128): with three stages two CTAs fit an
// SM's shared memory on Hopper and keep two stages (64 KiB) of loads in flight each, well past
// the ~33 KiB per SM that 4.3 TB/s needs at a microsecond of latency (sized by that count, not
// swept). Each of the 4 warps takes a quarter of a stage's keys, a multiple of 16 (one MMA
// k-step of P V).
struct PagedDecodeShape {
  int block_n;  // keys per stage
  int stages;
};

constexpr PagedDecodeShape PagedDecodeTileShape(int head_dim) {
  if (head_dim <= 32) return {256, 3};
  if (head_dim <= 64) return {128, 3};
  if (head_dim <= 128) return {64, 3};
  return {64, 2};  // 256: 68 KiB a stage; correct, not tuned
}

// Split-KV: how many CTAs share one (sequence, KV head, row tile)'s keys. Each split writes a
// float32 partial O and its LSE, which the tile's last split merges. With `ctas` CTAs before
// splitting and `slots` resident CTAs on the device (SMs x CTAs per SM): as many splits as
// keep the CTAs within one full wave, none once the CTAs fill the device, and none that leaves
// a split fewer than kPagedDecodeMinTilesPerSplit stages of keys.
//
// FlashAttention 3 (hopper/heuristics.h) takes the smallest count within 85% of the best wave
// efficiency, for kernels that are compute-bound per CTA. This kernel is bound by the reads in
// flight, so more CTAs (up to a wave) are faster and a partial second wave is a second round
// of latency. Measured on the H200 (bf16, d 128, 32/8 heads, 128-token pages, median us of
// attn_decode_bench --splits, docs/cuda-fused.md); the rule's choice in (parentheses), the best
// in [brackets]:
//   1 x 4k   (8 CTAs):   1: 95  4: 32  8: 20  ([16]: 14.5)  32: 15.6  64: 23
//   1 x 32k  (8 CTAs):   8: 100  16: 55  [32: 45.1]  (33: 45.7)  64: 51
//   4 x 4k   (32 CTAs):  2: 54  4: 32  ([8]: 26.4)  16: 31  32: 40
//   4 x 32k  (32 CTAs):  4: 196  ([8]: 143)  16: 143  32: 150
//   8 x 4k   (64 CTAs):  2: 55  ([4]: 44)  8: 50  16: 58
//   8 x 32k  (64 CTAs):  2: 377  (4: 274)  [8: 271]  16: 281
//   16 x 4k  (128 CTAs): 1: 99  ([2]: 78)  4: 84  8: 88
//   16 x 32k (128 CTAs): 1: 737  (2: 539)  [4: 531]  8: 534  16: 540
// The rule is within 1.5% of the best everywhere; splits of 2 stages (1 x 4k, 32 splits) lose
// to splits of 4, hence the minimum.
inline constexpr int kPagedDecodeMinTilesPerSplit = 4;
inline constexpr int kPagedDecodeMaxSplits = 128;

constexpr int PagedDecodeSplits(int64_t ctas, int64_t tiles, int64_t slots) {
  if (ctas <= 0 || slots <= ctas) return 1;
  int64_t splits = slots / ctas;
  if (splits > tiles / kPagedDecodeMinTilesPerSplit) splits = tiles / kPagedDecodeMinTilesPerSplit;
  if (splits > kPagedDecodeMaxSplits) splits = kPagedDecodeMaxSplits;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

// The page size a KV pool should use for the kernels here: a page of at least a decode stage's
// keys and a Hopper prefill tile's (128) costs one block-table read per stage or tile; smaller
// pages cost a read per key row. Measured on the H200 (decode, bf16, d 128, 32/8 heads, TB/s
// for 16, 64, 128 and 256-token pages): 16 x 32k keys 3.46, 4.00, 3.99, 4.03; 16 x 8k 3.21,
// 3.81, 3.76, 3.78; 1 x 32k 2.62, 2.97, 2.95, 2.94 (docs/cuda-fused.md). Any power of two works.
constexpr int PagedKvPageTokens(int head_dim) {
  const int stage = PagedDecodeTileShape(head_dim).block_n;
  return stage > 128 ? stage : 128;
}

// ---- The Hopper backward (fused_backward_sm90_kernel.cuh, and at head_dim 256
// fused_backward_sm90_wide_kernel.cuh) ----

// Query rows per tile, by head_dim; the deterministic mode's counters count tiles of this many
// rows. A CTA holds 128 keys, 64 per consumer warpgroup, whose accumulators must fit the
// registers each consumer thread gets: dK and dV take head_dim (128 at head_dim 128), S^T and
// dP^T rows / 2 each, dQ rows x head_dim / 512. At head_dim 64, 128 rows halve the tiles, and
// with them the waits and barriers per product. head_dim 96 runs the tiles of 128 (128-wide
// accumulators), so it takes 128's rows. At 256 a CTA holds 64 keys that both warpgroups share
// (each takes half of the columns of dK, dV and dQ), with 64 rows a tile.
constexpr int Sm90BackwardBlockM(int head_dim) { return head_dim <= 64 ? 128 : 64; }

// Registers a thread of each role keeps after setmaxnreg: the producer warpgroup (the load
// warp and the warp that adds dQ into the accumulator) and the two consumer warpgroups
// (128 x 40 + 256 x 232 = 64512).
inline constexpr int kSm90BackwardProducerRegisters = 40;
inline constexpr int kSm90BackwardConsumerRegisters = 232;

}  // namespace attn::cuda
