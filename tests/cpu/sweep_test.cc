// The CPU tiled engine against the float64 reference over the standard sweep, forward and
// backward, under the accuracy rule of common/accuracy.h; outputs are poisoned before each call.
#include "common/sweep.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "common/accuracy.h"
#include "common/host_tensor.h"
#include "common/naive_attention.h"
#include "common/reference.h"
#include "gtest/gtest.h"

namespace attn::testing {
namespace {

// See FractionCorrectlyRounded: O and dV measured at 0.995 or more on every low-precision case
// of the sweep; a truncating store drops to about 0.5.
constexpr double kMinCorrectlyRounded = 0.97;

std::unique_ptr<Engine> MustCreate(EngineKind kind, int threads = 0) {
  EngineOptions options;
  options.num_threads = threads;
  auto engine = CreateEngine(kind, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

class CpuSweepTest : public ::testing::TestWithParam<SweepCase> {
 protected:
  void SetUp() override {
    seed_ = FreshSeed();
    trace_ = absl::StrCat("seed=", seed_, " (replay with ATTN_TEST_SEED) ",
                          GetParam().problem.DebugString());
  }
  uint64_t seed_ = 0;
  std::string trace_;
};

TEST_P(CpuSweepTest, TiledForwardMatchesReference) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  const AttentionProblem& p = c.problem;
  AttentionTensors t = AttentionTensors::Make(p, seed_, c.padded);
  auto ref = RunReference(p, t, /*backward=*/false);
  ASSERT_TRUE(ref.ok()) << ref.status();

  auto tiled = MustCreate(EngineKind::kCpuTiled);
  ASSERT_NE(tiled, nullptr);
  ASSERT_TRUE(tiled->SupportsForward(p).ok());
  t.PoisonOutputs();
  ASSERT_TRUE(tiled->Forward(p, t.forward_args()).ok());
  EXPECT_EQ(t.o.CountPoisoned(), 0) << "O elements never written";
  EXPECT_EQ(t.o.CountPaddingWritten(), 0) << "O padding overwritten";
  EXPECT_EQ(CountPoisonedFloats(t.lse), 0) << "LSE elements never written";

  NaiveForwardResult naive;
  if (p.dtype != DType::kF32) naive = NaiveForward(p, t.q, t.k, t.v);
  const absl::Status o_ok = CheckAccuracy("O", p.dtype, t.o.ToDouble(), ref->o, &naive.o);
  EXPECT_TRUE(o_ok.ok()) << o_ok.message();
  // Beyond the 2x rule: float32 accumulation plus one final rounding makes O the reference
  // correctly rounded except within float32 noise of a rounding tie.
  if (p.dtype != DType::kF32) {
    EXPECT_GE(FractionCorrectlyRounded(t.o.ToDouble(), ref->o, p.dtype), kMinCorrectlyRounded);
  }
  const absl::Status lse_ok = CheckLse(t.lse, ref->lse);
  EXPECT_TRUE(lse_ok.ok()) << lse_ok.message();
}

TEST_P(CpuSweepTest, TiledBackwardMatchesReference) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  const AttentionProblem& p = c.problem;
  AttentionTensors t = AttentionTensors::Make(p, seed_, c.padded);
  auto ref = RunReference(p, t, /*backward=*/true);
  ASSERT_TRUE(ref.ok()) << ref.status();

  auto tiled = MustCreate(EngineKind::kCpuTiled);
  ASSERT_NE(tiled, nullptr);
  ASSERT_TRUE(tiled->SupportsBackward(p).ok());
  ASSERT_TRUE(tiled->Forward(p, t.forward_args()).ok());
  t.dq.Poison();
  t.dk.Poison();
  t.dv.Poison();
  ASSERT_TRUE(tiled->Backward(p, t.backward_args()).ok());
  for (const HostTensor* g : {&t.dq, &t.dk, &t.dv}) {
    EXPECT_EQ(g->CountPoisoned(), 0) << "gradient elements never written";
    EXPECT_EQ(g->CountPaddingWritten(), 0) << "gradient padding overwritten";
  }

  NaiveBackwardResult naive;
  if (p.dtype != DType::kF32) naive = NaiveBackward(p, t.q, t.k, t.v, t.d_o);
  const absl::Status dq_ok =
      CheckAccuracy("dQ", p.dtype, t.dq.ToDouble(), ref->dq, &naive.dq, kF32BackwardRtol);
  EXPECT_TRUE(dq_ok.ok()) << dq_ok.message();
  const absl::Status dk_ok =
      CheckAccuracy("dK", p.dtype, t.dk.ToDouble(), ref->dk, &naive.dk, kF32BackwardRtol);
  EXPECT_TRUE(dk_ok.ok()) << dk_ok.message();
  // dV = P^T dO only depends on P, recomputed in float32, so it is correctly rounded like O.
  // dQ and dK are not held to this: they go through D = rowsum(dO * O) with O as stored in the
  // dtype, a genuine low-precision input (measured 69-98% correctly rounded).
  if (p.dtype != DType::kF32) {
    EXPECT_GE(FractionCorrectlyRounded(t.dv.ToDouble(), ref->dv, p.dtype), kMinCorrectlyRounded);
  }
  const absl::Status dv_ok =
      CheckAccuracy("dV", p.dtype, t.dv.ToDouble(), ref->dv, &naive.dv, kF32BackwardRtol);
  EXPECT_TRUE(dv_ok.ok()) << dv_ok.message();
}

// The reference itself, run in the problem's dtype: it writes every output element and agrees
// with its float32 run up to the final rounding.
TEST_P(CpuSweepTest, ReferenceWritesEveryOutputInItsDtype) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  const AttentionProblem& p = c.problem;
  AttentionTensors t = AttentionTensors::Make(p, seed_, c.padded);
  auto ref = RunReference(p, t, /*backward=*/false);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto engine = MustCreate(EngineKind::kCpuReference);
  ASSERT_NE(engine, nullptr);
  t.PoisonOutputs();
  ASSERT_TRUE(engine->Forward(p, t.forward_args()).ok());
  ASSERT_TRUE(engine->Backward(p, t.backward_args()).ok());
  for (const HostTensor* out : {&t.o, &t.dq, &t.dk, &t.dv}) {
    EXPECT_EQ(out->CountPoisoned(), 0);
    EXPECT_EQ(out->CountPaddingWritten(), 0);
  }
  EXPECT_EQ(CountPoisonedFloats(t.lse), 0);
  const std::vector<double> o = t.o.ToDouble();
  for (size_t i = 0; i < o.size(); ++i) {
    ASSERT_EQ(o[i], RoundToDType(static_cast<float>(ref->o[i]), p.dtype)) << "element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, CpuSweepTest, ::testing::ValuesIn(StandardSweep()),
                         [](const ::testing::TestParamInfo<SweepCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace attn::testing
