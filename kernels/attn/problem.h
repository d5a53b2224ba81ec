// The attention problem model shared by every engine, the server and the tests.
//
// Every batch is variable-length: sequences are packed token after token, and sequence b owns
// query tokens [cu_seqlens_q[b], cu_seqlens_q[b+1]) and key tokens [cu_seqlens_k[b],
// cu_seqlens_k[b+1]). A dense [batch, seqlen, heads, head_dim] tensor is the same memory with
// uniform lengths, so DenseProblem() only fills cu_seqlens.
//
// Tensors (see tensor.h) are indexed [token, head, dim] with strides in elements; the last
// dimension is contiguous. Q and O have num_heads heads, K and V num_kv_heads heads; query head
// h reads KV head h / (num_heads / num_kv_heads) (GQA/MQA). The log-sum-exp is float32, natural
// log, laid out [num_heads, total_q]. A query row that sees no key gets O = 0, LSE = -inf.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attn/dtype.h"
#include "attn/mask.h"

namespace attn {

inline constexpr int kMaxHeadDim = 256;

struct AttentionProblem {
  DType dtype = DType::kBF16;
  int num_heads = 1;
  int num_kv_heads = 1;
  int head_dim = 64;
  // Prefix sums of the per-sequence lengths; size batch + 1, starting at 0.
  std::vector<int32_t> cu_seqlens_q{0};
  std::vector<int32_t> cu_seqlens_k{0};
  // Scale applied to Q K^T; a value <= 0 means the default 1/sqrt(head_dim).
  float softmax_scale = 0.f;
  bool causal = false;
  // Sliding window sides in keys; negative = unbounded. Causal implies window_right = 0.
  int window_left = -1;
  int window_right = -1;

  int batch() const { return static_cast<int>(cu_seqlens_q.size()) - 1; }
  int64_t total_q() const { return cu_seqlens_q.empty() ? 0 : cu_seqlens_q.back(); }
  int64_t total_k() const { return cu_seqlens_k.empty() ? 0 : cu_seqlens_k.back(); }
  int64_t seqlen_q(int b) const { return cu_seqlens_q[b + 1] - cu_seqlens_q[b]; }
  int64_t seqlen_k(int b) const { return cu_seqlens_k[b + 1] - cu_seqlens_k[b]; }
  int64_t max_seqlen_q() const;
  int64_t max_seqlen_k() const;
  int group_size() const { return num_heads / num_kv_heads; }

  // The scale actually applied, resolving the default.
  float scale() const;
  // Window sides after folding in `causal` (what kernels should use).
  int effective_window_left() const { return window_left; }
  int effective_window_right() const { return causal ? 0 : window_right; }
  bool has_mask() const { return causal || window_left >= 0 || window_right >= 0; }
  // True when every sequence has the same query length and the same key length.
  bool is_uniform() const;

  KeyRange visible_keys(int b, int64_t row) const {
    return VisibleKeys(row, seqlen_q(b), seqlen_k(b), effective_window_left(),
                       effective_window_right());
  }

  // Number of (query, key) pairs that are visible, summed over sequences (one head).
  int64_t visible_pairs() const;
  // Forward FLOPs actually required: 4 * d * visible pairs * heads (two GEMMs).
  double forward_flops() const;

  std::string DebugString() const;
};

// A dense batch: `batch` sequences of seqlen_q queries and seqlen_k keys each.
AttentionProblem DenseProblem(DType dtype, int batch, int64_t seqlen_q, int64_t seqlen_k,
                              int num_heads, int num_kv_heads, int head_dim, bool causal = false);

// A variable-length batch from per-sequence lengths.
AttentionProblem VarlenProblem(DType dtype, const std::vector<int64_t>& seqlens_q,
                               const std::vector<int64_t>& seqlens_k, int num_heads,
                               int num_kv_heads, int head_dim, bool causal = false);

// Checks everything about the problem that does not involve tensors: head counts and ratio,
// head_dim range, cu_seqlens shape and monotonicity, window sides, scale. The message names the
// offending field.
absl::Status ValidateProblem(const AttentionProblem& p);

}  // namespace attn
