// A problem's K and V scattered into pages, as KV sessions hold them (attn/paged_kv.h): every
// sequence's blocks land in pages picked by a seeded shuffle, so neighbouring blocks are never
// neighbouring pages, and the pages nobody uses are poisoned. CUDA tests copy pool() and
// block_table() to the device and point a PagedKV at the copies.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/paged_kv.h"
#include "attn/problem.h"
#include "common/host_tensor.h"

namespace attn::testing {

class PagedKvCopy {
 public:
  // `spare_pages` unused pages are mixed in; `page_pad` extra elements end every page.
  static PagedKvCopy Make(const AttentionProblem& p, const HostTensor& k, const HostTensor& v,
                          int page_tokens, uint64_t seed, int spare_pages = 3, int page_pad = 8);

  // A view of the host copy.
  PagedKV view() const;
  // The same geometry over other memory (a device copy of pool() and block_table()).
  PagedKV view_at(const void* pages, const int32_t* block_table) const;

  const std::vector<uint8_t>& pool() const { return pool_; }
  const std::vector<int32_t>& block_table() const { return block_table_; }

 private:
  std::vector<uint8_t> pool_;
  std::vector<int32_t> block_table_;
  int64_t page_stride_ = 0;
  int page_tokens_ = 0;
  int64_t num_pages_ = 0;
  int max_blocks_ = 0;
};

}  // namespace attn::testing
