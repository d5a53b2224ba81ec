// The 16-byte rule of the CUDA kernels' vector access: the fused kernels move tiles in 16-byte
// chunks, and cuBLAS's batched products need every matrix 16-byte aligned. A view keeps every
// row 16-byte aligned when its base pointer and the strides between its rows are.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "attn/engine.h"
#include "attn/problem.h"
#include "attn/tensor.h"

namespace attn::cuda {

inline constexpr int64_t kVectorBytes = 16;

inline bool IsAligned16(const void* data) {
  return reinterpret_cast<uintptr_t>(data) % kVectorBytes == 0;
}

// True when a stride of `stride` elements of `element_bytes` each moves by whole 16 bytes.
inline bool StrideAligned16(int64_t stride, int64_t element_bytes) {
  return (stride * element_bytes) % kVectorBytes == 0;
}

// Every row of a [tokens, heads, head_dim] view starts 16-byte aligned, whatever its extent.
inline bool RowsAligned16(const void* data, int64_t token_stride, int64_t head_stride,
                          int64_t element_bytes) {
  return IsAligned16(data) && StrideAligned16(token_stride, element_bytes) &&
         StrideAligned16(head_stride, element_bytes);
}

// The rule for Q, K, V and O of a forward call, where it matters: a stride is checked only when
// there is more than one token (head) to step over. Otherwise a kUnaligned refusal with
// INVALID_ARGUMENT naming the tensor and the field: what the fused engine would answer if its
// Supports saw the tensors.
Support CheckRowsAligned16(const AttentionProblem& p, const ForwardArgs& args);

}  // namespace attn::cuda
