// The fused/naive dispatcher. Its decisions are tested with stand-in engines (no device
// needed); a GPU test checks that the real engines behind it are chosen as documented.
#include "cuda/common/dispatch.h"

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "attn/engine.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"

namespace attn::cuda {
namespace {

// An engine that supports what it is told to and counts forward calls.
class StandInEngine final : public Engine {
 public:
  StandInEngine(EngineKind kind, absl::Status supports, int* calls)
      : kind_(kind), supports_(std::move(supports)), calls_(calls) {}
  EngineKind kind() const override { return kind_; }
  MemorySpace memory_space() const override { return MemorySpace::kDevice; }
  absl::Status SupportsForward(const AttentionProblem&) const override { return supports_; }
  absl::Status SupportsBackward(const AttentionProblem&) const override {
    return absl::UnimplementedError("stand-in");
  }
  absl::Status Forward(const AttentionProblem&, const ForwardArgs&) override {
    ++*calls_;
    return absl::OkStatus();
  }
  absl::Status Backward(const AttentionProblem&, const BackwardArgs&) override {
    return absl::UnimplementedError("stand-in");
  }

 private:
  EngineKind kind_;
  absl::Status supports_;
  int* calls_;
};

// Views over a fake, 16-byte aligned address: the stand-ins never read them.
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

Dispatcher MakeDispatcher(absl::Status fused_supports, absl::Status naive_supports,
                          int* fused_calls, int* naive_calls) {
  return Dispatcher(
      std::make_unique<StandInEngine>(EngineKind::kCudaFused, fused_supports, fused_calls),
      std::make_unique<StandInEngine>(EngineKind::kCudaNaive, naive_supports, naive_calls));
}

TEST(Dispatcher, AutoPrefersFusedWhenSupported) {
  int fused = 0, naive = 0;
  Dispatcher d = MakeDispatcher(absl::OkStatus(), absl::OkStatus(), &fused, &naive);
  Fixture f;
  auto decision = d.Forward(f.p, f.args, PathPreference::kAuto);
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->path, EngineKind::kCudaFused);
  EXPECT_FALSE(decision->reason.empty());
  EXPECT_EQ(fused, 1);
  EXPECT_EQ(naive, 0);
}

TEST(Dispatcher, AutoFallsBackToNaiveWithTheFusedReason) {
  int fused = 0, naive = 0;
  Dispatcher d = MakeDispatcher(absl::UnimplementedError("head_dim 80 not built"), absl::OkStatus(),
                                &fused, &naive);
  Fixture f;
  auto decision = d.Forward(f.p, f.args, PathPreference::kAuto);
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->path, EngineKind::kCudaNaive);
  EXPECT_TRUE(absl::StrContains(decision->reason, "head_dim 80 not built")) << decision->reason;
  EXPECT_EQ(fused, 0);
  EXPECT_EQ(naive, 1);
}

TEST(Dispatcher, AutoFallsBackOnMisalignedStrides) {
  int fused = 0, naive = 0;
  Dispatcher d = MakeDispatcher(absl::OkStatus(), absl::OkStatus(), &fused, &naive);
  Fixture f;
  f.args.q.token_stride += 3;  // 3 bf16 elements: not a multiple of 16 bytes
  auto decision = d.Choose(f.p, f.args, PathPreference::kAuto);
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->path, EngineKind::kCudaNaive);
  EXPECT_TRUE(absl::StrContains(decision->reason, "q: token_stride")) << decision->reason;

  Fixture misaligned(64, /*offset_elements=*/1);
  decision = d.Choose(misaligned.p, misaligned.args, PathPreference::kAuto);
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->path, EngineKind::kCudaNaive);
  EXPECT_TRUE(absl::StrContains(decision->reason, "aligned")) << decision->reason;
}

TEST(Dispatcher, ExplicitFusedOnUnsupportedIsAnErrorWithTheReason) {
  int fused = 0, naive = 0;
  Dispatcher d = MakeDispatcher(absl::UnimplementedError("float32 not built"), absl::OkStatus(),
                                &fused, &naive);
  Fixture f;
  auto decision = d.Forward(f.p, f.args, PathPreference::kFused);
  ASSERT_FALSE(decision.ok());
  EXPECT_EQ(decision.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(absl::StrContains(decision.status().message(), "float32 not built"))
      << decision.status();
  EXPECT_EQ(fused + naive, 0);
}

TEST(Dispatcher, ExplicitNaiveRunsNaive) {
  int fused = 0, naive = 0;
  Dispatcher d = MakeDispatcher(absl::OkStatus(), absl::OkStatus(), &fused, &naive);
  Fixture f;
  auto decision = d.Forward(f.p, f.args, PathPreference::kNaive);
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->path, EngineKind::kCudaNaive);
  EXPECT_EQ(naive, 1);
}

TEST(Dispatcher, NaiveLimitErrorsPassThrough) {
  int fused = 0, naive = 0;
  Dispatcher d = MakeDispatcher(absl::UnimplementedError("no"),
                                absl::ResourceExhaustedError("too big"), &fused, &naive);
  Fixture f;
  auto decision = d.Forward(f.p, f.args, PathPreference::kAuto);
  EXPECT_EQ(decision.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(fused + naive, 0);
}

TEST(Dispatcher, InvalidArgumentsAreRejectedBeforeChoosing) {
  int fused = 0, naive = 0;
  Dispatcher d = MakeDispatcher(absl::OkStatus(), absl::OkStatus(), &fused, &naive);
  Fixture f;
  f.args.o.data = nullptr;
  auto decision = d.Forward(f.p, f.args, PathPreference::kAuto);
  EXPECT_EQ(decision.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fused + naive, 0);
}

TEST(Dispatcher, ParsesPreferences) {
  EXPECT_EQ(*ParsePathPreference("auto"), PathPreference::kAuto);
  EXPECT_EQ(*ParsePathPreference("fused"), PathPreference::kFused);
  EXPECT_EQ(*ParsePathPreference("naive"), PathPreference::kNaive);
  EXPECT_EQ(ParsePathPreference("fast").status().code(), absl::StatusCode::kInvalidArgument);
  for (PathPreference p : {PathPreference::kAuto, PathPreference::kFused, PathPreference::kNaive}) {
    EXPECT_EQ(*ParsePathPreference(PathPreferenceName(p)), p);
  }
}

TEST(Dispatcher, RealEnginesFollowFusedSupport) {
  ATTN_SKIP_WITHOUT_CUDA();
  auto d = Dispatcher::Create();
  ASSERT_TRUE(d.ok()) << d.status();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int head_dim : {64, 80, 128}) {
      const AttentionProblem p = DenseProblem(t, 1, 64, 64, 2, 2, head_dim);
      Fixture f(head_dim);
      f.p = p;
      auto decision = (*d)->Choose(p, f.args, PathPreference::kAuto);
      ASSERT_TRUE(decision.ok()) << decision.status();
      const bool fused = (*d)->fused().SupportsForward(p).ok();
      EXPECT_EQ(decision->path, fused ? EngineKind::kCudaFused : EngineKind::kCudaNaive)
          << p.DebugString() << ": " << decision->reason;
      if (t != DType::kF32 && (head_dim == 64 || head_dim == 128)) {
        EXPECT_EQ(decision->path, EngineKind::kCudaFused) << decision->reason;
      }
    }
  }
}

}  // namespace
}  // namespace attn::cuda
