// A reusable block of device workspace that grows on demand and is kept between calls, so the
// hot path performs no cudaMalloc once warmed up.
//
// Usage: `ATTN_ASSIGN_OR_RETURN(WorkspaceLease lease, pool.Acquire(bytes, stream));`, enqueue the
// work that uses lease.data() on `stream`, and let the lease go out of scope: it records an event
// on the stream, and a later Acquire on another stream makes that stream wait for the event, so
// work on two streams never shares the memory at the same time. Not thread-safe (engines are
// not), one pool per device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "cuda/common/device_buffer.h"

namespace attn::cuda {

class WorkspacePool;

// Use of the pool's memory by the work enqueued on one stream; see WorkspacePool.
class WorkspaceLease {
 public:
  WorkspaceLease(WorkspaceLease&& other) noexcept;
  WorkspaceLease& operator=(WorkspaceLease&&) = delete;
  WorkspaceLease(const WorkspaceLease&) = delete;
  WorkspaceLease& operator=(const WorkspaceLease&) = delete;
  ~WorkspaceLease();

  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  friend class WorkspacePool;
  WorkspaceLease(WorkspacePool* pool, void* data, size_t size, cudaStream_t stream)
      : pool_(pool), data_(data), size_(size), stream_(stream) {}

  WorkspacePool* pool_;
  void* data_;
  size_t size_;
  cudaStream_t stream_;
};

class WorkspacePool {
 public:
  WorkspacePool() = default;
  WorkspacePool(const WorkspacePool&) = delete;
  WorkspacePool& operator=(const WorkspacePool&) = delete;

  // At least `bytes` of device memory (256-byte aligned) for work on `stream`. Growing frees the
  // old block once the work that used it has finished; RESOURCE_EXHAUSTED when the device cannot
  // hold the new size. Only one lease may be live at a time.
  absl::StatusOr<WorkspaceLease> Acquire(size_t bytes, cudaStream_t stream);

  // Bytes the pool could hold now: what it holds plus the device's free memory.
  absl::StatusOr<size_t> AvailableBytes() const;

  size_t capacity() const { return buffer_.size(); }

 private:
  friend class WorkspaceLease;
  void Release(cudaStream_t stream);

  DeviceBuffer buffer_;
  CudaEvent last_use_;  // recorded on last_stream_ when the last lease ended
  cudaStream_t last_stream_ = nullptr;
  bool used_ = false;  // last_use_ has been recorded at least once
  bool leased_ = false;
};

}  // namespace attn::cuda
