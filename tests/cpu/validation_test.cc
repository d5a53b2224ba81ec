// Both CPU engines reject malformed problems and views with INVALID_ARGUMENT and a message that
// names the offending field, before touching any memory.
#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "attn/engine.h"
#include "common/host_tensor.h"
#include "gtest/gtest.h"

namespace attn {
// GoogleTest prints engine kinds by name.
inline void PrintTo(EngineKind kind, std::ostream* os) { *os << EngineKindName(kind); }
}  // namespace attn

namespace attn::testing {
namespace {

struct BadCase {
  std::string name;
  std::string field;  // must appear in the message
  bool backward;      // checked through Backward (else Forward)
  std::function<void(AttentionProblem&, ForwardArgs&, BackwardArgs&)> corrupt;
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

std::vector<BadCase> BadCases() {
  return {
      {"kv_heads_ratio", "num_kv_heads", false,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) { p.num_kv_heads = 3; }},
      {"zero_heads", "num_heads", false,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) { p.num_heads = 0; }},
      {"head_dim_zero", "head_dim", false,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) { p.head_dim = 0; }},
      {"head_dim_too_large", "head_dim", true,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) { p.head_dim = 257; }},
      {"bad_dtype", "dtype", false,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) { p.dtype = static_cast<DType>(9); }},
      {"cu_seqlens_q_decreasing", "cu_seqlens_q", false,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) {
         p.cu_seqlens_q = {0, 20, 10};
       }},
      {"cu_seqlens_q_not_from_zero", "cu_seqlens_q", true,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) {
         p.cu_seqlens_q = {1, 8, 16};
       }},
      {"cu_seqlens_k_wrong_size", "cu_seqlens_k", false,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) {
         p.cu_seqlens_k = {0, 8};
       }},
      {"cu_seqlens_k_decreasing", "cu_seqlens_k", true,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) {
         p.cu_seqlens_k = {0, 8, 4};
       }},
      {"no_sequences", "cu_seqlens_q", false,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) { p.cu_seqlens_q = {0}; }},
      {"negative_scale", "softmax_scale", false,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) { p.softmax_scale = -1.f; }},
      {"causal_with_right_window", "window_right", false,
       [](AttentionProblem& p, ForwardArgs&, BackwardArgs&) {
         p.causal = true;
         p.window_right = 4;
       }},
      {"null_q", "q", false,
       [](AttentionProblem&, ForwardArgs& f, BackwardArgs&) { f.q.data = nullptr; }},
      {"null_v_backward", "v", true,
       [](AttentionProblem&, ForwardArgs&, BackwardArgs& b) { b.v.data = nullptr; }},
      {"null_o", "o", false,
       [](AttentionProblem&, ForwardArgs& f, BackwardArgs&) { f.o.data = nullptr; }},
      {"null_dk", "dk", true,
       [](AttentionProblem&, ForwardArgs&, BackwardArgs& b) { b.dk.data = nullptr; }},
      {"overlapping_token_stride", "token_stride", false,
       [](AttentionProblem&, ForwardArgs& f, BackwardArgs&) { f.k.token_stride = 64; }},
      {"overlapping_head_stride", "head_stride", false,
       [](AttentionProblem&, ForwardArgs& f, BackwardArgs&) { f.q.head_stride = 32; }},
      {"overlapping_dq_stride", "token_stride", true,
       [](AttentionProblem&, ForwardArgs&, BackwardArgs& b) { b.dq.token_stride = 100; }},
      {"missing_lse", "lse", true,
       [](AttentionProblem&, ForwardArgs&, BackwardArgs& b) { b.lse = nullptr; }},
  };
}

class CpuValidationTest : public ::testing::TestWithParam<std::tuple<EngineKind, BadCase>> {};

TEST_P(CpuValidationTest, RejectsWithFieldName) {
  const auto& [kind, bad] = GetParam();
  auto engine = CreateEngine(kind);
  ASSERT_TRUE(engine.ok());
  // A valid baseline: two sequences of 8 and 8 tokens, 4 query heads over 2 KV heads, d = 64.
  AttentionProblem p = VarlenProblem(DType::kF16, {8, 8}, {8, 8}, 4, 2, 64);
  AttentionTensors t = AttentionTensors::Make(p, 7);
  ForwardArgs f = t.forward_args();
  BackwardArgs b = t.backward_args();
  ASSERT_TRUE((*engine)->Forward(p, f).ok());
  bad.corrupt(p, f, b);
  const absl::Status s = bad.backward ? (*engine)->Backward(p, b) : (*engine)->Forward(p, f);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(bad.field), std::string::npos)
      << "message '" << s.message() << "' does not name " << bad.field;
  if (!ValidateProblem(p).ok()) {
    EXPECT_FALSE((*engine)->SupportsForward(p).ok());
    EXPECT_FALSE((*engine)->SupportsBackward(p).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(Bad, CpuValidationTest,
                         ::testing::Combine(::testing::Values(EngineKind::kCpuReference,
                                                              EngineKind::kCpuTiled),
                                            ::testing::ValuesIn(BadCases())),
                         [](const ::testing::TestParamInfo<std::tuple<EngineKind, BadCase>>& info) {
                           return std::string(EngineKindName(std::get<0>(info.param))) + "_" +
                                  std::get<1>(info.param).name;
                         });

TEST(CpuEngineRegistryTest, CreatesBothCpuKinds) {
  for (EngineKind kind : {EngineKind::kCpuReference, EngineKind::kCpuTiled}) {
    auto engine = CreateEngine(kind);
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->kind(), kind);
    auto parsed = ParseEngineKind(EngineKindName(kind));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, kind);
  }
}

}  // namespace
}  // namespace attn::testing
