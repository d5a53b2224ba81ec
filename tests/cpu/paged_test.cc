// The forward over paged K/V (attn/paged_kv.h) on the CPU engines: the tiled engine's paged pass
// and the reference's gather, against the float64 reference of the same problem with dense K/V,
// under the accuracy rule; the tiled paged pass must also equal the tiled dense pass bit for
// bit (only where rows are found differs). Blocks land in shuffled pages between poisoned spare
// pages; outputs are poisoned before each call.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "common/accuracy.h"
#include "common/host_tensor.h"
#include "common/naive_attention.h"
#include "common/paged_kv.h"
#include "common/reference.h"
#include "gtest/gtest.h"

namespace attn::testing {
namespace {

struct PagedCase {
  std::string name;
  AttentionProblem problem;
  int page_tokens;
};

std::vector<PagedCase> Cases() {
  std::vector<PagedCase> cases;
  auto add = [&](std::string name, AttentionProblem p, int page_tokens) {
    cases.push_back({std::move(name), std::move(p), page_tokens});
  };
  // Decode steps: one query row per sequence over contexts that end mid-page.
  AttentionProblem decode =
      VarlenProblem(DType::kBF16, {1, 1, 1, 1}, {1, 17, 100, 257}, 8, 2, 64, /*causal=*/true);
  add("decode_bf16_gqa4_p16", decode, 16);
  add("decode_bf16_gqa4_p1", decode, 1);
  // A prefill chunk over a longer cache: bottom-right causal, odd sizes.
  add("prefill_f16_causal_p16",
      VarlenProblem(DType::kF16, {7, 33}, {40, 177}, 4, 4, 32, /*causal=*/true), 16);
  AttentionProblem window = VarlenProblem(DType::kF32, {5, 1}, {64, 1013}, 6, 3, 96, true);
  window.window_left = 50;
  add("window_f32_p64", window, 64);
  add("empty_sequence_f16_p4", VarlenProblem(DType::kF16, {3, 2}, {0, 9}, 2, 1, 16, false), 4);
  add("mqa_bf16_p32_d128", VarlenProblem(DType::kBF16, {2}, {300}, 16, 1, 128, false), 32);
  return cases;
}

class PagedForwardTest : public ::testing::TestWithParam<PagedCase> {};

std::unique_ptr<Engine> MustCreate(EngineKind kind) {
  EngineOptions options;
  options.num_threads = 2;
  auto engine = CreateEngine(kind, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

TEST_P(PagedForwardTest, MatchesTheDenseProblem) {
  const PagedCase& c = GetParam();
  const AttentionProblem& p = c.problem;
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed=", seed, " ", p.DebugString(), " page_tokens=", c.page_tokens));
  AttentionTensors t = AttentionTensors::Make(p, seed);
  const PagedKvCopy pages = PagedKvCopy::Make(p, t.k, t.v, c.page_tokens, seed + 1);
  auto ref = RunReference(p, t, /*backward=*/false);
  ASSERT_TRUE(ref.ok()) << ref.status();
  NaiveForwardResult naive;
  if (p.dtype != DType::kF32) naive = NaiveForward(p, t.q, t.k, t.v);

  std::unique_ptr<Engine> tiled = MustCreate(EngineKind::kCpuTiled);
  ASSERT_TRUE(tiled->SupportsPagedForward(p).ok());
  t.PoisonOutputs();
  ASSERT_TRUE(tiled->Forward(p, t.forward_args()).ok());
  const HostTensor dense_o = t.o;
  const std::vector<float> dense_lse = t.lse;

  for (EngineKind kind : {EngineKind::kCpuTiled, EngineKind::kCpuReference}) {
    std::unique_ptr<Engine> engine = MustCreate(kind);
    SCOPED_TRACE(std::string(engine->name()));
    t.PoisonOutputs();
    PagedForwardArgs args;
    args.q = t.q.ref();
    args.kv = pages.view();
    args.o = t.o.mutable_ref();
    args.lse = t.lse.data();
    const absl::Status run = engine->ForwardPaged(p, args);
    ASSERT_TRUE(run.ok()) << run;
    EXPECT_EQ(t.o.CountPoisoned(), 0);
    EXPECT_EQ(CountPoisonedFloats(t.lse), 0);
    const absl::Status o_ok = CheckAccuracy("O", p.dtype, t.o.ToDouble(), ref->o, &naive.o);
    EXPECT_TRUE(o_ok.ok()) << o_ok;
    std::vector<double> lse(t.lse.begin(), t.lse.end());
    const absl::Status lse_ok = CheckAccuracy("LSE", DType::kF32, lse, ref->lse, nullptr, kLseRtol);
    EXPECT_TRUE(lse_ok.ok()) << lse_ok;
    if (kind == EngineKind::kCpuTiled) {
      EXPECT_EQ(std::memcmp(t.o.data(), dense_o.data(), dense_o.size_bytes()), 0)
          << "the paged pass differs from the dense one";
      EXPECT_EQ(std::memcmp(t.lse.data(), dense_lse.data(), dense_lse.size() * sizeof(float)), 0);
    }
  }
}

TEST(PagedForward, RefusesBadGeometry) {
  const AttentionProblem p = VarlenProblem(DType::kF16, {1}, {40}, 2, 1, 16, false);
  AttentionTensors t = AttentionTensors::Make(p, 1);
  const PagedKvCopy pages = PagedKvCopy::Make(p, t.k, t.v, 16, 2);
  std::unique_ptr<Engine> engine = MustCreate(EngineKind::kCpuTiled);
  PagedForwardArgs args;
  args.q = t.q.ref();
  args.o = t.o.mutable_ref();
  auto expect_refused = [&](PagedKV kv, const std::string& field) {
    args.kv = kv;
    const absl::Status s = engine->ForwardPaged(p, args);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StartsWith(s.message(), field)) << s;
  };
  PagedKV kv = pages.view();
  kv.page_tokens = 12;
  expect_refused(kv, "kv.page_tokens");
  kv = pages.view();
  kv.page_stride = 10;
  expect_refused(kv, "kv.page_stride");
  kv = pages.view();
  kv.max_blocks = 2;  // 40 keys need 3 blocks of 16
  expect_refused(kv, "kv.max_blocks");
  // The naive CUDA path and engines without a paged pass refuse it by name.
  EXPECT_FALSE(EngineSupports(EngineKind::kCudaNaive, Pass::kPagedForward, p).ok());
  EXPECT_TRUE(EngineSupports(EngineKind::kCpuTiled, Pass::kPagedForward, p).ok());
}

INSTANTIATE_TEST_SUITE_P(Paged, PagedForwardTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<PagedCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace attn::testing
