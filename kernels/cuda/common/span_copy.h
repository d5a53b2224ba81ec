// Many small copies as one kernel launch. A batch of small requests has dozens of host<->device
// copies; the copy engines pay a fixed cost per copy on top of the bytes
// (docs/server-performance.md), while one kernel whose threads load from (or store to)
// page-locked, device-mapped host memory moves them all at PCIe speed for one launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace attn::cuda {

struct CopySpan {
  const void* src;  // device memory, or a device pointer to mapped host memory
  void* dst;        // likewise
  int64_t bytes;
};

// Enqueues every span on `stream`; spans must not overlap each other's destinations. A span
// whose source and destination are 16-byte aligned moves 16 bytes per load (its ragged tail
// byte by byte); an unaligned one moves byte by byte (correct, slower). A failed launch
// returns its Status.
absl::Status CopySpansAsync(const std::vector<CopySpan>& spans, cudaStream_t stream);

// The device address of page-locked host memory `host` (cudaHostGetDevicePointer), for spans
// that read or write it; registered memory must have been mapped (cudaHostRegisterMapped).
absl::Status MappedDevicePointer(const void* host, void** device);

}  // namespace attn::cuda
