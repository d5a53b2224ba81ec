#include "cuda/common/cuda_status.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "cuda/common/device_buffer.h"

namespace attn::cuda {

absl::Status CudaStatus(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(std::string(what), ": ", cudaGetErrorName(error), " (",
                                           cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CublasStatus(cublasStatus_t status, std::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat(std::string(what), ": ", cublasGetStatusName(status),
                                           " (", cublasGetStatusString(status), ")");
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return absl::UnavailableError(message);
    case CUBLAS_STATUS_INVALID_VALUE:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status LaunchStatus(std::string_view kernel) {
  return CudaStatus(cudaGetLastError(), absl::StrCat("launch of ", std::string(kernel)));
}

absl::StatusOr<int> CountDevices() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: ", cudaGetErrorName(error),
                                               " (", cudaGetErrorString(error), ")"));
  }
  if (count == 0) return absl::UnavailableError("no usable CUDA device: none found");
  return count;
}

absl::Status CheckDevice(std::string_view engine, int device) {
  ATTN_ASSIGN_OR_RETURN(const int devices, CountDevices());
  if (device < 0 || device >= devices) {
    return absl::UnavailableError(absl::StrCat(std::string(engine), ": device ", device,
                                               " does not exist (", devices, " devices)"));
  }
  return absl::OkStatus();
}

}  // namespace attn::cuda
