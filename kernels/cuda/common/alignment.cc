#include "cuda/common/alignment.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attn::cuda {
namespace {

absl::Status CheckView(const char* name, const void* data, int64_t token_stride,
                       int64_t head_stride, int64_t tokens, int heads, int64_t element_bytes) {
  if (tokens == 0) return absl::OkStatus();
  if (!IsAligned16(data)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": data is not ", kVectorBytes, "-byte aligned"));
  }
  if (tokens > 1 && !StrideAligned16(token_stride, element_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": token_stride ", token_stride,
                                                   " elements is not a multiple of ", kVectorBytes,
                                                   " bytes"));
  }
  if (heads > 1 && !StrideAligned16(head_stride, element_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": head_stride ", head_stride,
                                                   " elements is not a multiple of ", kVectorBytes,
                                                   " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

Support CheckRowsAligned16(const AttentionProblem& p, const ForwardArgs& a) {
  const int64_t es = DTypeSize(p.dtype);
  const int64_t tq = p.total_q(), tk = p.total_k();
  for (absl::Status s :
       {CheckView("q", a.q.data, a.q.token_stride, a.q.head_stride, tq, p.num_heads, es),
        CheckView("k", a.k.data, a.k.token_stride, a.k.head_stride, tk, p.num_kv_heads, es),
        CheckView("v", a.v.data, a.v.token_stride, a.v.head_stride, tk, p.num_kv_heads, es),
        CheckView("o", a.o.data, a.o.token_stride, a.o.head_stride, tq, p.num_heads, es)}) {
    if (!s.ok()) return Support(Refusal::kUnaligned, std::move(s));
  }
  return Support();
}

}  // namespace attn::cuda
