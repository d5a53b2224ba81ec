// The registry's answers for every engine kind, in any build: CPU engines run every valid
// problem; CUDA engines are unavailable in a build without CUDA; the fused kernels' table is
// the same everywhere.
#include <set>
#include <tuple>

#include "attn/engine.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

TEST(Registry, CpuEnginesAnswerAsValidation) {
  AttentionProblem p = DenseProblem(DType::kF16, 2, 17, 33, 4, 2, 80, /*causal=*/true);
  for (EngineKind kind : {EngineKind::kCpuReference, EngineKind::kCpuTiled}) {
    EXPECT_TRUE(EngineAvailable(kind).ok());
    auto engine = CreateEngine(kind);
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (Pass pass : {Pass::kForward, Pass::kBackward}) {
      EXPECT_TRUE(EngineSupports(kind, pass, p).ok());
    }
    EXPECT_TRUE((*engine)->SupportsForward(p).ok());
  }
  p.num_kv_heads = 3;
  const Support invalid = EngineSupports(EngineKind::kCpuTiled, Pass::kForward, p);
  EXPECT_EQ(invalid.reason(), Refusal::kInvalidProblem) << invalid;
  EXPECT_EQ(invalid.status(), ValidateProblem(p));
}

TEST(Registry, CudaEnginesWithoutCudaAreUnavailable) {
  if (BuiltWithCuda()) GTEST_SKIP() << "a CUDA build: availability depends on the device";
  const AttentionProblem p = DenseProblem(DType::kBF16, 1, 16, 16, 2, 2, 64);
  for (EngineKind kind : {EngineKind::kCudaFused, EngineKind::kCudaNaive}) {
    EXPECT_EQ(EngineAvailable(kind).code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(CreateEngine(kind).status().code(), absl::StatusCode::kUnavailable);
    const Support s = EngineSupports(kind, Pass::kForward, p);
    EXPECT_EQ(s.reason(), Refusal::kUnavailable) << s;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s;
  }
}

TEST(Registry, FusedCapabilitiesListEachKernelOnce) {
  std::set<std::tuple<Pass, DType, int>> seen;
  std::set<int> forward_dims, backward_dims;
  for (const FusedCapability& row : FusedCapabilities()) {
    EXPECT_TRUE(seen.insert({row.pass, row.dtype, row.head_dim}).second)
        << PassName(row.pass) << " " << DTypeName(row.dtype) << " " << row.head_dim;
    EXPECT_GE(row.head_dim, 1);
    EXPECT_LE(row.head_dim, kMaxHeadDim);
    EXPECT_NE(row.archs & FusedArch::kSm80, 0) << "every row has the portable kernel";
    if (row.pass == Pass::kForward) forward_dims.insert(row.head_dim);
    if (row.pass == Pass::kBackward) backward_dims.insert(row.head_dim);
  }
  EXPECT_EQ(forward_dims, (std::set<int>{32, 64, 96, 128, 256}));
  EXPECT_EQ(backward_dims, (std::set<int>{32, 64, 96, 128, 256}));
}

TEST(Registry, RefusalsHaveDistinctNames) {
  std::set<std::string_view> names;
  for (Refusal r : {Refusal::kNone, Refusal::kInvalidProblem, Refusal::kUnsupportedDtype,
                    Refusal::kUnsupportedHeadDim, Refusal::kUnaligned, Refusal::kTooLarge,
                    Refusal::kUnavailable, Refusal::kOther}) {
    EXPECT_TRUE(names.insert(RefusalName(r)).second) << RefusalName(r);
  }
  const Support yes;
  EXPECT_TRUE(yes.ok());
  EXPECT_EQ(yes.reason(), Refusal::kNone);
  const Support no(Refusal::kTooLarge, absl::ResourceExhaustedError("big"));
  EXPECT_FALSE(no.ok());
  EXPECT_EQ(no.status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace attn
