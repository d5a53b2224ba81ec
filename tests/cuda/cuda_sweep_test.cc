// The CUDA engines against the float64 reference over the standard sweep, under the accuracy
// rule of common/accuracy.h. Outputs (O, its padding, and the LSE) are poisoned before each call
// and checked fully written. Every test skips when there is no CUDA device.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "common/accuracy.h"
#include "common/host_tensor.h"
#include "common/naive_attention.h"
#include "common/reference.h"
#include "common/sweep.h"
#include "cuda/common/alignment.h"
#include "cuda/cuda_engines.h"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/fused_forward.h"
#include "cuda/fused/fused_support.h"
#include "cuda/fused/heuristics.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"

namespace attn::testing {
namespace {

// The fused kernel must cover these (forward and backward); a Supports that rejects them is a
// bug, not a skip.
bool FusedMustSupport(const AttentionProblem& p) {
  return (p.dtype == DType::kF16 || p.dtype == DType::kBF16) &&
         (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256);
}

class CudaSweepTest : public ::testing::TestWithParam<SweepCase> {
 protected:
  void SetUp() override {
    ATTN_SKIP_WITHOUT_CUDA();
    seed_ = FreshSeed();
    trace_ = absl::StrCat("seed=", seed_, " (replay with ATTN_TEST_SEED) ",
                          GetParam().problem.DebugString());
  }

  // Runs `engine` on t (on a stream of its own) and checks O and the LSE against the reference.
  // With `unavailable`, an UNIMPLEMENTED answer (a pinned kernel this device or build cannot
  // run) is stored there instead of failing, and nothing is checked.
  void RunAndCheck(Engine& engine, const AttentionProblem& p, AttentionTensors& t,
                   absl::Status* unavailable = nullptr) {
    auto ref = RunReference(p, t, /*backward=*/false);
    ASSERT_TRUE(ref.ok()) << ref.status();
    t.PoisonOutputs();
    auto device = DeviceForward::Upload(t);
    ASSERT_TRUE(device.ok()) << device.status();
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    const absl::Status run = engine.Forward(p, device->args(stream));
    const absl::Status download = device->Download(t);
    cudaStreamDestroy(stream);
    if (unavailable != nullptr && absl::IsUnimplemented(run)) {
      *unavailable = run;
      return;
    }
    ASSERT_TRUE(run.ok()) << run;
    ASSERT_TRUE(download.ok()) << download;

    EXPECT_EQ(t.o.CountPoisoned(), 0) << "O elements never written";
    EXPECT_EQ(t.o.CountPaddingWritten(), 0) << "O padding overwritten";
    EXPECT_EQ(CountPoisonedFloats(t.lse), 0) << "LSE elements never written";
    NaiveForwardResult naive;
    if (p.dtype != DType::kF32) naive = NaiveForward(p, t.q, t.k, t.v);
    const absl::Status o_ok = CheckAccuracy("O", p.dtype, t.o.ToDouble(), ref->o, &naive.o);
    EXPECT_TRUE(o_ok.ok()) << o_ok.message();
    const absl::Status lse_ok = CheckLse(t.lse, ref->lse);
    EXPECT_TRUE(lse_ok.ok()) << lse_ok.message();
  }

  // Runs `engine`'s backward on fresh inputs (O and the LSE from a forward pass in the
  // problem's dtype) and checks dQ, dK, dV against the reference, every element written. With
  // `deterministic`, asks for deterministic mode; `gradients`, when given, receives the bytes
  // of dQ, dK and dV; `unavailable` as for RunAndCheck.
  void RunBackwardAndCheck(Engine& engine, const SweepCase& c, bool deterministic = false,
                           std::vector<std::string>* gradients = nullptr,
                           absl::Status* unavailable = nullptr);

  // Deterministic mode on `engine`: correct, and the same dQ, dK, dV bytes from two runs on the
  // same inputs. False (nothing checked) when the engine answers UNIMPLEMENTED.
  bool CheckDeterministicBackward(Engine& engine) {
    std::vector<std::string> first, second;
    absl::Status unavailable;
    RunBackwardAndCheck(engine, GetParam(), /*deterministic=*/true, &first, &unavailable);
    if (!unavailable.ok()) return false;
    RunBackwardAndCheck(engine, GetParam(), /*deterministic=*/true, &second);
    EXPECT_EQ(first.size(), 3u);
    EXPECT_EQ(second.size(), 3u);
    const char* names[] = {"dQ", "dK", "dV"};
    for (size_t i = 0; i < 3 && i < first.size() && i < second.size(); ++i) {
      EXPECT_TRUE(first[i] == second[i]) << names[i] << " differs";
    }
    return true;
  }

  uint64_t seed_ = 0;
  std::string trace_;
};

TEST_P(CudaSweepTest, NaiveForwardMatchesReference) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  auto naive = MustCreate(EngineKind::kCudaNaive);
  ASSERT_NE(naive, nullptr);
  ASSERT_TRUE(naive->SupportsForward(c.problem).ok()) << naive->SupportsForward(c.problem);
  AttentionTensors t = AttentionTensors::Make(c.problem, seed_, c.padded);
  RunAndCheck(*naive, c.problem, t);
  // Again on the warmed engine (its workspace is reused) with fresh inputs.
  AttentionTensors again = AttentionTensors::Make(c.problem, seed_ + 1, c.padded);
  RunAndCheck(*naive, c.problem, again);
}

TEST_P(CudaSweepTest, NaiveBackwardMatchesReference) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  auto naive = MustCreate(EngineKind::kCudaNaive);
  ASSERT_NE(naive, nullptr);
  ASSERT_TRUE(naive->SupportsBackward(c.problem).ok()) << naive->SupportsBackward(c.problem);
  RunBackwardAndCheck(*naive, c);
}

TEST_P(CudaSweepTest, FusedBackwardMatchesReference) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  auto fused = MustCreate(EngineKind::kCudaFused);
  ASSERT_NE(fused, nullptr);
  if (const Support supported = fused->SupportsBackward(c.problem); !supported.ok()) {
    ASSERT_FALSE(FusedMustSupport(c.problem)) << supported;
    GTEST_SKIP() << "fused backward does not cover this problem: " << supported;
  }
  RunBackwardAndCheck(*fused, c);
}

// On Hopper the engine above runs the Hopper backward for head_dim 64, 96 and 128; this covers
// the portable kernel on the same problems.
TEST_P(CudaSweepTest, FusedPortableBackwardMatchesReference) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  if (const Support supported = cuda::FusedSupports(Pass::kBackward, c.problem); !supported.ok()) {
    GTEST_SKIP() << "fused backward does not cover this problem: " << supported;
  }
  auto fused = MakeCudaFusedEngine(EngineOptions{}, cuda::FusedKernel::kPortable);
  ASSERT_TRUE(fused.ok()) << fused.status();
  RunBackwardAndCheck(**fused, c);
}

// The portable kernel's deterministic mode: its atomics in key-block order.
TEST_P(CudaSweepTest, FusedPortableBackwardDeterministicRepeatsItsBytes) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  if (const Support supported = cuda::FusedSupports(Pass::kBackward, c.problem); !supported.ok()) {
    GTEST_SKIP() << "fused backward does not cover this problem: " << supported;
  }
  auto fused = MakeCudaFusedEngine(EngineOptions{}, cuda::FusedKernel::kPortable);
  ASSERT_TRUE(fused.ok()) << fused.status();
  ASSERT_TRUE(CheckDeterministicBackward(**fused));
}

void CudaSweepTest::RunBackwardAndCheck(Engine& engine, const SweepCase& c, bool deterministic,
                                        std::vector<std::string>* gradients,
                                        absl::Status* unavailable) {
  const AttentionProblem& p = c.problem;
  AttentionTensors t = AttentionTensors::Make(p, seed_, c.padded);
  auto ref = RunReference(p, t, /*backward=*/true);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto device = DeviceBackward::UploadAfterForward(p, t);
  ASSERT_TRUE(device.ok()) << device.status();
  BackwardArgs args = device->args();
  args.deterministic = deterministic;
  const absl::Status run = engine.Backward(p, args);
  if (unavailable != nullptr && absl::IsUnimplemented(run)) {
    *unavailable = run;
    return;
  }
  ASSERT_TRUE(run.ok()) << run;
  ASSERT_TRUE(device->Download(t).ok());
  for (const HostTensor* g : {&t.dq, &t.dk, &t.dv}) {
    EXPECT_EQ(g->CountPoisoned(), 0) << "gradient elements never written";
    EXPECT_EQ(g->CountPaddingWritten(), 0) << "gradient padding overwritten";
    if (gradients != nullptr) {
      gradients->emplace_back(static_cast<const char*>(g->data()), g->size_bytes());
    }
  }
  NaiveBackwardResult plain;
  if (p.dtype != DType::kF32) plain = NaiveBackward(p, t.q, t.k, t.v, t.d_o);
  const absl::Status dq_ok =
      CheckAccuracy("dQ", p.dtype, t.dq.ToDouble(), ref->dq, &plain.dq, kF32BackwardRtol);
  EXPECT_TRUE(dq_ok.ok()) << dq_ok.message();
  const absl::Status dk_ok =
      CheckAccuracy("dK", p.dtype, t.dk.ToDouble(), ref->dk, &plain.dk, kF32BackwardRtol);
  EXPECT_TRUE(dk_ok.ok()) << dk_ok.message();
  const absl::Status dv_ok =
      CheckAccuracy("dV", p.dtype, t.dv.ToDouble(), ref->dv, &plain.dv, kF32BackwardRtol);
  EXPECT_TRUE(dv_ok.ok()) << dv_ok.message();
}

TEST_P(CudaSweepTest, FusedForwardMatchesReference) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  const AttentionProblem& p = c.problem;
  const Support supported = cuda::FusedSupports(Pass::kForward, p);
  if (FusedMustSupport(p)) {
    ASSERT_TRUE(supported.ok())
        << "the fused kernel must cover fp16/bf16 with head_dim 64/128/256: " << supported;
  } else if (!supported.ok()) {
    GTEST_SKIP() << "fused kernel does not cover this problem: " << supported;
  }
  auto fused = MustCreate(EngineKind::kCudaFused);
  ASSERT_NE(fused, nullptr);
  AttentionTensors t = AttentionTensors::Make(p, seed_, c.padded);
  // Padded strides are not 16-byte multiples; the fused kernel then runs on packed tensors.
  if (c.padded) t = AttentionTensors::Make(p, seed_, /*padded=*/false);
  RunAndCheck(*fused, p, t);
}

// On Hopper the engine above runs the wgmma kernel for head_dim 64/128; this covers the portable
// mma.sync kernel (what sm_80 GPUs run) on the same problems.
TEST_P(CudaSweepTest, FusedPortableForwardMatchesReference) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  const AttentionProblem& p = c.problem;
  const Support supported = cuda::FusedSupports(Pass::kForward, p);
  if (!supported.ok()) {
    GTEST_SKIP() << "fused kernel does not cover this problem: " << supported;
  }
  auto fused = MakeCudaFusedEngine(EngineOptions{}, cuda::FusedKernel::kPortable);
  ASSERT_TRUE(fused.ok()) << fused.status();
  AttentionTensors t = AttentionTensors::Make(p, seed_, /*padded=*/false);
  RunAndCheck(**fused, p, t);
}

// What a caller choosing between the CUDA engines runs (the server's AUTO order: fused when it
// supports the problem and the tensors keep its alignment rule, naive otherwise) matches the
// reference, on the real engines.
TEST_P(CudaSweepTest, AutoChoiceMatchesReference) {
  SCOPED_TRACE(trace_);
  const SweepCase& c = GetParam();
  const AttentionProblem& p = c.problem;
  AttentionTensors t = AttentionTensors::Make(p, seed_, c.padded);
  auto ref = RunReference(p, t, /*backward=*/false);
  ASSERT_TRUE(ref.ok()) << ref.status();
  t.PoisonOutputs();
  auto device = DeviceForward::Upload(t);
  ASSERT_TRUE(device.ok()) << device.status();
  const Support fused_supports = EngineSupports(EngineKind::kCudaFused, Pass::kForward, p);
  const Support aligned = cuda::CheckRowsAligned16(p, device->args());
  const EngineKind chosen =
      fused_supports.ok() && aligned.ok() ? EngineKind::kCudaFused : EngineKind::kCudaNaive;
  if (chosen == EngineKind::kCudaNaive) {
    ASSERT_TRUE(EngineSupports(chosen, Pass::kForward, p).ok());
  }
  auto engine = MustCreate(chosen);
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->SupportsForward(p).ok()) << engine->SupportsForward(p);
  const absl::Status run = engine->Forward(p, device->args());
  ASSERT_TRUE(run.ok()) << run;
  ASSERT_TRUE(device->Download(t).ok());
  EXPECT_EQ(t.o.CountPoisoned(), 0);
  NaiveForwardResult naive;
  if (p.dtype != DType::kF32) naive = NaiveForward(p, t.q, t.k, t.v);
  const absl::Status o_ok = CheckAccuracy("O", p.dtype, t.o.ToDouble(), ref->o, &naive.o);
  EXPECT_TRUE(o_ok.ok()) << o_ok.message() << " (path " << EngineKindName(chosen) << ")";
  const absl::Status lse_ok = CheckLse(t.lse, ref->lse);
  EXPECT_TRUE(lse_ok.ok()) << lse_ok.message();
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaSweepTest, ::testing::ValuesIn(StandardSweep()),
                         [](const ::testing::TestParamInfo<SweepCase>& info) {
                           return info.param.name;
                         });

// The backward at head_dim 256 (the portable kernel on every GPU, one query stage of 151 KiB,
// dQ in two chunks of columns) under the tests above, the backward ones its point: lengths that
// end in partial tiles of 64, q != k both ways under causal masking, windows, GQA 2 to 8, a
// variable-length batch with empty sequences, padded strides (the element-wise loads). Small:
// the float64 reference runs on the host.
std::vector<SweepCase> Backward256Sweep() {
  constexpr DType f16 = DType::kF16, bf16 = DType::kBF16;
  const auto dense = [](std::string name, DType t, int batch, int64_t lq, int64_t lk, int hq,
                        int hk, bool causal) {
    return SweepCase{std::move(name), DenseProblem(t, batch, lq, lk, hq, hk, 256, causal)};
  };
  const auto window = [](SweepCase c, int left, int right) {
    c.problem.window_left = left;
    c.problem.window_right = right;
    return c;
  };
  std::vector<SweepCase> s;
  s.push_back(dense("len1_f16_d256", f16, 1, 1, 1, 2, 2, false));
  s.push_back(dense("len17_causal_bf16_d256_gqa2", bf16, 1, 17, 17, 4, 2, true));
  s.push_back(dense("len177_f16_d256_batch2", f16, 2, 177, 177, 2, 2, false));
  s.push_back(dense("len177_causal_bf16_d256", bf16, 1, 177, 177, 2, 2, true));
  s.push_back(dense("q17_k177_causal_f16_d256_gqa2", f16, 1, 17, 177, 4, 2, true));
  // The first 160 rows see no key.
  s.push_back(dense("q177_k17_causal_bf16_d256", bf16, 1, 177, 17, 2, 1, true));
  s.push_back(dense("q130_k300_bf16_d256_gqa4", bf16, 1, 130, 300, 4, 1, false));
  s.push_back(dense("q17_k300_f16_d256_gqa8", f16, 1, 17, 300, 8, 1, false));
  s.push_back(window(dense("window40_10_f16_d256_gqa2", f16, 1, 177, 200, 4, 2, false), 40, 10));
  s.push_back(window(dense("window64_causal_bf16_d256", bf16, 1, 300, 300, 2, 2, true), 64, 0));
  s.push_back(
      {"varlen_empty_causal_bf16_d256_gqa2",
       VarlenProblem(bf16, {0, 17, 1, 177, 0, 33}, {5, 17, 33, 177, 0, 0}, 4, 2, 256, true)});
  s.push_back(
      {"varlen_f16_d256_gqa2", VarlenProblem(f16, {33, 100, 7}, {50, 130, 1}, 4, 2, 256, false)});
  {
    SweepCase c = dense("dense_batch3_padded_f16_d256_gqa2", f16, 3, 64, 80, 4, 2, true);
    c.padded = true;
    s.push_back(c);
  }
  return s;
}

INSTANTIATE_TEST_SUITE_P(Backward256, CudaSweepTest, ::testing::ValuesIn(Backward256Sweep()),
                         [](const ::testing::TestParamInfo<SweepCase>& info) {
                           return info.param.name;
                         });

// The Hopper kernels pinned one at a time (FusedKernel), the warp-specialised one at both of its
// compiled tile shapes: on the standard sweep, and on problems long enough to wrap its stage
// rings many times, with tails at every tile width, causal and window skips, GQA and
// variable-length batches. Skips off Hopper (the launch answers UNIMPLEMENTED) and where the
// table has no such kernel (the lockstep one at head_dim 96 and 256).
class CudaHopperKernelTest : public CudaSweepTest {
 protected:
  // `shape` pins the TMA kernel's tile width and consumers (both 0 for the lockstep kernel).
  void RunPinned(cuda::FusedKernel kernel, cuda::Sm90TmaTileShape shape, int persistent_ctas = 0) {
    const SweepCase& c = GetParam();
    const AttentionProblem& p = c.problem;
    const uint8_t arch =
        kernel == cuda::FusedKernel::kSm90Lockstep ? cuda::kSm90a : cuda::kSm90aTma;
    if (!cuda::HasFusedKernel(Pass::kForward, p.dtype, p.head_dim, arch)) {
      GTEST_SKIP() << "no such Hopper kernel for this dtype and head_dim";
    }
    auto fused = MakeCudaFusedEngine(EngineOptions{}, kernel, {}, shape.block_n, persistent_ctas,
                                     shape.consumer_warpgroups);
    ASSERT_TRUE(fused.ok()) << fused.status();
    AttentionTensors t = AttentionTensors::Make(p, seed_, /*padded=*/false);
    absl::Status unavailable;
    RunAndCheck(**fused, p, t, &unavailable);
    if (!unavailable.ok()) GTEST_SKIP() << unavailable;
  }
};

TEST_P(CudaHopperKernelTest, LockstepMatchesReference) {
  SCOPED_TRACE(trace_);
  RunPinned(cuda::FusedKernel::kSm90Lockstep, {0, 0, 0});
}

TEST_P(CudaHopperKernelTest, TmaFullTileShapeMatchesReference) {
  SCOPED_TRACE(trace_);
  RunPinned(cuda::FusedKernel::kSm90Tma,
            cuda::Sm90TmaFusedTileShape(GetParam().problem.head_dim, /*masked=*/false));
}

TEST_P(CudaHopperKernelTest, TmaMaskedTileShapeMatchesReference) {
  SCOPED_TRACE(trace_);
  RunPinned(cuda::FusedKernel::kSm90Tma,
            cuda::Sm90TmaFusedTileShape(GetParam().problem.head_dim, /*masked=*/true));
}

// The warp-specialised kernel's persistent grid pinned to 1 and 3 CTAs, so that every CTA walks
// many query blocks (of several heads and sequences, paired under a causal mask): its rings,
// Q's buffer and the consumers' turns carry on from block to block.
TEST_P(CudaHopperKernelTest, TmaFullTileShapeOnOneCtaMatchesReference) {
  SCOPED_TRACE(trace_);
  RunPinned(cuda::FusedKernel::kSm90Tma,
            cuda::Sm90TmaFusedTileShape(GetParam().problem.head_dim, /*masked=*/false),
            /*persistent_ctas=*/1);
}

TEST_P(CudaHopperKernelTest, TmaMaskedTileShapeOnThreeCtasMatchesReference) {
  SCOPED_TRACE(trace_);
  RunPinned(cuda::FusedKernel::kSm90Tma,
            cuda::Sm90TmaFusedTileShape(GetParam().problem.head_dim, /*masked=*/true),
            /*persistent_ctas=*/3);
}

std::vector<SweepCase> HopperSweep() {
  constexpr DType f16 = DType::kF16, bf16 = DType::kBF16;
  std::vector<SweepCase> s = StandardSweep();
  const auto dense = [](std::string name, DType t, int batch, int64_t lq, int64_t lk, int hq,
                        int hk, int d, bool causal) {
    return SweepCase{std::move(name), DenseProblem(t, batch, lq, lk, hq, hk, d, causal)};
  };
  s.push_back(
      dense("long_q1013_k2011_bf16_d128_gqa2_batch2", bf16, 2, 1013, 2011, 2, 1, 128, false));
  s.push_back(dense("long_len2011_causal_f16_d128", f16, 1, 2011, 2011, 2, 2, 128, true));
  s.push_back(dense("long_len2500_bf16_d64", bf16, 1, 2500, 2500, 2, 2, 64, false));
  s.push_back(dense("long_len1013_causal_f16_d64_gqa4", f16, 1, 1013, 1013, 4, 1, 64, true));
  s.push_back(dense("long_q700_k300_causal_bf16_d64", bf16, 1, 700, 300, 2, 2, 64, true));
  s.push_back(dense("long_q256_k1024_causal_bf16_d128", bf16, 2, 256, 1024, 2, 2, 128, true));
  {
    SweepCase c = dense("long_window300_0_bf16_d64", bf16, 1, 1500, 1500, 2, 2, 64, false);
    c.problem.window_left = 300;
    c.problem.window_right = 0;
    s.push_back(c);
  }
  {
    SweepCase c = dense("long_window200_100_f16_d128", f16, 1, 1200, 1300, 2, 1, 128, false);
    c.problem.window_left = 200;
    c.problem.window_right = 100;
    s.push_back(c);
  }
  s.push_back({"long_varlen_f16_d64_gqa2",
               VarlenProblem(f16, {1, 300, 129, 1000}, {700, 5, 129, 1500}, 4, 2, 64, false)});
  s.push_back({"long_varlen_causal_bf16_d128",
               VarlenProblem(bf16, {128, 77, 513, 0}, {256, 900, 513, 10}, 2, 1, 128, true)});
  s.push_back({"long_varlen_bf16_d128_gqa4",
               VarlenProblem(bf16, {1200, 3, 400}, {1700, 353, 1}, 4, 1, 128, false)});
  // head_dim 96: the tiles of 128 with the copy engine's zero columns. 2011 keys are 11 full
  // tiles of 176 and a tail of 75 (15 of 128 and a tail of 91).
  s.push_back(dense("long_q1013_k2011_bf16_d96_gqa2_batch2", bf16, 2, 1013, 2011, 2, 1, 96, false));
  s.push_back(dense("long_len2011_causal_f16_d96", f16, 1, 2011, 2011, 2, 2, 96, true));
  s.push_back(dense("long_q700_k300_causal_bf16_d96", bf16, 1, 700, 300, 2, 2, 96, true));
  {
    SweepCase c = dense("long_window300_0_f16_d96_gqa2", f16, 1, 1500, 1500, 4, 2, 96, false);
    c.problem.window_left = 300;
    c.problem.window_right = 0;
    s.push_back(c);
  }
  s.push_back({"long_varlen_bf16_d96_gqa4",
               VarlenProblem(bf16, {1200, 0, 3, 400}, {1700, 50, 353, 1}, 4, 1, 96, false)});
  // head_dim 256: 2011 keys are 26 tiles of 80, 13 rounds of the 2-stage ring, the last tile a
  // tail of 11; 1013 rows end in a query block of 117.
  s.push_back(dense("long_q1013_k2011_f16_d256_gqa2_batch2", f16, 2, 1013, 2011, 2, 1, 256, false));
  s.push_back(dense("long_len2011_causal_bf16_d256", bf16, 1, 2011, 2011, 2, 2, 256, true));
  s.push_back(dense("long_q300_k1013_causal_f16_d256", f16, 2, 300, 1013, 2, 2, 256, true));
  {
    SweepCase c = dense("long_window200_100_bf16_d256", bf16, 1, 1200, 1300, 2, 1, 256, false);
    c.problem.window_left = 200;
    c.problem.window_right = 100;
    s.push_back(c);
  }
  s.push_back({"long_varlen_causal_f16_d256_gqa2",
               VarlenProblem(f16, {128, 77, 0, 513, 33}, {256, 900, 10, 513, 0}, 4, 2, 256, true)});
  return s;
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaHopperKernelTest, ::testing::ValuesIn(HopperSweep()),
                         [](const ::testing::TestParamInfo<SweepCase>& info) {
                           return info.param.name;
                         });

// The Hopper backward pinned (FusedKernel::kSm90Tma) on the Hopper sweep, and its deterministic
// mode: correct, and the same bytes from two runs on the same inputs. Skips off Hopper.
class CudaHopperBackwardTest : public CudaSweepTest {
 protected:
  // Whether the table has a Hopper backward for the problem.
  bool Covered() const {
    const AttentionProblem& p = GetParam().problem;
    return cuda::HasFusedKernel(Pass::kBackward, p.dtype, p.head_dim, cuda::kSm90aTma);
  }
  std::unique_ptr<Engine> PinnedEngine() {
    auto fused = MakeCudaFusedEngine(EngineOptions{}, cuda::FusedKernel::kSm90Tma);
    EXPECT_TRUE(fused.ok()) << fused.status();
    return fused.ok() ? std::move(*fused) : nullptr;
  }
};

TEST_P(CudaHopperBackwardTest, MatchesReference) {
  SCOPED_TRACE(trace_);
  if (!Covered()) GTEST_SKIP() << "no Hopper backward for this dtype and head_dim";
  std::unique_ptr<Engine> engine = PinnedEngine();
  if (engine == nullptr) return;
  absl::Status unavailable;
  RunBackwardAndCheck(*engine, GetParam(), /*deterministic=*/false, nullptr, &unavailable);
  if (!unavailable.ok()) GTEST_SKIP() << unavailable;
}

TEST_P(CudaHopperBackwardTest, DeterministicModeRepeatsItsBytes) {
  SCOPED_TRACE(trace_);
  if (!Covered()) GTEST_SKIP() << "no Hopper backward for this dtype and head_dim";
  std::unique_ptr<Engine> engine = PinnedEngine();
  if (engine == nullptr) return;
  if (!CheckDeterministicBackward(*engine)) GTEST_SKIP() << "the Hopper backward cannot run here";
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaHopperBackwardTest, ::testing::ValuesIn(HopperSweep()),
                         [](const ::testing::TestParamInfo<SweepCase>& info) {
                           return info.param.name;
                         });
// head_dim 256's own kernel (64 keys a CTA, shared by the two consumer warpgroups) on the
// short cases of every shape.
INSTANTIATE_TEST_SUITE_P(Backward256, CudaHopperBackwardTest,
                         ::testing::ValuesIn(Backward256Sweep()),
                         [](const ::testing::TestParamInfo<SweepCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace attn::testing
