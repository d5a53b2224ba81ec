// Launch API of the fused (FlashAttention-style) forward kernel. Host-only header: no CUDA
// types leak into callers beyond an opaque stream.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "attn/dtype.h"

namespace attn::cuda {

// Which implementation runs: the Hopper (wgmma) kernel where the device and the build allow it,
// or always the portable (mma.sync) kernel, which tests and benchmarks select to cover it on
// Hopper too.
enum class FusedKernel : uint8_t { kAuto, kPortable };

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
};

// Which problems it covers: FusedSupports(Pass::kForward, p) in fused_support.h.

// Checks alignment of pointers and strides (16-byte vector access) and launches.
absl::Status LaunchFusedForward(const FusedForwardParams& params, void* stream);

}  // namespace attn::cuda
