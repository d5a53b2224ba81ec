// Whether a kernel's sm_90a machine code can run on the current device: the Hopper kernels'
// launches ask before choosing them over the portable ones.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace attn::cuda {

// True when the current device runs sm_90a machine code of `kKernel`: a Hopper GPU and a build
// that included the sm_90a target (otherwise the kernel body is compiled out). Remembered per
// device ordinal.
template <auto kKernel>
bool Sm90aKernelUsable() {
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
        major == 9 && cudaFuncGetAttributes(&attributes, kKernel) == cudaSuccess &&
        attributes.binaryVersion == 90;
    known = yes ? 1 : -1;
    usable[device].store(known, std::memory_order_relaxed);
  }
  return known == 1;
}

}  // namespace attn::cuda
