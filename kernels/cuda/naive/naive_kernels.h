// Device kernels of the naive path (host-callable launchers). The matrix products are cuBLAS
// calls made by the engine; these kernels fill the cuBLAS pointer arrays, turn scores into
// probabilities, and handle sequences that have no keys.
//
// A "run" is a set of consecutive sequences with equal query length lq and key length lk. Its
// (sequence, query head) score matrices are numbered m = b * num_heads + h (b relative to the
// run's first sequence), and a chunk is the range [m0, m0 + count) of them whose lq x lk float32
// score matrices sit in the workspace at s + (m - m0) * s_matrix_stride.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "attn/dtype.h"

namespace attn::cuda::naive {

struct ChunkGeometry {
  int64_t lq = 0, lk = 0;
  int64_t m0 = 0, count = 0;
  int num_heads = 0;
  int group_size = 1;           // query heads per KV head
  int64_t q_begin = 0;          // first query token of the run
  int64_t k_begin = 0;          // first key token of the run
  float* s = nullptr;           // scores, then probabilities in place (see LaunchSoftmaxRows)
  int64_t s_matrix_stride = 0;  // floats between consecutive score matrices
};

// The six pointer arrays of the two batched products, each `count` long:
//   S = K^T Q  (column-major):  a1 = K, b1 = Q, c1 = S
//   O^T = V^T P^T:              a2 = V, b2 = P, c2 = O
struct GemmPointers {
  const void** a1;
  const void** b1;
  void** c1;
  const void** a2;
  const void** b2;
  void** c2;
};

struct Operands {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int64_t q_token_stride, q_head_stride;
  int64_t k_token_stride, k_head_stride;
  int64_t v_token_stride, v_head_stride;
  int64_t o_token_stride, o_head_stride;
  int element_size;
};

absl::Status LaunchBuildPointers(const ChunkGeometry& g, const Operands& x, GemmPointers out,
                                 cudaStream_t stream);

// Row-wise softmax of the chunk's scores (already multiplied by the softmax scale), masked by
// VisibleKeys(window_left, window_right). Writes the probabilities as `p_dtype` over the
// scores in place: row i of a matrix starts at the same byte as its score row, so its leading
// dimension in p_dtype elements is lk * 4 / sizeof(p_dtype). Stores the LSE (natural log) at
// lse[h * total_q + token] when lse is not null; a row with no visible key gets P = 0 and
// LSE = -inf, and NaN scores propagate.
absl::Status LaunchSoftmaxRows(const ChunkGeometry& g, DType p_dtype, int window_left,
                               int window_right, float* lse, int64_t total_q, cudaStream_t stream);

// For query tokens [token_begin, token_begin + tokens) of sequences with no keys: O = 0 for all
// heads and LSE = -inf (when lse is not null).
absl::Status LaunchFillKeyless(void* o, int64_t o_token_stride, int64_t o_head_stride,
                               int64_t token_begin, int64_t tokens, int num_heads, int head_dim,
                               DType dtype, float* lse, int64_t total_q, cudaStream_t stream);

}  // namespace attn::cuda::naive
