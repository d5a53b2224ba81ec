// Grid and launch of one instantiation of the fused backward's main kernel. Included by the
// generated instantiation files.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/element_convert.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/fused/fused_backward_kernel.cuh"
#include "cuda/fused/fused_backward_launch.h"

namespace attn::cuda {

template <DType kDType, int kHeadDim>
cudaError_t RunFusedBackwardKernel(const FusedBackwardParams& params, const float* delta,
                                   float* dq_accum, bool aligned_inputs, bool aligned_outputs,
                                   cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  using backward::kBlockK;
  const dim3 grid(static_cast<unsigned>((params.max_seqlen_k + kBlockK - 1) / kBlockK),
                  static_cast<unsigned>(params.num_kv_heads), static_cast<unsigned>(params.batch));
  return LaunchWithSharedMemory(&backward::BackwardKernel<T, kHeadDim>, grid, backward::kThreads,
                                sizeof(backward::SharedTiles<T, kHeadDim>), stream, params, delta,
                                dq_accum, aligned_inputs, aligned_outputs);
}

}  // namespace attn::cuda
