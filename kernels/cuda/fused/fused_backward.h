// Launch API of the fused backward pass (FlashAttention-2's algorithm): dQ, dK, dV from Q, K, V,
// O, dO and the forward's log-sum-exp, recomputing S and P tile by tile on chip (registers, and
// shared memory for P and dS), so that no N x N matrix reaches device memory. Host-only header.
//
// Three launches on one stream: D = rowsum(dO * O) per query row; the main kernel, one CTA per
// (key block, KV head, sequence), which keeps its block of K and V in shared memory, walks the
// query tiles of every query head of its group that can see the block, accumulates dK and dV in
// registers and adds each tile's dQ into a float32 accumulator; then dQ is rounded into its
// tensor. The main kernel is the Hopper one on sm_90a (fused_backward_sm90_kernel.cuh: 128-key
// blocks, TMA, wgmma, dQ by bulk reductions, optionally in a fixed order) or the portable one
// (fused_backward_kernel.cuh: 64-key blocks, mma.sync, dQ by atomics). Intermediate memory: D,
// the dQ accumulator and a counter per query tile, O(N * heads * d).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "attn/problem.h"
#include "cuda/fused/fused_forward.h"

namespace attn::cuda {

// The forward's params (Q, K, V, O and the LSE, now inputs; the sequences, heads, scale and
// mask) and what only the backward reads or writes. max_seqlen_q sizes the deterministic
// mode's counters; kernel pins the backward kernel as it does the forward's (kPortable, or
// kSm90Tma for the Hopper kernel; kSm90Lockstep has no backward and answers as kSm90Tma does).
struct FusedBackwardParams : FusedForwardParams {
  const void* d_o = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int64_t do_token_stride = 0, do_head_stride = 0;
  int64_t dq_token_stride = 0, dq_head_stride = 0;
  int64_t dk_token_stride = 0, dk_head_stride = 0;
  int64_t dv_token_stride = 0, dv_head_stride = 0;
  int64_t max_seqlen_k = 0;  // sizes the grid
  // dQ's partial sums (one per key block) added in key-block order: bit-identical gradients.
  bool deterministic = false;
  // Workspace (device, FusedBackwardWorkspaceBytes): D (padded to 16 bytes), then the dQ
  // accumulator.
  void* workspace = nullptr;
};

// Which problems it covers: FusedSupports(Pass::kBackward, p) in fused_support.h.

// Device workspace the launch needs: float32 D [num_heads, total_q] and the float32 dQ
// accumulator [total_q, num_heads, head_dim].
int64_t FusedBackwardWorkspaceBytes(const AttentionProblem& p);

// Launches the three kernels on `stream` (tensors may have any strides: rows that are not
// 16-byte aligned move element by element).
absl::Status LaunchFusedBackward(const FusedBackwardParams& params, void* stream);

}  // namespace attn::cuda
