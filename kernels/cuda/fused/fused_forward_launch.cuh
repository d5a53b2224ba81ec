// Grid and launch of one fused-forward instantiation, and the choice between the Hopper (wgmma)
// kernel and the portable (mma.sync) one. Included by the generated instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "cuda/common/element_convert.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/fused_forward_kernel.cuh"
#include "cuda/fused/fused_forward_launch.h"
#include "cuda/fused/fused_forward_sm90_kernel.cuh"
#include "cuda/fused/heuristics.h"

namespace attn::cuda {

// One CTA per (query block, head, sequence); see QueryBlock for the order blocks run in.
template <typename Traits>
cudaError_t LaunchQueryBlocks(void (*kernel)(FusedForwardParams), const FusedForwardParams& params,
                              cudaStream_t stream) {
  const dim3 grid((params.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.num_heads,
                  params.batch);
  return LaunchWithSharedMemory(kernel, grid, Traits::kThreads, Traits::kSmemBytes, stream, params);
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
  if constexpr (HasFusedKernel(Pass::kForward, kDType, kHeadDim, kSm90a)) {
    constexpr Sm90TileShape kShape = Sm90FusedTileShape(kHeadDim);
    using Sm90Traits =
        FusedForwardSm90Traits<Element, kHeadDim, kShape.block_n, kShape.ctas_per_sm>;
    if (params.kernel == FusedKernel::kAuto && Sm90KernelUsable<Sm90Traits>()) {
      return LaunchQueryBlocks<Sm90Traits>(&FusedForwardSm90Kernel<Sm90Traits>, params, stream);
    }
  }
  using Traits = FusedForwardTraits<Element, kHeadDim>;
  return LaunchQueryBlocks<Traits>(&FusedForwardKernel<Traits>, params, stream);
}

}  // namespace attn::cuda
