// Launching a kernel that takes more dynamic shared memory than the default 48 KiB.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace attn::cuda {

// Above 48 KiB a kernel must opt in to its dynamic shared memory; the attribute is per function
// and cheap to set again. An empty grid launches nothing.
template <typename... Params, typename... Args>
cudaError_t LaunchWithSharedMemory(void (*kernel)(Params...), dim3 grid, int threads,
                                   size_t smem_bytes, cudaStream_t stream, const Args&... args) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem_bytes));
  if (err != cudaSuccess) return err;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;
  kernel<<<grid, threads, smem_bytes, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace attn::cuda
