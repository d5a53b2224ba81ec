// Runs the float64 reference engine (EngineKind::kCpuReference) on a problem's inputs and returns
// its results as float64, for comparing any engine against.
//
// The inputs are converted (exactly) to float32 and the reference runs on a float32 copy of the
// problem, so its float64 results are only rounded to float32 on the way out, not to the
// problem's dtype: the comparison sees the true error of a low-precision engine.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "attn/problem.h"
#include "common/host_tensor.h"

namespace attn::testing {

struct ReferenceResults {
  std::vector<double> o, lse;  // o packed [total_q][num_heads][head_dim]; lse [num_heads][total_q]
  std::vector<double> dq, dk, dv;  // empty unless the backward was requested
};

absl::StatusOr<ReferenceResults> RunReference(const AttentionProblem& p, const AttentionTensors& t,
                                              bool backward);

}  // namespace attn::testing
