// The naive CUDA attention path: S = scale * Q K^T materialised in device memory by a batched
// cuBLAS product (float32 accumulate and output), a row softmax kernel that applies the mask and
// writes P (in the storage dtype, over S) and the LSE, then O = P V by a second batched product.
// It covers the whole problem model and is the fused kernel's fallback and baseline. Backward:
// see naive_backward.h. Design and memory formula: docs/cuda-naive.md.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "attn/engine.h"

namespace attn::cuda {

// Workspace the naive path needs for a problem.
struct NaiveWorkspace {
  int64_t min_bytes = 0;   // the largest single (sequence, head) score matrix, plus bookkeeping
  int64_t full_bytes = 0;  // every score matrix of the largest run of equal-length sequences
};
NaiveWorkspace NaiveWorkspaceBytes(const AttentionProblem& p);

// Yes for every valid problem whose smallest workspace fits `workspace_limit_bytes`
// (EngineOptions); otherwise kInvalidProblem, or kTooLarge with RESOURCE_EXHAUSTED naming the
// sizes.
Support NaiveSupports(Pass pass, const AttentionProblem& p, int64_t workspace_limit_bytes);

// UNAVAILABLE when there is no usable device.
absl::StatusOr<std::unique_ptr<Engine>> MakeNaiveEngine(const EngineOptions& options);

}  // namespace attn::cuda
