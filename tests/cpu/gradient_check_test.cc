// The reference engine against closed forms and central finite differences: the analytic
// backward must be the gradient of sum(O * dO) for the forward it computes.
#include <cmath>
#include <memory>
#include <ostream>

#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "common/host_tensor.h"
#include "gtest/gtest.h"

namespace attn::testing {
namespace {

// One query, two keys, head_dim 1, scale 1: S = (0, 1), P = (1, e) / (1 + e).
TEST(ReferenceTest, MatchesClosedFormForTwoKeys) {
  for (EngineKind kind : {EngineKind::kCpuReference, EngineKind::kCpuTiled}) {
    SCOPED_TRACE(std::string(EngineKindName(kind)));
    AttentionProblem p = DenseProblem(DType::kF32, 1, 1, 2, 1, 1, 1);
    p.softmax_scale = 1.f;
    AttentionTensors t = AttentionTensors::Make(p, 1);
    t.q.Set(0, 0, 0, 1.f);
    t.k.Set(0, 0, 0, 0.f);
    t.k.Set(1, 0, 0, 1.f);
    t.v.Set(0, 0, 0, 1.f);
    t.v.Set(1, 0, 0, 3.f);
    auto engine = CreateEngine(kind);
    ASSERT_TRUE(engine.ok());
    ASSERT_TRUE((*engine)->Forward(p, t.forward_args()).ok());
    const double e = std::exp(1.0);
    EXPECT_NEAR(t.o.Get(0, 0, 0), (1 + 3 * e) / (1 + e), 1e-6);
    EXPECT_NEAR(t.lse[0], std::log(1 + e), 1e-6);
  }
}

// Loss(Q, K, V) = sum(O * dO) computed in float64 from the engine's float32 O.
double Loss(Engine& engine, const AttentionProblem& p, AttentionTensors& t) {
  EXPECT_TRUE(engine.Forward(p, t.forward_args()).ok());
  const std::vector<double> o = t.o.ToDouble(), d_o = t.d_o.ToDouble();
  double loss = 0;
  for (size_t i = 0; i < o.size(); ++i) loss += o[i] * d_o[i];
  return loss;
}

struct GradCase {
  std::string name;
  AttentionProblem problem;
};

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

class FiniteDifferenceTest : public ::testing::TestWithParam<GradCase> {};

TEST_P(FiniteDifferenceTest, ReferenceBackwardIsTheGradient) {
  const AttentionProblem& p = GetParam().problem;
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed=", seed, " ", p.DebugString()));
  auto engine_or = CreateEngine(EngineKind::kCpuReference);
  ASSERT_TRUE(engine_or.ok());
  Engine& engine = **engine_or;
  AttentionTensors t = AttentionTensors::Make(p, seed);
  ASSERT_TRUE(engine.Forward(p, t.forward_args()).ok());
  ASSERT_TRUE(engine.Backward(p, t.backward_args()).ok());

  // Central differences with a step large enough that float32 rounding of O (about 1e-7
  // relative, summed over the loss) stays well below the tolerance.
  constexpr float kStep = 1e-2f;
  const struct {
    const char* name;
    HostTensor* input;
    const HostTensor* grad;
  } inputs[] = {{"q", &t.q, &t.dq}, {"k", &t.k, &t.dk}, {"v", &t.v, &t.dv}};
  for (const auto& in : inputs) {
    for (int64_t tok = 0; tok < in.input->tokens(); ++tok) {
      for (int h = 0; h < in.input->heads(); ++h) {
        for (int c = 0; c < in.input->head_dim(); ++c) {
          const float x = in.input->Get(tok, h, c);
          in.input->Set(tok, h, c, x + kStep);
          const double up = Loss(engine, p, t);
          in.input->Set(tok, h, c, x - kStep);
          const double down = Loss(engine, p, t);
          in.input->Set(tok, h, c, x);
          const double numeric = (up - down) / (2.0 * kStep);
          const double analytic = in.grad->Get(tok, h, c);
          ASSERT_NEAR(analytic, numeric, 2e-3 + 1e-2 * std::abs(numeric))
              << "d loss / d " << in.name << "[" << tok << "][" << h << "][" << c << "]";
        }
      }
    }
  }
}

GradCase Windowed(GradCase c, int left, int right) {
  c.problem.window_left = left;
  c.problem.window_right = right;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Small, FiniteDifferenceTest,
    ::testing::Values(
        GradCase{"dense_gqa2", DenseProblem(DType::kF32, 1, 5, 7, 4, 2, 8)},
        GradCase{"causal_q5_k7", DenseProblem(DType::kF32, 1, 5, 7, 2, 1, 6, true)},
        GradCase{"causal_q7_k4_masked_rows", DenseProblem(DType::kF32, 1, 7, 4, 1, 1, 5, true)},
        Windowed(GradCase{"window_2_1", DenseProblem(DType::kF32, 1, 6, 6, 2, 2, 4)}, 2, 1),
        GradCase{"varlen", VarlenProblem(DType::kF32, {3, 0, 4}, {2, 3, 5}, 2, 1, 4)}),
    [](const ::testing::TestParamInfo<GradCase>& info) { return info.param.name; });

}  // namespace
}  // namespace attn::testing
