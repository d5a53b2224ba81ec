#include "cpu/host_engine.h"

#include <cstring>
#include <vector>

#include "attn/status_macros.h"

namespace attn::cpu {

absl::Status HostEngine::ForwardPaged(const AttentionProblem& p, const PagedForwardArgs& a) {
  ATTN_RETURN_IF_ERROR(ValidatePagedForward(p, a));
  const int64_t es = DTypeSize(p.dtype);
  const int64_t row = PagedKV::TokenStride(p);  // one token of every KV head, contiguous
  const int64_t row_bytes = row * es;
  std::vector<char> k(static_cast<size_t>(p.total_k() * row_bytes));
  std::vector<char> v(k.size());
  const char* pages = static_cast<const char*>(a.kv.pages);
  for (int b = 0; b < p.batch(); ++b) {
    for (int64_t t = 0; t < p.seqlen_k(b); ++t) {
      const int64_t page =
          a.kv.block_table[static_cast<int64_t>(b) * a.kv.max_blocks + t / a.kv.page_tokens];
      if (page < 0 || page >= a.kv.num_pages) {
        return absl::InvalidArgumentError("kv.block_table: a page index out of range");
      }
      const int64_t at = (page * a.kv.page_stride + (t % a.kv.page_tokens) * row) * es;
      const int64_t to = (p.cu_seqlens_k[b] + t) * row_bytes;
      std::memcpy(k.data() + to, pages + at, static_cast<size_t>(row_bytes));
      std::memcpy(v.data() + to, pages + at + a.kv.v_offset(p) * es,
                  static_cast<size_t>(row_bytes));
    }
  }
  ForwardArgs dense;
  dense.q = a.q;
  dense.k = Packed<const void*>(k.data(), p.num_kv_heads, p.head_dim);
  dense.v = Packed<const void*>(v.data(), p.num_kv_heads, p.head_dim);
  dense.o = a.o;
  dense.lse = a.lse;
  return Forward(p, dense);
}

}  // namespace attn::cpu
