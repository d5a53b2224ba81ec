// The naive CUDA path beyond the sweep: workspace limits (RESOURCE_EXHAUSTED, chunked runs),
// NaN propagation, empty problems, calls without an LSE, alternating streams. Every test
// skips when there is no CUDA device, except the factory test, which checks the skip reason.
#include <cuda_runtime_api.h>

#include <cmath>
#include <memory>

#include "absl/strings/match.h"
#include "attn/engine.h"
#include "common/accuracy.h"
#include "common/host_tensor.h"
#include "common/naive_attention.h"
#include "common/reference.h"
#include "cuda/naive/naive_engine.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"

namespace attn::testing {
namespace {

TEST(CudaEngineFactory, UnavailableWithoutDeviceOtherwiseCreated) {
  for (EngineKind kind : {EngineKind::kCudaFused, EngineKind::kCudaNaive}) {
    auto engine = CreateEngine(kind);
    if (NoDeviceReason().empty()) {
      ASSERT_TRUE(engine.ok()) << engine.status();
      EXPECT_EQ((*engine)->kind(), kind);
      EXPECT_EQ((*engine)->memory_space(), MemorySpace::kDevice);
    } else {
      EXPECT_EQ(engine.status().code(), absl::StatusCode::kUnavailable) << engine.status();
    }
  }
}

TEST(CudaNaive, WorkspaceFormula) {
  const AttentionProblem p = DenseProblem(DType::kBF16, 3, 177, 200, 4, 2, 64);
  const cuda::NaiveWorkspace w = cuda::NaiveWorkspaceBytes(p);
  EXPECT_GE(w.min_bytes, 177 * 200 * 4);
  EXPECT_GE(w.full_bytes, int64_t{3} * 4 * 177 * 200 * 4);
  EXPECT_LT(w.full_bytes, int64_t{3} * 4 * 177 * 200 * 4 + (1 << 20));
}

// Runs the naive engine with `options` on p and checks it against the reference.
void ExpectNaiveMatches(const AttentionProblem& p, const EngineOptions& options, uint64_t seed) {
  auto engine = MustCreate(EngineKind::kCudaNaive, options);
  ASSERT_NE(engine, nullptr);
  AttentionTensors t = AttentionTensors::Make(p, seed);
  auto ref = RunReference(p, t, /*backward=*/false);
  ASSERT_TRUE(ref.ok()) << ref.status();
  t.PoisonOutputs();
  auto device = DeviceForward::Upload(t);
  ASSERT_TRUE(device.ok()) << device.status();
  ASSERT_TRUE(engine->Forward(p, device->args()).ok());
  ASSERT_TRUE(device->Download(t).ok());
  EXPECT_EQ(t.o.CountPoisoned(), 0);
  EXPECT_EQ(CountPoisonedFloats(t.lse), 0);
  NaiveForwardResult naive;
  if (p.dtype != DType::kF32) naive = NaiveForward(p, t.q, t.k, t.v);
  const absl::Status o_ok = CheckAccuracy("O", p.dtype, t.o.ToDouble(), ref->o, &naive.o);
  EXPECT_TRUE(o_ok.ok()) << o_ok.message();
  const absl::Status lse_ok = CheckLse(t.lse, ref->lse);
  EXPECT_TRUE(lse_ok.ok()) << lse_ok.message();
}

TEST(CudaNaive, ResourceExhaustedUnderSmallLimitLeavesOutputsAlone) {
  ATTN_SKIP_WITHOUT_CUDA();
  EngineOptions options;
  options.workspace_limit_bytes = int64_t{1} << 20;  // one 1013 x 1013 float32 matrix is 4 MB
  auto engine = MustCreate(EngineKind::kCudaNaive, options);
  ASSERT_NE(engine, nullptr);
  const AttentionProblem p = DenseProblem(DType::kF16, 1, 1013, 1013, 2, 2, 64);
  const Support supports = engine->SupportsForward(p);
  EXPECT_EQ(supports.reason(), Refusal::kTooLarge) << supports;
  EXPECT_EQ(supports.status().code(), absl::StatusCode::kResourceExhausted) << supports;
  AttentionTensors t = AttentionTensors::Make(p, FreshSeed());
  t.PoisonOutputs();
  auto device = DeviceForward::Upload(t);
  ASSERT_TRUE(device.ok()) << device.status();
  const absl::Status run = engine->Forward(p, device->args());
  EXPECT_EQ(run.code(), absl::StatusCode::kResourceExhausted) << run;
  EXPECT_TRUE(absl::StrContains(run.message(), "1013 x 1013")) << run;
  EXPECT_TRUE(absl::StrContains(run.message(), "workspace_limit_bytes")) << run;
  ASSERT_TRUE(device->Download(t).ok());
  EXPECT_EQ(t.o.CountPoisoned(), t.o.num_elements()) << "O written by a refused call";
  // A smaller problem still runs on the same engine afterwards.
  const AttentionProblem small = DenseProblem(DType::kF16, 1, 177, 177, 2, 2, 64);
  EXPECT_TRUE(engine->SupportsForward(small).ok());
}

TEST(CudaNaive, ChunkedUnderTightLimitMatchesReference) {
  ATTN_SKIP_WITHOUT_CUDA();
  // 3 sequences x 4 heads = 12 score matrices of 177 x 200; room for about 3 at a time.
  const AttentionProblem p = DenseProblem(DType::kBF16, 3, 177, 200, 4, 2, 64, true);
  EngineOptions options;
  options.workspace_limit_bytes = cuda::NaiveWorkspaceBytes(p).min_bytes + 2 * 177 * 200 * 4;
  ExpectNaiveMatches(p, options, FreshSeed());
}

TEST(CudaNaive, LargeGroupAndOddHeadDims) {
  ATTN_SKIP_WITHOUT_CUDA();
  const uint64_t seed = FreshSeed();
  for (int d : {1, 7, 33, 200}) {
    SCOPED_TRACE(::testing::Message() << "head_dim=" << d << " seed=" << seed);
    ExpectNaiveMatches(DenseProblem(DType::kF16, 2, 33, 45, 16, 1, d, false), {}, seed);
  }
}

TEST(CudaNaive, NanPropagatesToItsRowOnly) {
  ATTN_SKIP_WITHOUT_CUDA();
  auto engine = MustCreate(EngineKind::kCudaNaive);
  ASSERT_NE(engine, nullptr);
  const AttentionProblem p = DenseProblem(DType::kF32, 1, 17, 17, 2, 2, 32);
  AttentionTensors t = AttentionTensors::Make(p, FreshSeed());
  t.q.Set(5, 1, 3, NAN);  // query token 5, head 1
  t.PoisonOutputs();
  auto device = DeviceForward::Upload(t);
  ASSERT_TRUE(device.ok()) << device.status();
  ASSERT_TRUE(engine->Forward(p, device->args()).ok());
  ASSERT_TRUE(device->Download(t).ok());
  for (int64_t token = 0; token < 17; ++token) {
    for (int h = 0; h < 2; ++h) {
      const bool nan_row = token == 5 && h == 1;
      EXPECT_EQ(std::isnan(t.o.Get(token, h, 0)), nan_row) << token << "," << h;
      EXPECT_EQ(std::isnan(t.lse[h * 17 + token]), nan_row) << token << "," << h;
    }
  }
}

TEST(CudaNaive, EmptyProblemAndNoLse) {
  ATTN_SKIP_WITHOUT_CUDA();
  auto engine = MustCreate(EngineKind::kCudaNaive);
  ASSERT_NE(engine, nullptr);
  const AttentionProblem empty = VarlenProblem(DType::kBF16, {0, 0}, {0, 5}, 2, 2, 64);
  ForwardArgs none;
  none.k = {reinterpret_cast<const void*>(16), 128, 64};
  none.v = none.k;
  // No query: nothing to compute, and the (fake) key pointers are never touched.
  EXPECT_TRUE(engine->Forward(empty, none).ok());
  const AttentionProblem p = DenseProblem(DType::kBF16, 2, 17, 33, 2, 1, 64, true);
  AttentionTensors t = AttentionTensors::Make(p, FreshSeed());
  t.PoisonOutputs();
  auto device = DeviceForward::Upload(t);
  ASSERT_TRUE(device.ok()) << device.status();
  ASSERT_TRUE(engine->Forward(p, device->args(nullptr, /*with_lse=*/false)).ok());
  ASSERT_TRUE(device->Download(t).ok());
  EXPECT_EQ(t.o.CountPoisoned(), 0);
  EXPECT_EQ(CountPoisonedFloats(t.lse), static_cast<int64_t>(t.lse.size()))
      << "LSE written although not asked for";
}

TEST(CudaNaive, AlternatingStreamsShareTheWorkspaceSafely) {
  ATTN_SKIP_WITHOUT_CUDA();
  auto engine = MustCreate(EngineKind::kCudaNaive);
  ASSERT_NE(engine, nullptr);
  const AttentionProblem p = DenseProblem(DType::kF16, 2, 177, 177, 4, 4, 64);
  const uint64_t seed = FreshSeed();
  AttentionTensors a = AttentionTensors::Make(p, seed);
  AttentionTensors b = AttentionTensors::Make(p, seed + 1);
  auto ref_a = RunReference(p, a, false);
  auto ref_b = RunReference(p, b, false);
  ASSERT_TRUE(ref_a.ok() && ref_b.ok());
  a.PoisonOutputs();
  b.PoisonOutputs();
  auto da = DeviceForward::Upload(a);
  auto db = DeviceForward::Upload(b);
  ASSERT_TRUE(da.ok() && db.ok());
  cudaStream_t s1 = nullptr, s2 = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), cudaSuccess);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(engine->Forward(p, da->args(s1)).ok());
    ASSERT_TRUE(engine->Forward(p, db->args(s2)).ok());
  }
  ASSERT_TRUE(da->Download(a).ok());
  ASSERT_TRUE(db->Download(b).ok());
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
  const NaiveForwardResult na = NaiveForward(p, a.q, a.k, a.v);
  const NaiveForwardResult nb = NaiveForward(p, b.q, b.k, b.v);
  EXPECT_TRUE(CheckAccuracy("O(a)", p.dtype, a.o.ToDouble(), ref_a->o, &na.o).ok());
  EXPECT_TRUE(CheckAccuracy("O(b)", p.dtype, b.o.ToDouble(), ref_b->o, &nb.o).ok());
}

TEST(CudaNaive, BackwardUnderTightLimitAndEmptyQueries) {
  ATTN_SKIP_WITHOUT_CUDA();
  // Chunked (room for about 3 of 12 score-matrix pairs), and a sequence with keys but no
  // queries, whose dK and dV must come out zero.
  const AttentionProblem p =
      VarlenProblem(DType::kBF16, {177, 177, 0, 177}, {200, 200, 31, 200}, 4, 2, 64, true);
  EngineOptions options;
  options.workspace_limit_bytes =
      cuda::NaiveWorkspaceBytes(p).min_bytes * 2 + p.total_k() * 4 * 64 * 4 * 2 + 4 * 177 * 200 * 8;
  auto engine = MustCreate(EngineKind::kCudaNaive, options);
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->SupportsBackward(p).ok()) << engine->SupportsBackward(p);
  AttentionTensors t = AttentionTensors::Make(p, FreshSeed());
  auto ref = RunReference(p, t, /*backward=*/true);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto device = DeviceBackward::UploadAfterForward(p, t);
  ASSERT_TRUE(device.ok()) << device.status();
  ASSERT_TRUE(engine->Backward(p, device->args()).ok());
  ASSERT_TRUE(device->Download(t).ok());
  const NaiveBackwardResult plain = NaiveBackward(p, t.q, t.k, t.v, t.d_o);
  EXPECT_EQ(t.dk.CountPoisoned() + t.dv.CountPoisoned() + t.dq.CountPoisoned(), 0);
  EXPECT_TRUE(CheckAccuracy("dQ", p.dtype, t.dq.ToDouble(), ref->dq, &plain.dq).ok());
  EXPECT_TRUE(CheckAccuracy("dK", p.dtype, t.dk.ToDouble(), ref->dk, &plain.dk).ok());
  EXPECT_TRUE(CheckAccuracy("dV", p.dtype, t.dv.ToDouble(), ref->dv, &plain.dv).ok());
  for (int64_t token = 400; token < 431; ++token) {  // sequence 2's keys
    EXPECT_EQ(t.dk.Get(token, 1, 5), 0.f) << token;
    EXPECT_EQ(t.dv.Get(token, 0, 7), 0.f) << token;
  }
}

}  // namespace
}  // namespace attn::testing
