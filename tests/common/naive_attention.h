// A plain same-precision attention, the yardstick of the tolerance rule (see accuracy.h).
//
// It does what an unfused framework implementation in the problem's dtype does: every
// intermediate tensor is stored in the dtype, every matrix product accumulates in float32:
//   S = round(round(Q K^T) * scale);  P = round(softmax(S)) with the softmax in float32;
//   O = round(P V).
// Backward, with the same rounding at every stored tensor:
//   dV = round(P^T dO);  dP = round(dO V^T);  dS = round(round(P * (dP - rowsum(P * dP))) * scale);
//   dQ = round(dS K);  dK = round(dS^T Q)  (dK, dV summed over each GQA group in float32).
// For float32 problems "round" is the identity. Masks and empty rows follow the engines'
// semantics (O = 0, LSE = -inf, zero gradients). Results are float64 copies of the stored values.
#pragma once

#include <vector>

#include "attn/problem.h"
#include "common/host_tensor.h"

namespace attn::testing {

struct NaiveForwardResult {
  std::vector<double> o;    // packed [total_q][num_heads][head_dim]
  std::vector<double> lse;  // [num_heads][total_q], float32 softmax statistics
};

struct NaiveBackwardResult {
  std::vector<double> dq;  // packed [total_q][num_heads][head_dim]
  std::vector<double> dk;  // packed [total_k][num_kv_heads][head_dim]
  std::vector<double> dv;
};

NaiveForwardResult NaiveForward(const AttentionProblem& p, const HostTensor& q, const HostTensor& k,
                                const HostTensor& v);

NaiveBackwardResult NaiveBackward(const AttentionProblem& p, const HostTensor& q,
                                  const HostTensor& k, const HostTensor& v, const HostTensor& d_o);

}  // namespace attn::testing
