// Grid, shared-memory opt-in and launch of one fused-forward instantiation, and the choice
// between the Hopper (wgmma) kernel and the portable (mma.sync) one.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "cuda/fused/fused_forward_kernel.cuh"
#include "cuda/fused/fused_forward_launch.h"
#include "cuda/fused/fused_forward_sm90_kernel.cuh"
#include "cuda/fused/heuristics.h"

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

template <typename Kernel>
cudaError_t LaunchWithSmem(Kernel kernel, dim3 grid, int threads, int smem_bytes,
                           const FusedForwardParams& params, cudaStream_t stream) {
  // Above 48 KiB a kernel must opt in to its dynamic shared memory; the attribute is per
  // function and cheap to set again.
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  if (grid.x == 0) return cudaSuccess;
  kernel<<<grid, threads, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

template <typename Traits>
cudaError_t LaunchFusedForwardKernel(const FusedForwardParams& params, cudaStream_t stream) {
  const dim3 grid((params.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.num_heads,
                  params.batch);
  return LaunchWithSmem(&FusedForwardKernel<Traits>, grid, Traits::kThreads, Traits::kSmemBytes,
                        params, stream);
}

template <typename Traits>
cudaError_t LaunchFusedForwardSm90Kernel(const FusedForwardParams& params, cudaStream_t stream) {
  const dim3 grid((params.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.num_heads,
                  params.batch);
  return LaunchWithSmem(&FusedForwardSm90Kernel<Traits>, grid, Traits::kThreads, Traits::kSmemBytes,
                        params, stream);
}

// True when the current device runs sm_90a machine code of this kernel: a Hopper GPU and a
// build that included the sm_90a target (otherwise the kernel body is compiled out).
// Remembered per device ordinal.
template <typename Traits>
bool Sm90KernelUsable() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int8_t> usable[kMaxDevices] = {};  // 0 unknown, 1 yes, -1 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return false;
  int8_t known = usable[device].load(std::memory_order_relaxed);
  if (known == 0) {
    cudaFuncAttributes attributes{};
    int major = 0;
    const bool yes =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
        major == 9 &&
        cudaFuncGetAttributes(&attributes, &FusedForwardSm90Kernel<Traits>) == cudaSuccess &&
        attributes.binaryVersion == 90;
    known = yes ? 1 : -1;
    usable[device].store(known, std::memory_order_relaxed);
  }
  return known == 1;
}

template <DType kDType, int kHeadDim>
cudaError_t RunFusedForward(const FusedForwardParams& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  if constexpr (HasSm90FusedForward(kHeadDim)) {
    constexpr Sm90TileShape kShape = Sm90FusedTileShape(kHeadDim);
    using Sm90Traits =
        FusedForwardSm90Traits<Element, kHeadDim, kShape.block_n, kShape.ctas_per_sm>;
    if (params.kernel == FusedKernel::kAuto && Sm90KernelUsable<Sm90Traits>()) {
      return LaunchFusedForwardSm90Kernel<Sm90Traits>(params, stream);
    }
  }
  return LaunchFusedForwardKernel<FusedForwardTraits<Element, kHeadDim>>(params, stream);
}

}  // namespace attn::cuda
