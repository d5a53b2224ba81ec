#include "cuda/common/workspace_pool.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attn::cuda {
namespace {

// Growth granularity: avoids re-allocating for every slightly larger request.
constexpr size_t kGranule = size_t{2} << 20;

}  // namespace

WorkspaceLease::WorkspaceLease(WorkspaceLease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      data_(other.data_),
      size_(other.size_),
      stream_(other.stream_) {}

WorkspaceLease::~WorkspaceLease() {
  if (pool_ != nullptr) pool_->Release(stream_);
}

absl::StatusOr<WorkspaceLease> WorkspacePool::Acquire(size_t bytes, cudaStream_t stream) {
  if (leased_) return absl::FailedPreconditionError("workspace pool: already leased");
  if (last_use_.get() == nullptr) {
    ATTN_ASSIGN_OR_RETURN(last_use_, CudaEvent::Create());
  }
  if (bytes > buffer_.size()) {
    // The old block may still be in use by earlier work: wait for it before freeing.
    if (used_) ATTN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(last_use_.get()));
    buffer_.Reset();
    const size_t rounded = (bytes + kGranule - 1) / kGranule * kGranule;
    auto buffer = DeviceBuffer::Allocate(rounded);
    if (!buffer.ok()) {
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return absl::ResourceExhaustedError(absl::StrCat(
          "workspace pool: cannot allocate ", rounded, " bytes of device workspace (device has ",
          free_bytes, " of ", total_bytes, " bytes free): ", buffer.status().message()));
    }
    buffer_ = *std::move(buffer);
  } else if (used_ && stream != last_stream_) {
    ATTN_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, last_use_.get(), 0));
  }
  leased_ = true;
  return WorkspaceLease(this, buffer_.get(), buffer_.size(), stream);
}

void WorkspacePool::Release(cudaStream_t stream) {
  leased_ = false;
  if (cudaEventRecord(last_use_.get(), stream) == cudaSuccess) {
    used_ = true;
    last_stream_ = stream;
  } else {
    // Without the event nothing orders later users after this work: drain it instead.
    cudaGetLastError();
    cudaStreamSynchronize(stream);
    used_ = false;
  }
}

absl::StatusOr<size_t> WorkspacePool::AvailableBytes() const {
  size_t free_bytes = 0, total_bytes = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  return free_bytes + buffer_.size();
}

}  // namespace attn::cuda
