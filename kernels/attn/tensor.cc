#include "attn/tensor.h"

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"

namespace attn {

absl::Status ValidateTensorRef(const char* name, const void* data, int64_t token_stride,
                               int64_t head_stride, int64_t tokens, int heads, int head_dim) {
  if (tokens == 0) return absl::OkStatus();
  if (data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": null data for ", tokens, " tokens"));
  }
  if (heads > 1 && head_stride < head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": head_stride ", head_stride, " is smaller than head_dim ", head_dim));
  }
  const int64_t row_extent = static_cast<int64_t>(heads - 1) * head_stride + head_dim;
  if (tokens > 1 && token_stride < row_extent) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": token_stride ", token_stride,
                     " overlaps the previous token's heads (needs >= ", row_extent, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateForward(const AttentionProblem& p, const ForwardArgs& a) {
  ATTN_RETURN_IF_ERROR(ValidateProblem(p));
  const int d = p.head_dim;
  ATTN_RETURN_IF_ERROR(ValidateTensorRef("q", a.q.data, a.q.token_stride, a.q.head_stride,
                                         p.total_q(), p.num_heads, d));
  ATTN_RETURN_IF_ERROR(ValidateTensorRef("k", a.k.data, a.k.token_stride, a.k.head_stride,
                                         p.total_k(), p.num_kv_heads, d));
  ATTN_RETURN_IF_ERROR(ValidateTensorRef("v", a.v.data, a.v.token_stride, a.v.head_stride,
                                         p.total_k(), p.num_kv_heads, d));
  ATTN_RETURN_IF_ERROR(ValidateTensorRef("o", a.o.data, a.o.token_stride, a.o.head_stride,
                                         p.total_q(), p.num_heads, d));
  return absl::OkStatus();
}

absl::Status ValidateBackward(const AttentionProblem& p, const BackwardArgs& a) {
  ATTN_RETURN_IF_ERROR(ValidateProblem(p));
  const int d = p.head_dim;
  const int64_t tq = p.total_q(), tk = p.total_k();
  const int hq = p.num_heads, hk = p.num_kv_heads;
  ATTN_RETURN_IF_ERROR(
      ValidateTensorRef("q", a.q.data, a.q.token_stride, a.q.head_stride, tq, hq, d));
  ATTN_RETURN_IF_ERROR(
      ValidateTensorRef("k", a.k.data, a.k.token_stride, a.k.head_stride, tk, hk, d));
  ATTN_RETURN_IF_ERROR(
      ValidateTensorRef("v", a.v.data, a.v.token_stride, a.v.head_stride, tk, hk, d));
  ATTN_RETURN_IF_ERROR(
      ValidateTensorRef("o", a.o.data, a.o.token_stride, a.o.head_stride, tq, hq, d));
  ATTN_RETURN_IF_ERROR(
      ValidateTensorRef("d_o", a.d_o.data, a.d_o.token_stride, a.d_o.head_stride, tq, hq, d));
  ATTN_RETURN_IF_ERROR(
      ValidateTensorRef("dq", a.dq.data, a.dq.token_stride, a.dq.head_stride, tq, hq, d));
  ATTN_RETURN_IF_ERROR(
      ValidateTensorRef("dk", a.dk.data, a.dk.token_stride, a.dk.head_stride, tk, hk, d));
  ATTN_RETURN_IF_ERROR(
      ValidateTensorRef("dv", a.dv.data, a.dv.token_stride, a.dv.head_stride, tk, hk, d));
  if (tq > 0 && a.lse == nullptr) {
    return absl::InvalidArgumentError("lse: the backward pass needs the forward log-sum-exp");
  }
  return absl::OkStatus();
}

}  // namespace attn
