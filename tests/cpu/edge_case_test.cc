// Edge cases both CPU engines must handle identically: empty batches and sequences, rows that
// see no key, NaN/Inf inputs, and any thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <ostream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "common/host_tensor.h"
#include "gtest/gtest.h"

namespace attn {
// GoogleTest prints engine kinds by name.
inline void PrintTo(EngineKind kind, std::ostream* os) { *os << EngineKindName(kind); }
}  // namespace attn

namespace attn::testing {
namespace {

constexpr EngineKind kCpuKinds[] = {EngineKind::kCpuReference, EngineKind::kCpuTiled};

std::unique_ptr<Engine> MustCreate(EngineKind kind, int threads = 0) {
  EngineOptions options;
  options.num_threads = threads;
  auto engine = CreateEngine(kind, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

class CpuEdgeTest : public ::testing::TestWithParam<EngineKind> {
 protected:
  std::unique_ptr<Engine> engine_ = MustCreate(GetParam());
};

TEST_P(CpuEdgeTest, DescribesItself) {
  EXPECT_EQ(engine_->kind(), GetParam());
  EXPECT_EQ(engine_->memory_space(), MemorySpace::kHost);
  EXPECT_EQ(engine_->name(), EngineKindName(GetParam()));
}

TEST_P(CpuEdgeTest, EmptyBatchNeedsNoPointers) {
  const AttentionProblem p = DenseProblem(DType::kBF16, 3, 0, 0, 4, 2, 64, true);
  EXPECT_TRUE(engine_->SupportsForward(p).ok());
  EXPECT_TRUE(engine_->Forward(p, ForwardArgs{}).ok());
  EXPECT_TRUE(engine_->Backward(p, BackwardArgs{}).ok());
}

// Sequences without keys: every row sees nothing, so O = 0, LSE = -inf, dQ = 0.
TEST_P(CpuEdgeTest, SequenceWithoutKeys) {
  const AttentionProblem p = VarlenProblem(DType::kF16, {5, 3}, {0, 4}, 2, 1, 32);
  AttentionTensors t = AttentionTensors::Make(p, FreshSeed());
  t.PoisonOutputs();
  ASSERT_TRUE(engine_->Forward(p, t.forward_args()).ok());
  ASSERT_TRUE(engine_->Backward(p, t.backward_args()).ok());
  EXPECT_EQ(t.o.CountPoisoned() + t.dq.CountPoisoned() + t.dk.CountPoisoned() +
                t.dv.CountPoisoned() + CountPoisonedFloats(t.lse),
            0);
  for (int h = 0; h < 2; ++h) {
    for (int64_t tok = 0; tok < 5; ++tok) {
      EXPECT_EQ(t.lse[h * p.total_q() + tok], -std::numeric_limits<float>::infinity());
      for (int c = 0; c < 32; ++c) {
        EXPECT_EQ(t.o.Get(tok, h, c), 0.f);
        EXPECT_EQ(t.dq.Get(tok, h, c), 0.f);
      }
    }
  }
}

// Causal with more queries than keys: the first Lq - Lk rows see no key.
TEST_P(CpuEdgeTest, FullyMaskedRowsGiveZeroAndMinusInfinity) {
  const AttentionProblem p = DenseProblem(DType::kBF16, 2, 70, 9, 2, 2, 64, true);
  AttentionTensors t = AttentionTensors::Make(p, FreshSeed());
  t.PoisonOutputs();
  ASSERT_TRUE(engine_->Forward(p, t.forward_args()).ok());
  ASSERT_TRUE(engine_->Backward(p, t.backward_args()).ok());
  for (int b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 70; ++i) {
      const int64_t tok = b * 70 + i;
      const bool masked = i < 70 - 9;
      for (int h = 0; h < 2; ++h) {
        const float lse = t.lse[h * p.total_q() + tok];
        if (masked) {
          EXPECT_EQ(lse, -std::numeric_limits<float>::infinity()) << "row " << tok;
        } else {
          EXPECT_TRUE(std::isfinite(lse)) << "row " << tok;
        }
        for (int c = 0; c < 64; ++c) {
          if (masked) {
            ASSERT_EQ(t.o.Get(tok, h, c), 0.f) << "row " << tok;
            ASSERT_EQ(t.dq.Get(tok, h, c), 0.f) << "row " << tok;
          } else {
            ASSERT_TRUE(std::isfinite(t.o.Get(tok, h, c))) << "row " << tok;
          }
        }
      }
    }
  }
}

bool RowHasNaN(const HostTensor& t, int64_t tok, int h) {
  for (int c = 0; c < t.head_dim(); ++c) {
    if (std::isnan(t.Get(tok, h, c))) return true;
  }
  return false;
}
bool RowAllFinite(const HostTensor& t, int64_t tok, int h) {
  for (int c = 0; c < t.head_dim(); ++c) {
    if (!std::isfinite(t.Get(tok, h, c))) return false;
  }
  return true;
}

// A NaN reaches exactly the outputs that depend on it: one query row, or the rows that see one
// key (causal: the rows at and after it), and nothing else.
TEST_P(CpuEdgeTest, NaNPropagatesOnlyWhereItIsSeen) {
  constexpr int64_t kLen = 150;
  const AttentionProblem p = DenseProblem(DType::kF32, 1, kLen, kLen, 1, 1, 32, true);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const char* where : {"q", "k", "v"}) {
    SCOPED_TRACE(where);
    AttentionTensors t = AttentionTensors::Make(p, FreshSeed());
    constexpr int64_t kPoisoned = 90;
    (where[0] == 'q' ? t.q : where[0] == 'k' ? t.k : t.v).Set(kPoisoned, 0, 5, nan);
    t.PoisonOutputs();
    ASSERT_TRUE(engine_->Forward(p, t.forward_args()).ok());
    ASSERT_TRUE(engine_->Backward(p, t.backward_args()).ok());
    for (int64_t i = 0; i < kLen; ++i) {
      const bool sees = where[0] == 'q' ? i == kPoisoned : i >= kPoisoned;
      if (sees) {
        EXPECT_TRUE(RowHasNaN(t.o, i, 0)) << "O row " << i;
      } else {
        EXPECT_TRUE(RowAllFinite(t.o, i, 0)) << "O row " << i;
        EXPECT_TRUE(std::isfinite(t.lse[i])) << "LSE row " << i;
      }
    }
    // dK/dV of keys before any row that saw the NaN input only see clean rows when the NaN is in
    // a key or value (rows < kPoisoned neither see key kPoisoned nor carry NaN).
    if (where[0] != 'q') {
      EXPECT_TRUE(RowAllFinite(t.dq, 0, 0));
      EXPECT_TRUE(RowHasNaN(t.dk, kPoisoned, 0) || RowHasNaN(t.dv, kPoisoned, 0));
    }
  }
}

TEST_P(CpuEdgeTest, InfiniteInputsDoNotCrash) {
  const AttentionProblem p = DenseProblem(DType::kBF16, 1, 40, 40, 2, 1, 16, false);
  AttentionTensors t = AttentionTensors::Make(p, FreshSeed());
  const float inf = std::numeric_limits<float>::infinity();
  t.q.Set(3, 0, 0, inf);
  t.k.Set(7, 0, 1, -inf);
  t.v.Set(9, 0, 2, inf);
  t.PoisonOutputs();
  EXPECT_TRUE(engine_->Forward(p, t.forward_args()).ok());
  EXPECT_TRUE(engine_->Backward(p, t.backward_args()).ok());
  EXPECT_EQ(
      t.o.CountPoisoned() + t.dq.CountPoisoned() + t.dk.CountPoisoned() + t.dv.CountPoisoned(), 0);
}

INSTANTIATE_TEST_SUITE_P(Engines, CpuEdgeTest, ::testing::ValuesIn(kCpuKinds),
                         [](const ::testing::TestParamInfo<EngineKind>& info) {
                           return std::string(EngineKindName(info.param));
                         });

// The forward of each (query block, head) item is independent of the schedule, so any thread
// count gives bit-identical O and LSE; the backward's dQ summation order may differ in the last
// bits, dK and dV may not.
TEST(CpuTiledThreadsTest, ThreadCountDoesNotChangeResults) {
  AttentionProblem p = VarlenProblem(DType::kF32, {200, 3, 77}, {150, 64, 300}, 4, 2, 64, true);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  AttentionTensors base = AttentionTensors::Make(p, seed);
  auto one = MustCreate(EngineKind::kCpuTiled, 1);
  ASSERT_TRUE(one->Forward(p, base.forward_args()).ok());
  ASSERT_TRUE(one->Backward(p, base.backward_args()).ok());
  for (int threads : {2, 3, 7}) {
    SCOPED_TRACE(absl::StrCat("threads=", threads));
    AttentionTensors t = AttentionTensors::Make(p, seed);
    auto engine = MustCreate(EngineKind::kCpuTiled, threads);
    t.PoisonOutputs();
    ASSERT_TRUE(engine->Forward(p, t.forward_args()).ok());
    ASSERT_TRUE(engine->Backward(p, t.backward_args()).ok());
    EXPECT_EQ(t.o.ToDouble(), base.o.ToDouble());
    EXPECT_EQ(t.lse, base.lse);
    EXPECT_EQ(t.dk.ToDouble(), base.dk.ToDouble());
    EXPECT_EQ(t.dv.ToDouble(), base.dv.ToDouble());
    const std::vector<double> dq = t.dq.ToDouble(), dq1 = base.dq.ToDouble();
    for (size_t i = 0; i < dq.size(); ++i) {
      ASSERT_NEAR(dq[i], dq1[i], 1e-5 * (1 + std::abs(dq1[i]))) << "dq element " << i;
    }
  }
}

// BackwardArgs::deterministic: every dQ row sums its key blocks' contributions in key-block
// order, so dQ, dK and dV are bit-identical for any thread count and from run to run. The
// sequences span several key blocks (kBackwardKeys), whose dQ contributions otherwise race.
TEST(CpuTiledThreadsTest, DeterministicBackwardIsBitIdenticalForAnyThreadCount) {
  AttentionProblem p = VarlenProblem(DType::kF32, {300, 5, 520}, {600, 64, 700}, 4, 1, 32, false);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  auto backward = [&](Engine& engine, bool deterministic) {
    AttentionTensors t = AttentionTensors::Make(p, seed);
    t.PoisonOutputs();
    EXPECT_TRUE(engine.Forward(p, t.forward_args()).ok());
    BackwardArgs args = t.backward_args();
    args.deterministic = deterministic;
    EXPECT_TRUE(engine.Backward(p, args).ok());
    EXPECT_EQ(t.dq.CountPoisoned() + t.dk.CountPoisoned() + t.dv.CountPoisoned(), 0);
    return t;
  };
  // The first element that differs, or -1.
  auto first_difference = [](const HostTensor& got, const HostTensor& want) {
    const std::vector<double> a = got.ToDouble(), b = want.ToDouble();
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i] != b[i]) return static_cast<int64_t>(i);
    }
    return a.size() == b.size() ? int64_t{-1} : static_cast<int64_t>(std::min(a.size(), b.size()));
  };
  auto one = MustCreate(EngineKind::kCpuTiled, 1);
  const AttentionTensors base = backward(*one, true);
  // One thread adds in key-block order anyway: the fixed order computes the same gradients.
  const AttentionTensors plain = backward(*one, false);
  EXPECT_EQ(first_difference(plain.dq, base.dq), -1) << "dq element";
  for (int threads : {2, 3, 7}) {
    auto engine = MustCreate(EngineKind::kCpuTiled, threads);
    for (int run = 0; run < 3; ++run) {
      SCOPED_TRACE(absl::StrCat("threads=", threads, " run=", run));
      const AttentionTensors t = backward(*engine, true);
      EXPECT_EQ(first_difference(t.dq, base.dq), -1) << "dq element";
      EXPECT_EQ(first_difference(t.dk, base.dk), -1) << "dk element";
      EXPECT_EQ(first_difference(t.dv, base.dv), -1) << "dv element";
    }
  }
}

}  // namespace
}  // namespace attn::testing
