// Grid, shared-memory opt-in and launch of one fused-forward instantiation.
#pragma once

#include <cuda_runtime.h>

#include "cuda/fused/fused_forward_kernel.cuh"
#include "cuda/fused/fused_forward_launch.h"

namespace attn::cuda {

template <DType kDType>
struct ElementOf;
template <>
struct ElementOf<DType::kF16> {
  using type = __half;
};
template <>
struct ElementOf<DType::kBF16> {
  using type = __nv_bfloat16;
};

template <typename Traits>
cudaError_t LaunchFusedForwardKernel(const FusedForwardParams& params, cudaStream_t stream) {
  const auto kernel = &FusedForwardKernel<Traits>;
  // Above 48 KiB a kernel must opt in to its dynamic shared memory; the attribute is per
  // function and cheap to set again.
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((params.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.num_heads,
                  params.batch);
  if (grid.x == 0) return cudaSuccess;
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

template <DType kDType, int kHeadDim>
cudaError_t RunFusedForward(const FusedForwardParams& params, cudaStream_t stream) {
  return LaunchFusedForwardKernel<FusedForwardTraits<typename ElementOf<kDType>::type, kHeadDim>>(
      params, stream);
}

}  // namespace attn::cuda
