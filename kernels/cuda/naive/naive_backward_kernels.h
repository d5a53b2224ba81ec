// Device kernels of the naive backward pass (host-callable launchers). The five matrix products
// are cuBLAS calls made by naive_backward.cc; these kernels fill the cuBLAS pointer arrays,
// recompute P from the forward LSE, form dS, and sum the per-query-head dK/dV accumulators over
// each GQA group. Chunks and runs are those of naive_kernels.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "attn/dtype.h"
#include "attn/mask.h"
#include "cuda/naive/naive_kernels.h"

namespace attn::cuda::naive {

// Where matrix i of a chunk starts, for one operand. For a tensor operand:
//   base + (token * token_stride + head * head_stride) * element_size
// where token is the first query (kQuery) or key (kKey) token of the matrix's sequence and head
// is its query head (kQueryHead) or KV head (kKvHead). For a workspace operand (kSlot):
//   base + i * slot_bytes.
struct OperandSpec {
  enum Token : int8_t { kQuery, kKey, kSlot };
  enum Head : int8_t { kQueryHead, kKvHead };
  const char* base = nullptr;
  Token token = kSlot;
  Head head = kQueryHead;
  int64_t token_stride = 0;  // elements (tensor operands)
  int64_t head_stride = 0;   // elements (tensor operands)
  int64_t element_size = 0;
  int64_t slot_bytes = 0;  // kSlot only
};

inline constexpr int kMaxOperands = 16;

struct OperandTable {
  OperandSpec spec[kMaxOperands];
  int count = 0;
};

// The address of operand `s` for matrix i of chunk g (host and device agree on it).
ATTN_HOST_DEVICE const char* OperandAddress(const OperandSpec& s, const ChunkGeometry& g,
                                            int64_t i) {
  if (s.token == OperandSpec::kSlot) return s.base + i * s.slot_bytes;
  const int64_t m = g.m0 + i;
  const int64_t b = m / g.num_heads;
  const int64_t h = m % g.num_heads;
  const int64_t head = s.head == OperandSpec::kKvHead ? h / g.group_size : h;
  const int64_t token =
      s.token == OperandSpec::kQuery ? g.q_begin + b * g.lq : g.k_begin + b * g.lk;
  return s.base + (token * s.token_stride + head * s.head_stride) * s.element_size;
}

// arrays[s * capacity + i] = OperandAddress(table.spec[s], g, i) for i < g.count.
absl::Status LaunchOperandPointers(const ChunkGeometry& g, const OperandTable& table, void** arrays,
                                   int64_t capacity, cudaStream_t stream);

// P = exp(S - LSE) over the visible keys (0 elsewhere), written as `dtype` over the float32
// scores in place (as LaunchSoftmaxRows does). lse is the forward's [num_heads, total_q].
absl::Status LaunchRecomputeProbs(const ChunkGeometry& g, DType dtype, int window_left,
                                  int window_right, const float* lse, int64_t total_q,
                                  cudaStream_t stream);

// dS = scale * P * (dP - rowsum(P * dP)), written as `dtype` over the float32 dP in place.
// p points at the chunk's P (dtype, leading dimension lk * 4 / sizeof(dtype), matrix stride
// g.s_matrix_stride floats); dp at its dP (float32, same geometry).
absl::Status LaunchScoreGradients(const ChunkGeometry& g, DType dtype, const float* p, float* dp,
                                  float scale, cudaStream_t stream);

// out[t, kv, c] = sum over the group's query heads h of acc[t, h, c] (acc packed float32
// [tokens, num_heads, head_dim]), rounded to dtype into a strided [tokens, num_kv_heads, d].
absl::Status LaunchReduceGroups(const float* acc, int64_t tokens, int num_heads, int num_kv_heads,
                                int head_dim, void* out, int64_t out_token_stride,
                                int64_t out_head_stride, DType dtype, cudaStream_t stream);

}  // namespace attn::cuda::naive
