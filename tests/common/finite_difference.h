// Finite-difference checks of a backward pass that use no analytic gradient: the loss
// L(Q, K, V) = sum(O(Q, K, V) * G), G = dO, is evaluated in float64 by a plain forward of its own
// at the exact stored (16-bit) inputs, differentiated numerically along random directions R,
// and compared with <dX, R> for an engine's gradients dX. The tolerance (finite_difference.cc
// derives it) models a backward that rounds P, dS and its outputs to a 16-bit dtype and
// accumulates in float32, as the fused kernels do; it does not cover float32 problems.
//
//   AttentionTensors t = ...;  // inputs, O and the LSE from a forward, the engine's dq, dk, dv
//   const FiniteDifferenceCheck check(p, LossPointOf(t), seed);
//   EXPECT_TRUE(check.Verify(GradientsOf(t)).ok());
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attn/problem.h"
#include "common/host_tensor.h"
#include "common/sweep.h"

namespace attn::testing {

// Float64 copies of Q, K, V and G = dO, packed [tokens][heads][head_dim].
struct LossPoint {
  std::vector<double> q, k, v, g;
};
LossPoint LossPointOf(const AttentionTensors& t);

// sum(O * G) with O the float64 attention of (x.q, x.k, x.v) under p's masks (rows that see no
// key: O = 0).
double AttentionLoss(const AttentionProblem& p, const LossPoint& x);

// An engine's dQ, dK, dV (float64 copies of the stored values), packed as LossPoint.
struct Gradients {
  std::vector<double> dq, dk, dv;
};
Gradients GradientsOf(const AttentionTensors& t);

// One directional derivative: the central difference against <dX, R>.
struct DirectionalCheck {
  std::string what;      // "dK along direction 1"
  double numeric = 0;    // (L(X + eps R) - L(X - eps R)) / (2 eps)
  double analytic = 0;   // <dX, R>
  double rounding = 0;   // u |dX * R|_2: the RMS the model expects of numeric - analytic
  double fd_error = 0;   // |central difference at 2 eps - at eps|: the step's own error, bounded
  double tolerance = 0;  // kFiniteDifferenceSigmas * rounding + fd_error + a floor
  bool ok() const;
  std::string ToString() const;
};

// Half the distance from 1 to the next value of the dtype: 2^-11 float16, 2^-8 bfloat16.
double UnitRoundoff(DType t);

// How many model RMS the error may reach (finite_difference.cc says why).
inline constexpr double kFiniteDifferenceSigmas = 8.0;

// Central differences of the loss at x along `directions` random directions per input
// (normal(0, 1) entries from `seed`), computed once; any number of gradients are then checked
// against them. p.dtype must be float16 or bfloat16 (it sets the unit roundoff).
class FiniteDifferenceCheck {
 public:
  FiniteDifferenceCheck(const AttentionProblem& p, LossPoint x, uint64_t seed, int directions = 2);

  std::vector<DirectionalCheck> Check(const Gradients& grads) const;
  // OK, or an error listing every check that failed.
  absl::Status Verify(const Gradients& grads) const;

 private:
  struct Direction {
    int input;  // 0, 1, 2: Q, K, V
    int index;
    std::vector<double> r;
    double numeric, fd_error;
  };
  AttentionProblem p_;
  std::vector<Direction> directions_;
};

// The problems the finite-difference tests run, CPU and GPU alike: 37 and 130 queries and keys
// (tails of the kernels' 64- and 128-row tiles), head_dim 32, 64, 96, 128, causal, windowed and
// not, GQA 2, dense and variable-length batches, float16 and bfloat16.
std::vector<SweepCase> FiniteDifferenceCases();

}  // namespace attn::testing
