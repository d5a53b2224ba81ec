// The finite-difference harness of the GPU backward tests (common/finite_difference.h) proved on
// the CPU: the CPU engines' backwards pass it, so does a float64 model of the fused kernels'
// rounding (P, dS, O and the outputs in the dtype), which the tolerance was derived for, and
// wrong gradients fail it.
#include "common/finite_difference.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "common/host_tensor.h"
#include "gtest/gtest.h"

namespace attn::testing {
namespace {

double Round(double x, DType t) { return RoundToDType(static_cast<float>(x), t); }

// The fused kernels' backward in float64 with their roundings: P from the forward's float32 LSE,
// P and dS = P (dP - D) rounded to the dtype as the MMAs read them, D = rowsum(dO * O) from the
// stored O, and dQ, dK, dV rounded once at the end. With `with_delta` false D is left out (a
// backward whose D pass never ran).
Gradients KernelRoundingBackward(const AttentionProblem& p, const AttentionTensors& t,
                                 bool with_delta = true) {
  const int d = p.head_dim, hq = p.num_heads, hk = p.num_kv_heads, group = p.group_size();
  const double scale = p.scale();
  const LossPoint x = LossPointOf(t);
  const std::vector<double> o = t.o.ToDouble();
  Gradients g{std::vector<double>(x.q.size()), std::vector<double>(x.k.size()),
              std::vector<double>(x.v.size())};
  for (int b = 0; b < p.batch(); ++b) {
    const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    for (int h = 0; h < hq; ++h) {
      const int kvh = h / group;
      for (int64_t i = 0; i < p.seqlen_q(b); ++i) {
        const KeyRange r = p.visible_keys(b, i);
        const int64_t qi = ((q0 + i) * hq + h) * d;
        double delta = 0;
        for (int c = 0; c < d && with_delta; ++c) delta += x.g[qi + c] * o[qi + c];
        const double lse = t.lse[h * p.total_q() + q0 + i];
        for (int64_t j = r.begin; j < r.end; ++j) {
          const int64_t kj = ((k0 + j) * hk + kvh) * d;
          double s = 0, dp = 0;
          for (int c = 0; c < d; ++c) {
            s += x.q[qi + c] * x.k[kj + c];
            dp += x.g[qi + c] * x.v[kj + c];
          }
          const double prob = std::exp(scale * s - lse);
          const double p16 = Round(prob, p.dtype);
          const double ds16 = Round(prob * (dp - delta), p.dtype);
          for (int c = 0; c < d; ++c) {
            g.dv[kj + c] += p16 * x.g[qi + c];
            g.dk[kj + c] += scale * ds16 * x.q[qi + c];
            g.dq[qi + c] += scale * ds16 * x.k[kj + c];
          }
        }
      }
    }
  }
  for (std::vector<double>* v : {&g.dq, &g.dk, &g.dv}) {
    for (double& e : *v) e = Round(e, p.dtype);
  }
  return g;
}

class FiniteDifferenceHarnessTest : public ::testing::TestWithParam<SweepCase> {
 protected:
  void SetUp() override {
    seed_ = FreshSeed();
    trace_ = absl::StrCat("seed=", seed_, " (replay with ATTN_TEST_SEED) ",
                          GetParam().problem.DebugString());
    t_ = AttentionTensors::Make(GetParam().problem, seed_);
    // O and the LSE as a forward pass in the problem's dtype leaves them.
    auto reference = CreateEngine(EngineKind::kCpuReference);
    ASSERT_TRUE(reference.ok()) << reference.status();
    ASSERT_TRUE((*reference)->Forward(GetParam().problem, t_.forward_args()).ok());
    check_ = std::make_unique<FiniteDifferenceCheck>(GetParam().problem, LossPointOf(t_), seed_);
  }

  uint64_t seed_ = 0;
  std::string trace_;
  AttentionTensors t_;
  std::unique_ptr<FiniteDifferenceCheck> check_;
};

TEST_P(FiniteDifferenceHarnessTest, CpuBackwardsPass) {
  SCOPED_TRACE(trace_);
  const AttentionProblem& p = GetParam().problem;
  for (EngineKind kind : {EngineKind::kCpuTiled, EngineKind::kCpuReference}) {
    SCOPED_TRACE(std::string(EngineKindName(kind)));
    auto engine = CreateEngine(kind);
    ASSERT_TRUE(engine.ok()) << engine.status();
    ASSERT_TRUE((*engine)->Backward(p, t_.backward_args()).ok());
    const absl::Status verdict = check_->Verify(GradientsOf(t_));
    EXPECT_TRUE(verdict.ok()) << verdict.message();
  }
}

TEST_P(FiniteDifferenceHarnessTest, KernelRoundingPasses) {
  SCOPED_TRACE(trace_);
  const absl::Status verdict = check_->Verify(KernelRoundingBackward(GetParam().problem, t_));
  EXPECT_TRUE(verdict.ok()) << verdict.message();
}

// Wrong gradients: each scaled by 1 + 32 u (four times the tolerance's 8 RMS, u the dtype's
// unit roundoff); dK and dV of the last third of every sequence's keys lost; D left out.
TEST_P(FiniteDifferenceHarnessTest, WrongGradientsFail) {
  SCOPED_TRACE(trace_);
  const AttentionProblem& p = GetParam().problem;
  const Gradients right = KernelRoundingBackward(p, t_);
  ASSERT_TRUE(check_->Verify(right).ok());

  const double u = UnitRoundoff(p.dtype);
  Gradients scaled = right;
  for (std::vector<double>* v : {&scaled.dq, &scaled.dk, &scaled.dv}) {
    for (double& e : *v) e *= 1 + 32 * u;
  }
  EXPECT_FALSE(check_->Verify(scaled).ok()) << "gradients scaled by " << 1 + 32 * u;

  Gradients tail_lost = right;
  const int64_t row = int64_t{p.num_kv_heads} * p.head_dim;
  for (int b = 0; b < p.batch(); ++b) {
    const int64_t lk = p.seqlen_k(b);
    for (int64_t j = p.cu_seqlens_k[b] + lk - lk / 3; j < p.cu_seqlens_k[b + 1]; ++j) {
      for (int64_t e = j * row; e < (j + 1) * row; ++e) tail_lost.dk[e] = tail_lost.dv[e] = 0;
    }
  }
  EXPECT_FALSE(check_->Verify(tail_lost).ok()) << "the last third of the keys' dK and dV lost";

  EXPECT_FALSE(check_->Verify(KernelRoundingBackward(p, t_, /*with_delta=*/false)).ok())
      << "D left out";
}

INSTANTIATE_TEST_SUITE_P(Fd, FiniteDifferenceHarnessTest,
                         ::testing::ValuesIn(FiniteDifferenceCases()),
                         [](const ::testing::TestParamInfo<SweepCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace attn::testing
