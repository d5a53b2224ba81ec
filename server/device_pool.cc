#include "server/device_pool.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#if defined(ATTN_HAVE_CUDA)
#include <cuda_runtime.h>

#include "cuda/common/span_copy.h"
#endif

namespace attnserve {
namespace {

constexpr int64_t kAlignment = 256;
constexpr int64_t kMinCapacity = int64_t{1} << 20;

// When a batch's copies between page-locked host memory and the device go as one kernel whose
// threads read (write) the host memory instead of one DMA per copy: the copy engines pay a fixed
// cost per copy that outweighs the kernel's slower bandwidth below ~256 KiB, and at 1-4 requests
// the DMAs win (docs/server-performance.md has the measurements, bench/cuda/attn_copy_bench).
constexpr size_t kKernelCopyMinCount = 8;
constexpr int64_t kKernelCopyMaxAverageBytes = int64_t{256} << 10;

#if defined(ATTN_HAVE_CUDA)
absl::Status CudaCheck(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}
#endif

}  // namespace

absl::StatusOr<DeviceWait> ParseDeviceWait(absl::string_view name) {
  if (name == "spin") return DeviceWait::kSpin;
  if (name == "yield") return DeviceWait::kYield;
  if (name == "block") return DeviceWait::kBlock;
  return absl::InvalidArgumentError(
      absl::StrCat("--gpu_wait=", name, ": must be spin, yield or block"));
}

absl::StatusOr<std::unique_ptr<DevicePool>> DevicePool::Create(attn::MemorySpace space, int device,
                                                               int64_t limit_bytes,
                                                               DeviceWait wait) {
  std::unique_ptr<DevicePool> pool(new DevicePool(space, device, limit_bytes, wait));
  if (space == attn::MemorySpace::kDevice) {
#if defined(ATTN_HAVE_CUDA)
    if (auto s = CudaCheck(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
    cudaStream_t stream = nullptr;
    if (auto s = CudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                           "cudaStreamCreate");
        !s.ok()) {
      return s;
    }
    pool->stream_ = stream;
    int host_pointers = 0;
    if (auto s =
            CudaCheck(cudaDeviceGetAttribute(&host_pointers,
                                             cudaDevAttrCanUseHostPointerForRegisteredMem, device),
                      "cudaDeviceGetAttribute");
        !s.ok()) {
      return s;
    }
    pool->kernel_reads_host_pointers_ = host_pointers != 0;
    for (void** event : {&pool->compute_start_, &pool->compute_stop_}) {
      cudaEvent_t e = nullptr;
      if (auto s = CudaCheck(cudaEventCreate(&e), "cudaEventCreate"); !s.ok()) return s;
      *event = e;
    }
    if (wait != DeviceWait::kSpin) {
      const unsigned flags =
          cudaEventDisableTiming | (wait == DeviceWait::kBlock ? cudaEventBlockingSync : 0u);
      cudaEvent_t e = nullptr;
      if (auto s = CudaCheck(cudaEventCreateWithFlags(&e, flags), "cudaEventCreate"); !s.ok()) {
        return s;
      }
      pool->done_ = e;
    }
#else
    return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
  }
  return pool;
}

int64_t DevicePool::TotalMemoryBytes(attn::MemorySpace space, int device) {
  if (space == attn::MemorySpace::kHost) {
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page_size = sysconf(_SC_PAGESIZE);
    return pages > 0 && page_size > 0 ? int64_t{pages} * page_size : 0;
  }
#if defined(ATTN_HAVE_CUDA)
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    return static_cast<int64_t>(prop.totalGlobalMem);
  }
#endif
  return 0;
}

DevicePool::~DevicePool() {
  Release();
#if defined(ATTN_HAVE_CUDA)
  for (void* event : {compute_start_, compute_stop_, done_}) {
    if (event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
}

std::string DevicePool::label() const {
  return space_ == attn::MemorySpace::kDevice ? absl::StrCat("cuda:", device_ordinal_) : "cpu";
}

absl::Status DevicePool::StartComputeTimer() {
  if (space_ != attn::MemorySpace::kDevice) {
    host_start_ = absl::Now();
    return absl::OkStatus();
  }
#if defined(ATTN_HAVE_CUDA)
  return CudaCheck(
      cudaEventRecord(static_cast<cudaEvent_t>(compute_start_), static_cast<cudaStream_t>(stream_)),
      "cudaEventRecord");
#else
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

absl::Status DevicePool::StopComputeTimer() {
  if (space_ != attn::MemorySpace::kDevice) {
    host_stop_ = absl::Now();
    return absl::OkStatus();
  }
#if defined(ATTN_HAVE_CUDA)
  return CudaCheck(
      cudaEventRecord(static_cast<cudaEvent_t>(compute_stop_), static_cast<cudaStream_t>(stream_)),
      "cudaEventRecord");
#else
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

absl::StatusOr<absl::Duration> DevicePool::ComputeTime() const {
  if (space_ != attn::MemorySpace::kDevice) return host_stop_ - host_start_;
#if defined(ATTN_HAVE_CUDA)
  float ms = 0;
  if (auto s = CudaCheck(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(compute_start_),
                                              static_cast<cudaEvent_t>(compute_stop_)),
                         "cudaEventElapsedTime");
      !s.ok()) {
    return s;
  }
  return absl::Microseconds(static_cast<double>(ms) * 1000.0);
#else
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

absl::Status DevicePool::DeviceMemory(int64_t* used_bytes, int64_t* total_bytes) const {
  if (space_ != attn::MemorySpace::kDevice) {
    return absl::FailedPreconditionError("device pool: host pools have no device memory");
  }
#if defined(ATTN_HAVE_CUDA)
  size_t free = 0, total = 0;
  if (auto s = CudaCheck(cudaMemGetInfo(&free, &total), "cudaMemGetInfo"); !s.ok()) return s;
  *used_bytes = static_cast<int64_t>(total - free);
  *total_bytes = static_cast<int64_t>(total);
  return absl::OkStatus();
#else
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

void DevicePool::Release() {
  if (space_ == attn::MemorySpace::kDevice) {
#if defined(ATTN_HAVE_CUDA)
    if (host_ != nullptr) cudaFreeHost(host_);
    if (device_ != nullptr) cudaFree(device_);
#endif
  } else {
    std::free(host_);
  }
  host_ = nullptr;
  device_ = nullptr;
  capacity_ = 0;
}

absl::Status DevicePool::Reserve(int64_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  if (bytes > limit_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("device pool: a batch needs ", bytes, " bytes, the limit is ", limit_));
  }
  int64_t grown = std::max({bytes, 2 * capacity_, kMinCapacity});
  grown = std::min(grown, limit_);
  grown = (grown + kAlignment - 1) / kAlignment * kAlignment;

  if (space_ == attn::MemorySpace::kDevice) {
#if defined(ATTN_HAVE_CUDA)
    // Work still queued on the stream may read the old regions.
    if (auto s = Synchronize(); !s.ok()) return s;
    void* host = nullptr;
    void* device = nullptr;
    if (auto s = CudaCheck(cudaSetDevice(device_ordinal_), "cudaSetDevice"); !s.ok()) return s;
    if (auto s = CudaCheck(cudaHostAlloc(&host, grown, cudaHostAllocDefault), "cudaHostAlloc");
        !s.ok()) {
      return s;
    }
    if (auto s = CudaCheck(cudaMalloc(&device, grown), "cudaMalloc"); !s.ok()) {
      cudaFreeHost(host);
      return s;
    }
    Release();
    host_ = static_cast<std::byte*>(host);
    device_ = static_cast<std::byte*>(device);
#else
    return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
  } else {
    void* host = std::aligned_alloc(kAlignment, grown);
    if (host == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("device pool: cannot allocate ", grown, " bytes of host memory"));
    }
    Release();
    host_ = static_cast<std::byte*>(host);
  }
  capacity_ = grown;
  return absl::OkStatus();
}

absl::Status DevicePool::Activate() {
  if (space_ != attn::MemorySpace::kDevice) return absl::OkStatus();
#if defined(ATTN_HAVE_CUDA)
  return CudaCheck(cudaSetDevice(device_ordinal_), "cudaSetDevice");
#else
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

absl::Status DevicePool::CopyToDevice(int64_t offset, int64_t bytes) {
  if (space_ != attn::MemorySpace::kDevice || bytes == 0) return absl::OkStatus();
#if defined(ATTN_HAVE_CUDA)
  return CudaCheck(cudaMemcpyAsync(device_ + offset, host_ + offset, bytes, cudaMemcpyHostToDevice,
                                   static_cast<cudaStream_t>(stream_)),
                   "cudaMemcpyAsync(host to device)");
#else
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

absl::Status DevicePool::CopyFromRegion(const std::vector<RegionCopy>& copies) {
  if (copies.empty()) return absl::OkStatus();
  if (space_ != attn::MemorySpace::kDevice) {
    for (const RegionCopy& c : copies) {
      std::memcpy(c.dst, host_ + c.offset, static_cast<size_t>(c.bytes));
    }
    return absl::OkStatus();
  }
#if defined(ATTN_HAVE_CUDA)
  std::vector<attn::cuda::CopySpan> spans;
  spans.reserve(copies.size());
  for (const RegionCopy& c : copies) spans.push_back({device_ + c.offset, c.dst, c.bytes});
  return attn::cuda::CopySpansAsync(spans, static_cast<cudaStream_t>(stream_));
#else
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

absl::Status DevicePool::CopyToHost(int64_t offset, int64_t bytes) {
  if (space_ != attn::MemorySpace::kDevice || bytes == 0) return absl::OkStatus();
#if defined(ATTN_HAVE_CUDA)
  return CudaCheck(cudaMemcpyAsync(host_ + offset, device_ + offset, bytes, cudaMemcpyDeviceToHost,
                                   static_cast<cudaStream_t>(stream_)),
                   "cudaMemcpyAsync(device to host)");
#else
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

absl::Status DevicePool::CopyManyToDevice(const std::vector<HostCopy>& copies) {
  return CopyMany(copies, /*to_device=*/true);
}

absl::Status DevicePool::CopyManyToHost(const std::vector<HostCopy>& copies) {
  return CopyMany(copies, /*to_device=*/false);
}

absl::Status DevicePool::CopyMany(const std::vector<HostCopy>& copies, bool to_device) {
  if (copies.empty()) return absl::OkStatus();
#if defined(ATTN_HAVE_CUDA)
  if (space_ != attn::MemorySpace::kDevice) {
    return absl::InternalError("device pool: host-device copies on a host pool");
  }
  if (UseCopyKernel(copies)) {
    // Registered memory is mapped at the same address on the device (kernel_reads_host_pointers_).
    std::vector<attn::cuda::CopySpan> spans;
    spans.reserve(copies.size());
    for (const HostCopy& c : copies) {
      if (to_device) {
        spans.push_back({c.host, device_ + c.offset, c.bytes});
      } else {
        spans.push_back({device_ + c.offset, c.host, c.bytes});
      }
    }
    return attn::cuda::CopySpansAsync(spans, static_cast<cudaStream_t>(stream_));
  }
#if CUDART_VERSION >= 13000
  if (copies.size() > 1) {
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    for (const HostCopy& c : copies) {
      dsts.push_back(to_device ? static_cast<void*>(device_ + c.offset) : c.host);
      srcs.push_back(to_device ? static_cast<const void*>(c.host) : device_ + c.offset);
      sizes.push_back(static_cast<size_t>(c.bytes));
    }
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // after the stream's work
    size_t first_copy = 0;
    if (cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), copies.size(), &attributes,
                             &first_copy, 1, static_cast<cudaStream_t>(stream_)) == cudaSuccess) {
      return absl::OkStatus();
    }
    (void)cudaGetLastError();  // not taken (e.g. an older driver): one call per copy below
  }
#endif
  for (const HostCopy& c : copies) {
    if (c.bytes == 0) continue;
    std::byte* device = device_ + c.offset;
    const cudaError_t err = to_device
                                ? cudaMemcpyAsync(device, c.host, c.bytes, cudaMemcpyHostToDevice,
                                                  static_cast<cudaStream_t>(stream_))
                                : cudaMemcpyAsync(c.host, device, c.bytes, cudaMemcpyDeviceToHost,
                                                  static_cast<cudaStream_t>(stream_));
    if (auto s = CudaCheck(err, to_device ? "cudaMemcpyAsync(pinned host to device)"
                                          : "cudaMemcpyAsync(device to pinned host)");
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
#else
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

bool DevicePool::UseCopyKernel(const std::vector<HostCopy>& copies) const {
  if (!kernel_reads_host_pointers_ || copies.size() < kKernelCopyMinCount) return false;
  int64_t bytes = 0;
  for (const HostCopy& c : copies) bytes += c.bytes;
  return bytes <= kKernelCopyMaxAverageBytes * static_cast<int64_t>(copies.size());
}

absl::Status DevicePool::PinHostMemory(void* p, int64_t bytes) {
#if defined(ATTN_HAVE_CUDA)
  // Mapped too, so that CopyMany's kernel can read and write it.
  return CudaCheck(cudaHostRegister(p, static_cast<size_t>(bytes),
                                    cudaHostRegisterPortable | cudaHostRegisterMapped),
                   "cudaHostRegister");
#else
  (void)p;
  (void)bytes;
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

void DevicePool::UnpinHostMemory(void* p) {
#if defined(ATTN_HAVE_CUDA)
  cudaHostUnregister(p);
#else
  (void)p;
#endif
}

absl::Status DevicePool::Synchronize() {
  if (space_ != attn::MemorySpace::kDevice) return absl::OkStatus();
#if defined(ATTN_HAVE_CUDA)
  const auto stream = static_cast<cudaStream_t>(stream_);
  if (wait_ == DeviceWait::kSpin) {
    return CudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  const auto done = static_cast<cudaEvent_t>(done_);
  if (auto s = CudaCheck(cudaEventRecord(done, stream), "cudaEventRecord"); !s.ok()) return s;
  if (wait_ == DeviceWait::kBlock) {
    return CudaCheck(cudaEventSynchronize(done), "cudaEventSynchronize");
  }
  while (true) {
    const cudaError_t err = cudaEventQuery(done);
    if (err != cudaErrorNotReady) return CudaCheck(err, "cudaEventQuery");
    sched_yield();
  }
#else
  return absl::UnavailableError("device pool: this build has no CUDA support");
#endif
}

}  // namespace attnserve
