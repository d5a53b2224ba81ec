// CUDA and cuBLAS return codes as absl::Status, and early-return macros for them. Every CUDA
// call in the engines goes through these: a failure becomes a Status, never an abort.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string_view>

#include "absl/status/status.h"
#include "attn/status_macros.h"

namespace attn::cuda {

// OK for cudaSuccess. Out-of-memory becomes RESOURCE_EXHAUSTED, a missing device or driver
// UNAVAILABLE, anything else INTERNAL; the message names `what` and the CUDA error.
absl::Status CudaStatus(cudaError_t error, std::string_view what);

// The same for cuBLAS status codes.
absl::Status CublasStatus(cublasStatus_t status, std::string_view what);

// The error state after a kernel launch (cudaGetLastError), as a Status naming the kernel.
absl::Status LaunchStatus(std::string_view kernel);

}  // namespace attn::cuda

#define ATTN_CUDA_RETURN_IF_ERROR(expr) \
  ATTN_RETURN_IF_ERROR(::attn::cuda::CudaStatus((expr), #expr))
#define ATTN_CUBLAS_RETURN_IF_ERROR(expr) \
  ATTN_RETURN_IF_ERROR(::attn::cuda::CublasStatus((expr), #expr))
