#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/common/cuda_status.h"
#include "fill_random.h"

namespace attn::bench {
namespace {

__device__ __forceinline__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Standard normal by Box-Muller from two hashed uniforms.
__device__ __forceinline__ float Normal(uint64_t seed, int64_t i) {
  const float u1 = (Hash(seed * 0x9e3779b97f4a7c15ull + 2 * i) + 1.f) * 2.3283064e-10f;
  const float u2 = Hash(seed * 0x9e3779b97f4a7c15ull + 2 * i + 1) * 2.3283064e-10f;
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

__global__ void FillKernel(void* data, int64_t n, DType dtype, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = Normal(seed, i);
    switch (dtype) {
      case DType::kF32:
        static_cast<float*>(data)[i] = x;
        break;
      case DType::kF16:
        static_cast<__half*>(data)[i] = __float2half_rn(x);
        break;
      case DType::kBF16:
        static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(x);
        break;
    }
  }
}

}  // namespace

absl::Status FillRandomNormal(void* data, int64_t elements, DType dtype, uint64_t seed,
                              cudaStream_t stream) {
  if (elements == 0) return absl::OkStatus();
  FillKernel<<<1024, 256, 0, stream>>>(data, elements, dtype, seed);
  return cuda::LaunchStatus("bench FillKernel");
}

}  // namespace attn::bench
