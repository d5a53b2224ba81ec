// Launch API of the fused backward pass (FlashAttention-2's algorithm): dQ, dK, dV from Q, K, V,
// O, dO and the forward's log-sum-exp, recomputing S and P tile by tile on chip (registers, and
// shared memory for P and dS), so that no N x N matrix reaches device memory. Host-only header.
//
// Three launches on one stream: D = rowsum(dO * O) per query row; the main kernel, one CTA per
// (64-key block, KV head, sequence), which keeps its block of K and V in shared memory, walks
// the query tiles of every query head of its group that can see the block, accumulates dK and
// dV in registers and adds each tile's dQ into a float32 accumulator with atomics; then dQ is
// rounded into its tensor. Intermediate memory: D and the dQ accumulator, O(N * heads * d).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "attn/dtype.h"
#include "attn/problem.h"

namespace attn::cuda {

struct FusedBackwardParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* d_o = nullptr;
  const float* lse = nullptr;  // [num_heads, total_q]
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int64_t q_token_stride = 0, q_head_stride = 0;
  int64_t k_token_stride = 0, k_head_stride = 0;
  int64_t v_token_stride = 0, v_head_stride = 0;
  int64_t o_token_stride = 0, o_head_stride = 0;
  int64_t do_token_stride = 0, do_head_stride = 0;
  int64_t dq_token_stride = 0, dq_head_stride = 0;
  int64_t dk_token_stride = 0, dk_head_stride = 0;
  int64_t dv_token_stride = 0, dv_head_stride = 0;
  int64_t total_q = 0;
  // Device arrays of batch + 1 prefix sums, or both null for a uniform batch.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t seqlen_q = 0;  // uniform batches
  int64_t seqlen_k = 0;
  int64_t max_seqlen_k = 0;  // sizes the grid
  int batch = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float scale = 0.f;
  int window_left = -1;   // effective: negative = unbounded
  int window_right = -1;  // effective: causal already folded in (0)
  DType dtype = DType::kBF16;
  // Workspace (device, FusedBackwardWorkspaceBytes): D (padded to 16 bytes), then the dQ
  // accumulator.
  void* workspace = nullptr;
};

// OK when the fused backward covers the problem (float16 / bfloat16, head_dim 32, 64, 96 or
// 128); UNIMPLEMENTED with the reason otherwise.
absl::Status FusedBackwardSupports(const AttentionProblem& p);

// Device workspace the launch needs: float32 D [num_heads, total_q] and the float32 dQ
// accumulator [total_q, num_heads, head_dim].
int64_t FusedBackwardWorkspaceBytes(const AttentionProblem& p);

// Launches the three kernels on `stream` (tensors may have any strides: rows that are not
// 16-byte aligned move element by element).
absl::Status LaunchFusedBackward(const FusedBackwardParams& params, void* stream);

}  // namespace attn::cuda
