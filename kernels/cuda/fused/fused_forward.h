// Launch API of the fused (FlashAttention-style) forward kernel. Host-only header: no CUDA
// types leak into callers beyond an opaque stream.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "attn/dtype.h"

namespace attn::cuda {

// Which implementation runs. kAuto: on Hopper (when the build holds sm_90a code) the Hopper
// kernel heuristics.h names for the problem's head_dim and mask, elsewhere the portable
// (mma.sync) kernel. The others pin one kernel, for tests and benchmarks: kPortable runs
// everywhere; kSm90Lockstep (fused_forward_sm90_kernel.cuh) and kSm90Tma (the warp-specialised
// fused_forward_sm90_tma_kernel.cuh) only on Hopper, and the launch answers UNIMPLEMENTED where
// the pinned kernel cannot run. The paged forward's prefill takes the same pins (its paged
// kernels: paged_forward.h); its decode kernel runs whatever is pinned.
enum class FusedKernel : uint8_t { kAuto, kPortable, kSm90Lockstep, kSm90Tma };

// Plain kernel parameters: device pointers, strides in elements, sizes. The backward's params
// extend these (fused_backward.h): both passes read Q, K, V and O this way and walk the same
// sequences under the same mask.
struct FusedForwardParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;     // the forward's output, the backward's input
  float* lse = nullptr;  // [num_heads, total_q]; forward: null = not stored
  int64_t q_token_stride = 0, q_head_stride = 0;
  int64_t k_token_stride = 0, k_head_stride = 0;
  int64_t v_token_stride = 0, v_head_stride = 0;
  int64_t o_token_stride = 0, o_head_stride = 0;
  int64_t total_q = 0;  // LSE row stride
  int64_t total_k = 0;  // key tokens of all sequences (the TMA kernel's tensor bounds)
  // Device arrays of batch + 1 prefix sums. Both null for a uniform (dense) batch, in which
  // case sequence b starts at b * seqlen_q / b * seqlen_k.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t seqlen_q = 0;  // uniform batches: every sequence's length
  int64_t seqlen_k = 0;
  int64_t max_seqlen_q = 0;  // sizes the grid
  int batch = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float scale = 0.f;
  int window_left = -1;   // effective: negative = unbounded
  int window_right = -1;  // effective: causal already folded in (0)
  DType dtype = DType::kBF16;
  FusedKernel kernel = FusedKernel::kAuto;
  // kSm90Tma: keys per K/V tile and consumer warpgroups, 0 for the heuristic's; otherwise those
  // of one of the two shapes compiled for the head_dim (heuristics.h, Sm90TmaFusedTileShape), for
  // tests and benchmarks. At head_dim 64 both shapes have 128-key tiles (two and three
  // consumers), so there the consumers tell them apart.
  int block_n = 0;
  int consumer_warpgroups = 0;
  // kSm90Tma: CTAs of its persistent grid, 0 for one an SM; tests pin a few, so that small
  // problems walk several query blocks a CTA.
  int persistent_ctas = 0;
  // kSm90Tma: two device ints, zero, from which its CTAs draw query blocks and which it leaves
  // zero (query_schedule.cuh); one launch at a time may use them. Null: the kernel does not run
  // (kAuto takes the next one).
  int* tile_counters = nullptr;
};

// Which problems it covers: FusedSupports(Pass::kForward, p) in fused_support.h.

// Checks alignment of pointers and strides (16-byte vector access) and launches.
absl::Status LaunchFusedForward(const FusedForwardParams& params, void* stream);

}  // namespace attn::cuda
