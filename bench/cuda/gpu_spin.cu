#include <cstdint>

#include "cuda/common/cuda_status.h"
#include "gpu_spin.h"

namespace attn::bench {
namespace {

__device__ __forceinline__ uint64_t GlobalNanoseconds() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(uint64_t nanoseconds) {
  const uint64_t start = GlobalNanoseconds();
  while (GlobalNanoseconds() - start < nanoseconds) {
  }
}

}  // namespace

absl::Status SpinGpu(double microseconds, cudaStream_t stream) {
  SpinKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(microseconds * 1e3));
  return cuda::LaunchStatus("bench SpinKernel");
}

}  // namespace attn::bench
