// The naive backward pass (used by the naive engine): recomputes S and P from the forward LSE and
// forms dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P * dP)) * scale, dQ = dS K, dK = dS^T Q
// with cuBLAS products per (sequence, query head) and small kernels between them; dK and dV are
// accumulated per query head in float32 and summed over each GQA group at the end.
#pragma once

#include <cublas_v2.h>

#include <cstdint>

#include "absl/status/status.h"
#include "attn/problem.h"
#include "attn/tensor.h"
#include "cuda/common/workspace_pool.h"

namespace attn::cuda {

struct NaiveBackwardWorkspace {
  int64_t min_bytes = 0;   // accumulators plus one (sequence, head) pair of score matrices
  int64_t full_bytes = 0;  // accumulators plus every score matrix of the largest run
};
NaiveBackwardWorkspace NaiveBackwardWorkspaceBytes(const AttentionProblem& p);

// Runs the backward pass on args.stream with workspace from `pool`, at most `limit_bytes`.
// RESOURCE_EXHAUSTED (naming the sizes) when even min_bytes does not fit.
absl::Status RunNaiveBackward(cublasHandle_t cublas, WorkspacePool& pool, int64_t limit_bytes,
                              const AttentionProblem& p, const BackwardArgs& args);

}  // namespace attn::cuda
