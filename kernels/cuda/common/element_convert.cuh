// The element types the CUDA kernels store, and conversions between them and float for device
// code: round to nearest even on the way down.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attn/dtype.h"

namespace attn::cuda {

// The CUDA type of a DType's elements.
template <DType kDType>
struct ElementOf;
template <>
struct ElementOf<DType::kF32> {
  using type = float;
};
template <>
struct ElementOf<DType::kF16> {
  using type = __half;
};
template <>
struct ElementOf<DType::kBF16> {
  using type = __nv_bfloat16;
};

template <typename T>
__device__ __forceinline__ float ToFloat(T x);
template <>
__device__ __forceinline__ float ToFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float ToFloat<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

}  // namespace attn::cuda
