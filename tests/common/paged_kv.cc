#include "common/paged_kv.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

namespace attn::testing {

PagedKvCopy PagedKvCopy::Make(const AttentionProblem& p, const HostTensor& k, const HostTensor& v,
                              int page_tokens, uint64_t seed, int spare_pages, int page_pad) {
  PagedKvCopy c;
  c.page_tokens_ = page_tokens;
  const int64_t row = PagedKV::TokenStride(p);
  c.page_stride_ = 2 * page_tokens * row + page_pad;
  std::vector<int64_t> blocks(p.batch());
  int64_t total_blocks = 0;
  for (int b = 0; b < p.batch(); ++b) {
    blocks[b] = (p.seqlen_k(b) + page_tokens - 1) / page_tokens;
    total_blocks += blocks[b];
    c.max_blocks_ = std::max(c.max_blocks_, static_cast<int>(blocks[b]));
  }
  c.max_blocks_ = std::max(c.max_blocks_, 1) + 1;  // a spare column, never read
  c.num_pages_ = total_blocks + spare_pages;
  std::vector<int32_t> order(static_cast<size_t>(c.num_pages_));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 random(seed);
  std::shuffle(order.begin(), order.end(), random);

  const int64_t es = DTypeSize(p.dtype);
  c.pool_.assign(static_cast<size_t>(c.num_pages_ * c.page_stride_ * es), 0);
  HostTensor poison(p.dtype, 1, 1, 1);
  poison.Poison();
  for (size_t i = 0; i < c.pool_.size(); i += es) {
    std::memcpy(&c.pool_[i], poison.data(), static_cast<size_t>(es));
  }
  c.block_table_.assign(static_cast<size_t>(p.batch()) * c.max_blocks_, -1);
  int64_t next = 0;
  const int64_t v_offset = page_tokens * row;
  for (int b = 0; b < p.batch(); ++b) {
    for (int64_t j = 0; j < blocks[b]; ++j) {
      const int32_t page = order[static_cast<size_t>(next++)];
      c.block_table_[static_cast<size_t>(b) * c.max_blocks_ + j] = page;
      for (int t = 0; t < page_tokens; ++t) {
        const int64_t token = j * page_tokens + t;
        if (token >= p.seqlen_k(b)) break;
        const int64_t src = p.cu_seqlens_k[b] + token;
        for (int h = 0; h < p.num_kv_heads; ++h) {
          for (int d = 0; d < p.head_dim; ++d) {
            const int64_t at = page * c.page_stride_ + t * row + h * p.head_dim + d;
            HostTensor one(p.dtype, 1, 1, 1);
            one.Set(0, 0, 0, k.Get(src, h, d));
            std::memcpy(&c.pool_[static_cast<size_t>(at * es)], one.data(),
                        static_cast<size_t>(es));
            one.Set(0, 0, 0, v.Get(src, h, d));
            std::memcpy(&c.pool_[static_cast<size_t>((at + v_offset) * es)], one.data(),
                        static_cast<size_t>(es));
          }
        }
      }
    }
  }
  return c;
}

PagedKV PagedKvCopy::view_at(const void* pages, const int32_t* block_table) const {
  PagedKV kv;
  kv.pages = pages;
  kv.page_stride = page_stride_;
  kv.page_tokens = page_tokens_;
  kv.num_pages = num_pages_;
  kv.block_table = block_table;
  kv.max_blocks = max_blocks_;
  return kv;
}

PagedKV PagedKvCopy::view() const { return view_at(pool_.data(), block_table_.data()); }

}  // namespace attn::testing
