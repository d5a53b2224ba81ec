#include "server/kv_page_pool.h"

#include <cstdlib>
#include <numeric>

#include "absl/strings/str_cat.h"

#if defined(ATTN_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace attnserve {

absl::StatusOr<std::unique_ptr<KvPagePool>> KvPagePool::Create(attn::MemorySpace space, int device,
                                                               int64_t page_bytes, int64_t bytes,
                                                               std::string label) {
  if (page_bytes < 256 || page_bytes % 256 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_page_bytes=", page_bytes, ": must be a positive multiple of 256"));
  }
  const int64_t num_pages = bytes / page_bytes;
  if (num_pages < 1 || num_pages > int64_t{1} << 31) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_pool_bytes=", bytes, ": holds ", num_pages,
                                                   " pages of ", page_bytes,
                                                   " bytes; needs 1 to 2^31"));
  }
  const int64_t total = num_pages * page_bytes;
  void* base = nullptr;
  if (space == attn::MemorySpace::kDevice) {
#if defined(ATTN_HAVE_CUDA)
    if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&base, total) != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat("kv pool: cannot allocate ", total,
                                                       " bytes of device memory on cuda:", device));
    }
#else
    return absl::UnavailableError("kv pool: this build has no CUDA support");
#endif
  } else {
    // Untouched pages stay virtual: the host pool costs what sessions fill.
    base = std::aligned_alloc(256, static_cast<size_t>(total));
    if (base == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("kv pool: cannot allocate ", total, " bytes of host memory"));
    }
  }
  return std::unique_ptr<KvPagePool>(new KvPagePool(
      space, device, page_bytes, num_pages, static_cast<std::byte*>(base), std::move(label)));
}

KvPagePool::KvPagePool(attn::MemorySpace space, int device, int64_t page_bytes, int64_t num_pages,
                       std::byte* base, std::string label)
    : space_(space),
      device_(device),
      page_bytes_(page_bytes),
      num_pages_(num_pages),
      base_(base),
      label_(std::move(label)) {
  free_.resize(static_cast<size_t>(num_pages));
  // Low pages on top of the stack: a fresh pool fills from its start.
  std::iota(free_.rbegin(), free_.rend(), 0);
}

KvPagePool::~KvPagePool() {
  if (space_ == attn::MemorySpace::kDevice) {
#if defined(ATTN_HAVE_CUDA)
    cudaSetDevice(device_);
    cudaFree(base_);
#endif
  } else {
    std::free(base_);
  }
}

absl::StatusOr<std::vector<int32_t>> KvPagePool::Allocate(int64_t n) {
  absl::MutexLock lock(&mu_);
  if (n > static_cast<int64_t>(free_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv pool (", label_, "): ", n * page_bytes_, " bytes asked (", n, " pages), ",
        static_cast<int64_t>(free_.size()) * page_bytes_, " free (", free_.size(), " pages of ",
        num_pages_, "); delete sessions or wait for idle ones to expire"));
  }
  std::vector<int32_t> pages(free_.end() - n, free_.end());
  free_.resize(free_.size() - static_cast<size_t>(n));
  return pages;
}

void KvPagePool::Free(const std::vector<int32_t>& pages) {
  absl::MutexLock lock(&mu_);
  free_.insert(free_.end(), pages.begin(), pages.end());
}

int64_t KvPagePool::free_pages() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(free_.size());
}

}  // namespace attnserve
