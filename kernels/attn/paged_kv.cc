#include "attn/paged_kv.h"

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"

namespace attn {

absl::Status ValidatePagedForward(const AttentionProblem& p, const PagedForwardArgs& a) {
  ATTN_RETURN_IF_ERROR(ValidateProblem(p));
  ATTN_RETURN_IF_ERROR(ValidateTensorRef("q", a.q.data, a.q.token_stride, a.q.head_stride,
                                         p.total_q(), p.num_heads, p.head_dim));
  ATTN_RETURN_IF_ERROR(ValidateTensorRef("o", a.o.data, a.o.token_stride, a.o.head_stride,
                                         p.total_q(), p.num_heads, p.head_dim));
  const PagedKV& kv = a.kv;
  if (kv.page_tokens < 1 || (kv.page_tokens & (kv.page_tokens - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv.page_tokens: must be a power of two, got ", kv.page_tokens));
  }
  const int64_t block = kv.page_tokens * PagedKV::TokenStride(p);
  if (kv.page_stride < 2 * block) {
    return absl::InvalidArgumentError(absl::StrCat("kv.page_stride: ", kv.page_stride,
                                                   " elements cannot hold a K and a V block of ",
                                                   block, " elements"));
  }
  int64_t most_blocks = 0;
  for (int b = 0; b < p.batch(); ++b) {
    most_blocks = std::max(most_blocks, (p.seqlen_k(b) + kv.page_tokens - 1) / kv.page_tokens);
  }
  if (most_blocks > kv.max_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv.max_blocks: ", kv.max_blocks, " blocks per sequence, a sequence needs ", most_blocks));
  }
  if (p.total_k() > 0 && (kv.pages == nullptr || kv.block_table == nullptr || kv.num_pages < 1)) {
    return absl::InvalidArgumentError("kv: pages and block_table are required when keys exist");
  }
  return absl::OkStatus();
}

}  // namespace attn
