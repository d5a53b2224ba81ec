// Views of the tensors an engine reads and writes, and their validation against a problem.
//
// A view is a pointer plus strides (in elements) for the token and head dimensions of a
// [tokens, heads, head_dim] tensor whose last dimension is contiguous. Views do not own memory;
// the engine's memory_space() says whether the pointers are host or device addresses.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "attn/problem.h"

namespace attn {

template <typename Pointer>
struct BasicTensorRef {
  Pointer data = nullptr;
  int64_t token_stride = 0;  // elements between token t and t + 1
  int64_t head_stride = 0;   // elements between head h and h + 1

  int64_t offset(int64_t token, int64_t head) const {
    return token * token_stride + head * head_stride;
  }
};

using TensorRef = BasicTensorRef<const void*>;
using MutableTensorRef = BasicTensorRef<void*>;

// A densely packed [tokens, heads, head_dim] view.
template <typename Pointer>
BasicTensorRef<Pointer> Packed(Pointer data, int heads, int head_dim) {
  return {data, static_cast<int64_t>(heads) * head_dim, head_dim};
}

struct ForwardArgs {
  TensorRef q;             // [total_q, num_heads, head_dim]
  TensorRef k;             // [total_k, num_kv_heads, head_dim]
  TensorRef v;             // [total_k, num_kv_heads, head_dim]
  MutableTensorRef o;      // [total_q, num_heads, head_dim], problem dtype
  float* lse = nullptr;    // [num_heads, total_q]; may be null when the caller does not need it
  void* stream = nullptr;  // cudaStream_t for CUDA engines; ignored by CPU engines
};

struct BackwardArgs {
  TensorRef q, k, v;
  TensorRef o;                 // the forward output
  TensorRef d_o;               // gradient of the loss w.r.t. O, same shape as O
  const float* lse = nullptr;  // the forward log-sum-exp, [num_heads, total_q]; required
  MutableTensorRef dq;         // same shape as q
  MutableTensorRef dk;         // same shape as k (summed over the query heads of each KV head)
  MutableTensorRef dv;         // same shape as v
  void* stream = nullptr;
  // Bit-identical dQ, dK and dV from run to run (engines whose backward reduces partial sums in
  // an order that varies add them in a fixed order instead, at some cost in speed).
  bool deterministic = false;
};

// Checks one view: non-null when the tensor has elements, positive strides that keep rows of
// distinct (token, head) pairs from overlapping. `name` is used in the message.
absl::Status ValidateTensorRef(const char* name, const void* data, int64_t token_stride,
                               int64_t head_stride, int64_t tokens, int heads, int head_dim);

// ValidateProblem plus every view in the arguments.
absl::Status ValidateForward(const AttentionProblem& p, const ForwardArgs& a);
absl::Status ValidateBackward(const AttentionProblem& p, const BackwardArgs& a);

}  // namespace attn
