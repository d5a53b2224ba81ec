// What decides the path of a forward call, answered without a device: the CUDA engines'
// support (the fused kernels' table, the naive path's workspace limit) with structured reasons,
// and the 16-byte alignment rule of the fused kernels. The server picks the first engine of its
// AUTO order whose answer is yes (server/attention_service.cc). One GPU test checks that the
// real engines answer the same.
#include <cstdint>

#include "absl/strings/match.h"
#include "attn/engine.h"
#include "cuda/common/alignment.h"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/heuristics.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"

namespace attn::cuda {
namespace {

// Views over a fake, 16-byte aligned address: nothing reads them.
struct Fixture {
  explicit Fixture(int head_dim = 64, int64_t offset_elements = 0) {
    p = DenseProblem(DType::kBF16, 2, 33, 33, 4, 2, head_dim);
    char* base = reinterpret_cast<char*>(uintptr_t{1} << 20) + offset_elements * 2;
    args.q = Packed<const void*>(base, 4, head_dim);
    args.k = Packed<const void*>(base, 2, head_dim);
    args.v = Packed<const void*>(base, 2, head_dim);
    args.o = Packed<void*>(base, 4, head_dim);
  }
  AttentionProblem p;
  ForwardArgs args;
};

// The warp-specialised forward's tile shape by problem (heuristics.h): masked problems take the
// masked shape, and at head_dim 128 short unmasked ones too (128-key tiles, no partial tile);
// at 64 masked ones below 2048 keys only (two consumers; three from 2048).
TEST(Support, HopperForwardShapeFollowsTheMeasurements) {
  EXPECT_TRUE(Sm90TmaTakesMaskedShape(128, 16384, /*masked=*/true));
  EXPECT_TRUE(Sm90TmaTakesMaskedShape(128, 512, /*masked=*/false));
  EXPECT_TRUE(Sm90TmaTakesMaskedShape(128, 1024, /*masked=*/false));
  EXPECT_FALSE(Sm90TmaTakesMaskedShape(128, 1025, /*masked=*/false));
  EXPECT_FALSE(Sm90TmaTakesMaskedShape(96, 512, /*masked=*/false));  // not measured
  EXPECT_EQ(Sm90TmaFusedTileShape(128, /*masked=*/true).block_n, 128);
  EXPECT_EQ(Sm90TmaFusedTileShape(128, /*masked=*/false).block_n, 176);
  EXPECT_TRUE(Sm90TmaTakesMaskedShape(64, 2047, /*masked=*/true));
  EXPECT_FALSE(Sm90TmaTakesMaskedShape(64, 2048, /*masked=*/true));
  EXPECT_FALSE(Sm90TmaTakesMaskedShape(64, 512, /*masked=*/false));
  EXPECT_EQ(Sm90TmaFusedTileShape(64, /*masked=*/true).consumer_warpgroups, 2);
  EXPECT_EQ(Sm90TmaFusedTileShape(64, /*masked=*/false).consumer_warpgroups, 3);
}

Support Fused(Pass pass, const AttentionProblem& p) {
  return EngineSupports(EngineKind::kCudaFused, pass, p);
}
Support Naive(Pass pass, const AttentionProblem& p, const EngineOptions& options = {}) {
  return EngineSupports(EngineKind::kCudaNaive, pass, p, options);
}

TEST(Support, FusedCoversTheTablesShapes) {
  Fixture f;
  EXPECT_TRUE(Fused(Pass::kForward, f.p).ok()) << Fused(Pass::kForward, f.p);
  EXPECT_TRUE(CheckRowsAligned16(f.p, f.args).ok());
  for (const FusedCapability& row : FusedCapabilities()) {
    AttentionProblem p = f.p;
    p.dtype = row.dtype;
    p.head_dim = row.head_dim;
    EXPECT_TRUE(Fused(row.pass, p).ok()) << PassName(row.pass) << " " << p.DebugString();
  }
}

TEST(Support, FusedRefusesOtherHeadDimsWithTheReason) {
  Fixture f(80);
  const Support fused = Fused(Pass::kForward, f.p);
  ASSERT_FALSE(fused.ok());
  EXPECT_EQ(fused.reason(), Refusal::kUnsupportedHeadDim);
  EXPECT_EQ(fused.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(absl::StrContains(fused.status().message(), "head_dim 80")) << fused;
  EXPECT_TRUE(absl::StrContains(fused.status().message(), "32, 64, 96, 128, 256")) << fused;
  // What AUTO falls back to takes it.
  EXPECT_TRUE(Naive(Pass::kForward, f.p).ok()) << Naive(Pass::kForward, f.p);

  const Support backward = Fused(Pass::kBackward, f.p);
  ASSERT_FALSE(backward.ok());
  EXPECT_EQ(backward.reason(), Refusal::kUnsupportedHeadDim) << backward;
  EXPECT_TRUE(absl::StrContains(backward.status().message(), "backward head_dim 80")) << backward;
  EXPECT_TRUE(absl::StrContains(backward.status().message(), "32, 64, 96, 128, 256")) << backward;
}

TEST(Support, FusedBackwardCoversHeadDim256) {
  const AttentionProblem d256 = Fixture(256).p;
  EXPECT_TRUE(Fused(Pass::kForward, d256).ok()) << Fused(Pass::kForward, d256);
  EXPECT_TRUE(Fused(Pass::kBackward, d256).ok()) << Fused(Pass::kBackward, d256);
  for (DType t : {DType::kF16, DType::kBF16}) {
    // The portable kernel on every GPU, and on Hopper the wide backward (TMA and wgmma); no
    // lockstep kernel.
    EXPECT_TRUE(HasFusedKernel(Pass::kBackward, t, 256, kSm80)) << DTypeName(t);
    EXPECT_FALSE(HasFusedKernel(Pass::kBackward, t, 256, kSm90a)) << DTypeName(t);
    EXPECT_TRUE(HasFusedKernel(Pass::kBackward, t, 256, kSm90aTma)) << DTypeName(t);
  }
}

TEST(Support, MisalignedTensorsBreakTheFusedRule) {
  Fixture f;
  f.args.q.token_stride += 3;  // 3 bf16 elements: not a multiple of 16 bytes
  Support aligned = CheckRowsAligned16(f.p, f.args);
  EXPECT_EQ(aligned.reason(), Refusal::kUnaligned);
  EXPECT_EQ(aligned.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(aligned.status().message(), "q: token_stride")) << aligned;

  Fixture misaligned(64, /*offset_elements=*/1);
  aligned = CheckRowsAligned16(misaligned.p, misaligned.args);
  EXPECT_EQ(aligned.reason(), Refusal::kUnaligned);
  EXPECT_TRUE(absl::StrContains(aligned.status().message(), "aligned")) << aligned;
  // The naive path takes any strides.
  EXPECT_TRUE(Naive(Pass::kForward, misaligned.p).ok());
}

TEST(Support, FusedRefusesFloat32WithTheReason) {
  AttentionProblem p = Fixture().p;
  p.dtype = DType::kF32;
  for (Pass pass : {Pass::kForward, Pass::kBackward}) {
    const Support fused = Fused(pass, p);
    ASSERT_FALSE(fused.ok());
    EXPECT_EQ(fused.reason(), Refusal::kUnsupportedDtype);
    EXPECT_EQ(fused.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_TRUE(absl::StrContains(fused.status().message(), "float32")) << fused;
    EXPECT_TRUE(absl::StrContains(fused.status().message(), "float16 and bfloat16")) << fused;
  }
}

TEST(Support, NaiveRunsEveryValidProblem) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int head_dim : {1, 64, 80, 256}) {
      AttentionProblem p = Fixture(head_dim).p;
      p.dtype = t;
      EXPECT_TRUE(Naive(Pass::kForward, p).ok()) << p.DebugString();
      EXPECT_TRUE(Naive(Pass::kBackward, p).ok()) << p.DebugString();
    }
  }
}

TEST(Support, NaiveLimitIsTooLarge) {
  EngineOptions options;
  options.workspace_limit_bytes = int64_t{1} << 20;  // one 1013 x 1013 float32 matrix is 4 MB
  const AttentionProblem p = DenseProblem(DType::kF16, 1, 1013, 1013, 2, 2, 64);
  for (Pass pass : {Pass::kForward, Pass::kBackward}) {
    const Support naive = Naive(pass, p, options);
    EXPECT_EQ(naive.reason(), Refusal::kTooLarge) << naive;
    EXPECT_EQ(naive.status().code(), absl::StatusCode::kResourceExhausted) << naive;
    EXPECT_TRUE(absl::StrContains(naive.status().message(), "workspace_limit_bytes")) << naive;
  }
}

TEST(Support, FusedBackwardGridLimitIsTooLarge) {
  const AttentionProblem p = DenseProblem(DType::kBF16, 65536, 1, 1, 1, 1, 64);
  const Support fused = Fused(Pass::kBackward, p);
  EXPECT_EQ(fused.reason(), Refusal::kTooLarge) << fused;
}

TEST(Support, InvalidProblemsAreRefusedBeforeAnyKernelQuestion) {
  AttentionProblem p = Fixture().p;
  p.num_heads = 3;  // not a multiple of num_kv_heads = 2
  for (EngineKind kind : {EngineKind::kCudaFused, EngineKind::kCudaNaive, EngineKind::kCpuTiled}) {
    for (Pass pass : {Pass::kForward, Pass::kBackward}) {
      const Support s = EngineSupports(kind, pass, p);
      EXPECT_EQ(s.reason(), Refusal::kInvalidProblem) << EngineKindName(kind) << ": " << s;
      EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s;
    }
  }
}

TEST(Support, TableLookupsAgree) {
  for (Pass pass : {Pass::kForward, Pass::kBackward}) {
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (int head_dim = 1; head_dim <= kMaxHeadDim; ++head_dim) {
        AttentionProblem p = Fixture(head_dim).p;
        p.dtype = t;
        EXPECT_EQ(Fused(pass, p).ok(), FindFusedKernel(pass, t, head_dim) != nullptr)
            << PassName(pass) << " " << p.DebugString();
      }
    }
  }
  // The wgmma kernels exist where the table says so: the lockstep one at head_dim 64 and 128
  // (forward only), the warp-specialised one at 64, 96, 128 and 256, the Hopper backward at 64,
  // 96 and 128 (the backward at 32 and 256 is the portable kernel's).
  EXPECT_TRUE(HasFusedKernel(Pass::kForward, DType::kBF16, 64, kSm90a));
  EXPECT_TRUE(HasFusedKernel(Pass::kForward, DType::kF16, 128, kSm90a));
  EXPECT_FALSE(HasFusedKernel(Pass::kForward, DType::kBF16, 96, kSm90a));
  EXPECT_FALSE(HasFusedKernel(Pass::kForward, DType::kF16, 256, kSm90a));
  EXPECT_FALSE(HasFusedKernel(Pass::kBackward, DType::kBF16, 64, kSm90a));
  for (DType t : {DType::kF16, DType::kBF16}) {
    for (int head_dim : {64, 96, 128, 256}) {
      EXPECT_TRUE(HasFusedKernel(Pass::kForward, t, head_dim, kSm90aTma))
          << DTypeName(t) << " " << head_dim;
    }
    EXPECT_FALSE(HasFusedKernel(Pass::kForward, t, 32, kSm90aTma));
    EXPECT_FALSE(HasFusedKernel(Pass::kBackward, t, 32, kSm90aTma));
    EXPECT_TRUE(HasFusedKernel(Pass::kBackward, t, 64, kSm90aTma));
    EXPECT_TRUE(HasFusedKernel(Pass::kBackward, t, 96, kSm90aTma));
    EXPECT_TRUE(HasFusedKernel(Pass::kBackward, t, 128, kSm90aTma));
    EXPECT_TRUE(HasFusedKernel(Pass::kBackward, t, 256));
    EXPECT_TRUE(HasFusedKernel(Pass::kBackward, t, 256, kSm90aTma));
  }
}

TEST(Support, RealEnginesAnswerAsTheRegistry) {
  ATTN_SKIP_WITHOUT_CUDA();
  auto fused = testing::MustCreate(EngineKind::kCudaFused);
  auto naive = testing::MustCreate(EngineKind::kCudaNaive);
  ASSERT_NE(fused, nullptr);
  ASSERT_NE(naive, nullptr);
  EXPECT_TRUE(EngineAvailable(EngineKind::kCudaFused).ok());
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int head_dim : {64, 80, 128}) {
      const AttentionProblem p = DenseProblem(t, 1, 64, 64, 2, 2, head_dim);
      EXPECT_EQ(fused->SupportsForward(p).reason(), Fused(Pass::kForward, p).reason())
          << p.DebugString();
      EXPECT_EQ(fused->SupportsBackward(p).reason(), Fused(Pass::kBackward, p).reason())
          << p.DebugString();
      EXPECT_EQ(naive->SupportsForward(p).reason(), Naive(Pass::kForward, p).reason())
          << p.DebugString();
      if (t != DType::kF32 && (head_dim == 64 || head_dim == 128)) {
        EXPECT_TRUE(fused->SupportsForward(p).ok()) << fused->SupportsForward(p);
      }
    }
  }
}

}  // namespace
}  // namespace attn::cuda
