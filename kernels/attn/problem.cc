#include "attn/problem.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attn {
namespace {

int64_t MaxGap(const std::vector<int32_t>& cu) {
  int64_t best = 0;
  for (size_t i = 1; i < cu.size(); ++i) best = std::max<int64_t>(best, cu[i] - cu[i - 1]);
  return best;
}

absl::Status ValidateCuSeqlens(const char* name, const std::vector<int32_t>& cu,
                               size_t expected_size) {
  if (cu.size() != expected_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": has ", cu.size(), " entries, expected batch + 1 = ", expected_size));
  }
  if (cu.empty() || cu[0] != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": must start at 0"));
  }
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": not non-decreasing at index ", i,
                                                     " (", cu[i - 1], " then ", cu[i], ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int64_t AttentionProblem::max_seqlen_q() const { return MaxGap(cu_seqlens_q); }
int64_t AttentionProblem::max_seqlen_k() const { return MaxGap(cu_seqlens_k); }

float AttentionProblem::scale() const {
  return softmax_scale > 0.f ? softmax_scale : 1.f / std::sqrt(static_cast<float>(head_dim));
}

bool AttentionProblem::is_uniform() const {
  for (int b = 1; b < batch(); ++b) {
    if (seqlen_q(b) != seqlen_q(0) || seqlen_k(b) != seqlen_k(0)) return false;
  }
  return true;
}

int64_t AttentionProblem::visible_pairs() const {
  int64_t pairs = 0;
  for (int b = 0; b < batch(); ++b) {
    const int64_t lq = seqlen_q(b);
    if (!has_mask()) {
      pairs += lq * seqlen_k(b);
      continue;
    }
    for (int64_t i = 0; i < lq; ++i) {
      const KeyRange r = visible_keys(b, i);
      if (r.end > r.begin) pairs += r.end - r.begin;
    }
  }
  return pairs;
}

double AttentionProblem::forward_flops() const {
  return 4.0 * head_dim * static_cast<double>(visible_pairs()) * num_heads;
}

std::string AttentionProblem::DebugString() const {
  return absl::StrCat("dtype=", std::string(DTypeName(dtype)), " heads=", num_heads, "/",
                      num_kv_heads, " head_dim=", head_dim, " batch=", batch(),
                      " total_q=", total_q(), " total_k=", total_k(), " causal=", causal,
                      " window=(", window_left, ",", window_right, ") scale=", scale());
}

AttentionProblem DenseProblem(DType dtype, int batch, int64_t seqlen_q, int64_t seqlen_k,
                              int num_heads, int num_kv_heads, int head_dim, bool causal) {
  return VarlenProblem(dtype, std::vector<int64_t>(batch, seqlen_q),
                       std::vector<int64_t>(batch, seqlen_k), num_heads, num_kv_heads, head_dim,
                       causal);
}

AttentionProblem VarlenProblem(DType dtype, const std::vector<int64_t>& seqlens_q,
                               const std::vector<int64_t>& seqlens_k, int num_heads,
                               int num_kv_heads, int head_dim, bool causal) {
  AttentionProblem p;
  p.dtype = dtype;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.causal = causal;
  p.cu_seqlens_q.assign(1, 0);
  p.cu_seqlens_k.assign(1, 0);
  for (int64_t l : seqlens_q)
    p.cu_seqlens_q.push_back(static_cast<int32_t>(p.cu_seqlens_q.back() + l));
  for (int64_t l : seqlens_k)
    p.cu_seqlens_k.push_back(static_cast<int32_t>(p.cu_seqlens_k.back() + l));
  return p;
}

absl::Status ValidateProblem(const AttentionProblem& p) {
  if (p.dtype != DType::kF32 && p.dtype != DType::kF16 && p.dtype != DType::kBF16) {
    return absl::InvalidArgumentError("dtype: must be float32, float16 or bfloat16");
  }
  if (p.num_heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_heads: must be >= 1, got ", p.num_heads));
  }
  if (p.num_kv_heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_heads: must be >= 1, got ", p.num_kv_heads));
  }
  if (p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_heads: ", p.num_heads, " is not a multiple of num_kv_heads ", p.num_kv_heads));
  }
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim: must be in [1, ", kMaxHeadDim, "], got ", p.head_dim));
  }
  if (p.cu_seqlens_q.size() < 2) {
    return absl::InvalidArgumentError("cu_seqlens_q: needs at least 2 entries (batch >= 1)");
  }
  if (auto s = ValidateCuSeqlens("cu_seqlens_q", p.cu_seqlens_q, p.cu_seqlens_q.size()); !s.ok()) {
    return s;
  }
  if (auto s = ValidateCuSeqlens("cu_seqlens_k", p.cu_seqlens_k, p.cu_seqlens_q.size()); !s.ok()) {
    return s;
  }
  if (!(std::isfinite(p.softmax_scale))) {
    return absl::InvalidArgumentError("softmax_scale: must be finite");
  }
  if (p.softmax_scale < 0.f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softmax_scale: must be > 0 (or 0 for 1/sqrt(head_dim)), got ", p.softmax_scale));
  }
  if (p.causal && p.window_right > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("window_right: causal attention needs window_right <= 0 (it is forced to "
                     "0), got ",
                     p.window_right));
  }
  return absl::OkStatus();
}

}  // namespace attn
