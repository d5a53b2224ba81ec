// The pages KV sessions keep their keys and values in: one allocation per device (device memory
// on a GPU server, host memory on the CPU) cut into fixed-size pages, and a free list. No
// allocation per append, and no fragmentation over long runs: every page is the same size, and
// a session's pages need not be contiguous (its block table names them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "attn/engine.h"

namespace attnserve {

class KvPagePool {
 public:
  // `bytes` rounded down to whole pages. RESOURCE_EXHAUSTED when the memory cannot be had.
  // `label` names the pool in metrics and Session.device ("cuda:N", "cpu").
  static absl::StatusOr<std::unique_ptr<KvPagePool>> Create(attn::MemorySpace space, int device,
                                                            int64_t page_bytes, int64_t bytes,
                                                            std::string label);
  ~KvPagePool();
  KvPagePool(const KvPagePool&) = delete;
  KvPagePool& operator=(const KvPagePool&) = delete;

  // `n` pages, or RESOURCE_EXHAUSTED saying how many were asked and how many are free; none are
  // taken then.
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t n);
  void Free(const std::vector<int32_t>& pages);

  std::byte* base() const { return base_; }  // page p at base() + p * page_bytes()
  int64_t page_bytes() const { return page_bytes_; }
  int64_t num_pages() const { return num_pages_; }
  int64_t free_pages() const;
  attn::MemorySpace space() const { return space_; }
  int device() const { return device_; }
  const std::string& label() const { return label_; }  // "cuda:N" or "cpu"

 private:
  KvPagePool(attn::MemorySpace space, int device, int64_t page_bytes, int64_t num_pages,
             std::byte* base, std::string label);

  const attn::MemorySpace space_;
  const int device_;
  const int64_t page_bytes_;
  const int64_t num_pages_;
  std::byte* const base_;
  const std::string label_;
  mutable absl::Mutex mu_;
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);  // a stack: recently freed pages go first
};

}  // namespace attnserve
