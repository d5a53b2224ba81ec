// Per-row entry points of the fused backward's main kernel: one generated .cu per backward row
// of the table (capabilities.h) defines RunFusedBackwardKernel<dtype, head_dim>;
// fused_backward.cu calls it between the D kernel and the dQ kernel.
#pragma once

#include <cuda_runtime_api.h>

#include "attn/dtype.h"
#include "cuda/fused/fused_backward.h"

namespace attn::cuda {

// `delta` and `dq_accum` point into the workspace; the aligned flags say whether Q, K, V and dO
// (inputs) and dK and dV (outputs) keep every row 16-byte aligned.
template <DType kDType, int kHeadDim>
cudaError_t RunFusedBackwardKernel(const FusedBackwardParams& params, const float* delta,
                                   float* dq_accum, bool aligned_inputs, bool aligned_outputs,
                                   cudaStream_t stream);

}  // namespace attn::cuda
