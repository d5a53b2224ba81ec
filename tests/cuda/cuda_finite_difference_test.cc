// The CUDA fused backward against central differences of a float64 loss
// (common/finite_difference.h), independent of the float64 reference's analytic gradients: the
// default kernel choice (kAuto: the Hopper backward on Hopper wherever the table has it), the
// Hopper backward pinned, and the portable kernel pinned. Gradients are poisoned before each
// run and checked fully written. Every test skips when there is no CUDA device; the pinned
// Hopper test also off Hopper and where the table has no Hopper backward (head_dim 32).
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "common/finite_difference.h"
#include "common/host_tensor.h"
#include "cuda/cuda_engines.h"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/fused_forward.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"

namespace attn::testing {
namespace {

class CudaFiniteDifferenceTest : public ::testing::TestWithParam<SweepCase> {
 protected:
  void SetUp() override {
    ATTN_SKIP_WITHOUT_CUDA();
    seed_ = FreshSeed();
    trace_ = absl::StrCat("seed=", seed_, " (replay with ATTN_TEST_SEED) ",
                          GetParam().problem.DebugString());
  }

  // Runs `engine`'s backward on fresh inputs (O and the LSE from a forward pass in the problem's
  // dtype) and checks its gradients against the central differences. With `unavailable`, an
  // UNIMPLEMENTED answer (a pinned kernel this device or build cannot run) is stored there
  // instead of failing, and nothing is checked.
  void RunAndCheck(Engine& engine, absl::Status* unavailable = nullptr) {
    const AttentionProblem& p = GetParam().problem;
    AttentionTensors t = AttentionTensors::Make(p, seed_);
    auto device = DeviceBackward::UploadAfterForward(p, t);
    ASSERT_TRUE(device.ok()) << device.status();
    const absl::Status run = engine.Backward(p, device->args());
    if (unavailable != nullptr && absl::IsUnimplemented(run)) {
      *unavailable = run;
      return;
    }
    ASSERT_TRUE(run.ok()) << run;
    ASSERT_TRUE(device->Download(t).ok());
    for (const HostTensor* g : {&t.dq, &t.dk, &t.dv}) {
      EXPECT_EQ(g->CountPoisoned(), 0) << "gradient elements never written";
    }
    const FiniteDifferenceCheck check(p, LossPointOf(t), seed_);
    const absl::Status verdict = check.Verify(GradientsOf(t));
    EXPECT_TRUE(verdict.ok()) << verdict.message();
  }

  uint64_t seed_ = 0;
  std::string trace_;
};

TEST_P(CudaFiniteDifferenceTest, AutoBackwardMatchesFiniteDifferences) {
  SCOPED_TRACE(trace_);
  auto fused = MustCreate(EngineKind::kCudaFused);
  ASSERT_NE(fused, nullptr);
  const Support supported = fused->SupportsBackward(GetParam().problem);
  ASSERT_TRUE(supported.ok()) << supported;
  RunAndCheck(*fused);
}

TEST_P(CudaFiniteDifferenceTest, HopperBackwardMatchesFiniteDifferences) {
  SCOPED_TRACE(trace_);
  const AttentionProblem& p = GetParam().problem;
  if (!cuda::HasFusedKernel(Pass::kBackward, p.dtype, p.head_dim, cuda::kSm90aTma)) {
    GTEST_SKIP() << "no Hopper backward for this dtype and head_dim";
  }
  auto fused = MakeCudaFusedEngine(EngineOptions{}, cuda::FusedKernel::kSm90Tma);
  ASSERT_TRUE(fused.ok()) << fused.status();
  absl::Status unavailable;
  RunAndCheck(**fused, &unavailable);
  if (!unavailable.ok()) GTEST_SKIP() << unavailable;
}

TEST_P(CudaFiniteDifferenceTest, PortableBackwardMatchesFiniteDifferences) {
  SCOPED_TRACE(trace_);
  auto fused = MakeCudaFusedEngine(EngineOptions{}, cuda::FusedKernel::kPortable);
  ASSERT_TRUE(fused.ok()) << fused.status();
  RunAndCheck(**fused);
}

// The shared cases and, here only, head_dim 256 (its own Hopper kernel, 64 keys a CTA): a
// partial key block, several blocks with causal masking, rows that see no key, a window over a
// variable-length batch with an empty sequence.
std::vector<SweepCase> CudaFiniteDifferenceCases() {
  constexpr DType f16 = DType::kF16, bf16 = DType::kBF16;
  std::vector<SweepCase> s = FiniteDifferenceCases();
  s.push_back({"len37_bf16_d256_gqa2", DenseProblem(bf16, 1, 37, 37, 4, 2, 256, false)});
  s.push_back({"len130_causal_f16_d256", DenseProblem(f16, 1, 130, 130, 2, 2, 256, true)});
  s.push_back({"q130_k37_causal_bf16_d256", DenseProblem(bf16, 1, 130, 37, 2, 1, 256, true)});
  SweepCase window{"varlen_window20_7_f16_d256_gqa2",
                   VarlenProblem(f16, {37, 0, 130}, {50, 5, 130}, 4, 2, 256, false)};
  window.problem.window_left = 20;
  window.problem.window_right = 7;
  s.push_back(window);
  return s;
}

INSTANTIATE_TEST_SUITE_P(Fd, CudaFiniteDifferenceTest,
                         ::testing::ValuesIn(CudaFiniteDifferenceCases()),
                         [](const ::testing::TestParamInfo<SweepCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace attn::testing
