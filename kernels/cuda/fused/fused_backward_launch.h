// Per-row entry points of the fused backward's main kernel: one generated .cu per backward row
// of the table (capabilities.h) defines RunFusedBackwardKernel<dtype, head_dim>;
// fused_backward.cu calls it between the D kernel and the dQ kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attn/dtype.h"
#include "cuda/fused/fused_backward.h"

namespace attn::cuda {

// The main kernel's share of the workspace (fused_backward.cu lays it out).
struct FusedBackwardWorkspace {
  const float* delta = nullptr;     // D [num_heads, total_q]
  float* dq_accum = nullptr;        // zeroed, [total_q, num_heads, head_dim]
  int* dq_tile_counters = nullptr;  // deterministic mode: zeroed, [batch, num_heads, query_tiles]
  int64_t query_tiles = 0;          // per (sequence, head), of kDqCounterRows rows
};

// The kernel params.kernel pins (kAuto: the Hopper kernel where it can run, else the portable
// one). The aligned flags say whether Q, K, V and dO (inputs) and dK and dV (outputs) keep every
// row 16-byte aligned. cudaErrorNotSupported when the pinned kernel cannot run here.
template <DType kDType, int kHeadDim>
cudaError_t RunFusedBackwardKernel(const FusedBackwardParams& params,
                                   const FusedBackwardWorkspace& work, bool aligned_inputs,
                                   bool aligned_outputs, cudaStream_t stream);

}  // namespace attn::cuda
