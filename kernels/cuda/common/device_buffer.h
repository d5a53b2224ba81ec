// RAII owners of device memory and CUDA events, and small stream/device helpers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string_view>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cuda/common/cuda_status.h"

namespace attn::cuda {

// The opaque stream of ForwardArgs/BackwardArgs as what it is.
inline cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Device memory freed on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  // RESOURCE_EXHAUSTED (naming the size) when the device cannot hold `bytes` more.
  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) {
    DeviceBuffer buffer;
    if (bytes == 0) return buffer;
    const cudaError_t error = cudaMalloc(&buffer.data_, bytes);
    if (error != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky; clear it
      buffer.data_ = nullptr;
      return CudaStatus(error, absl::StrCat("cudaMalloc of ", bytes, " bytes"));
    }
    buffer.bytes_ = bytes;
    return buffer;
  }

  void* get() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return bytes_; }

  void Reset() {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A CUDA event (timing disabled unless asked for), destroyed with its owner. Move-only.
class CudaEvent {
 public:
  CudaEvent() = default;
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& other) noexcept {
    if (this != &other) {
      if (event_ != nullptr) cudaEventDestroy(event_);
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  static absl::StatusOr<CudaEvent> Create(bool timing = false) {
    CudaEvent e;
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&e.event_, timing ? cudaEventDefault : cudaEventDisableTiming));
    return e;
  }

  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Makes `device` current for the scope and restores the previous device after.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) status_ = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  // Whether the switch worked.
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

// Number of usable devices; UNAVAILABLE (with CUDA's reason) when there are none.
absl::StatusOr<int> CountDevices();

// OK when `device` is a usable ordinal; otherwise UNAVAILABLE naming `engine` (what an engine's
// factory returns without a device).
absl::Status CheckDevice(std::string_view engine, int device);

}  // namespace attn::cuda
