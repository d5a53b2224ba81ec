#include "common/sweep.h"

namespace attn::testing {
namespace {

SweepCase Dense(std::string name, DType t, int batch, int64_t lq, int64_t lk, int hq, int hk, int d,
                bool causal) {
  return {std::move(name), DenseProblem(t, batch, lq, lk, hq, hk, d, causal)};
}

SweepCase Window(SweepCase c, int left, int right) {
  c.problem.window_left = left;
  c.problem.window_right = right;
  return c;
}

}  // namespace

std::vector<SweepCase> StandardSweep() {
  constexpr DType f32 = DType::kF32, f16 = DType::kF16, bf16 = DType::kBF16;
  std::vector<SweepCase> s;
  s.push_back(Dense("len1_f32_d64", f32, 1, 1, 1, 2, 2, 64, false));
  s.push_back(Dense("len1_causal_bf16_d256_gqa2", bf16, 2, 1, 1, 4, 2, 256, true));
  s.push_back(Dense("len17_causal_bf16_d32_gqa2", bf16, 1, 17, 17, 4, 2, 32, true));
  s.push_back(Dense("len177_f16_d80_gqa2", f16, 1, 177, 177, 2, 1, 80, false));
  s.push_back(Dense("len1013_causal_bf16_d64", bf16, 1, 1013, 1013, 2, 2, 64, true));
  s.push_back(Dense("len1013_f32_d64", f32, 1, 1013, 1013, 1, 1, 64, false));
  s.push_back(Dense("q17_k177_causal_f32_d96", f32, 1, 17, 177, 2, 2, 96, true));
  s.push_back(Dense("q17_k1013_f16_d96_gqa8", f16, 1, 17, 1013, 8, 1, 96, false));
  // Query longer than keys under causal masking: the first 160 rows see no key.
  s.push_back(Dense("q177_k17_causal_f16_d128", f16, 1, 177, 17, 2, 1, 128, true));
  s.push_back(Dense("q177_k1013_bf16_d256_gqa2", bf16, 1, 177, 1013, 2, 1, 256, false));
  s.push_back(Dense("q1013_k17_f32_d32", f32, 1, 1013, 17, 2, 2, 32, false));
  s.push_back(Dense("q1_k1013_causal_bf16_d64_gqa8", bf16, 1, 1, 1013, 8, 1, 64, true));
  s.push_back(Window(Dense("window64_causal_f16_d64", f16, 1, 177, 177, 2, 2, 64, true), 64, 0));
  s.push_back(
      Window(Dense("window16_8_bf16_d128_gqa8", bf16, 1, 177, 200, 8, 1, 128, false), 16, 8));
  s.push_back(
      Window(Dense("window100_50_f16_d128", f16, 1, 1013, 1013, 2, 2, 128, false), 100, 50));
  s.push_back(Window(Dense("window_right_only_f32_d80", f32, 1, 177, 177, 2, 1, 80, false), -1, 5));
  s.push_back(Dense("gqa8_causal_f32_d64", f32, 1, 177, 177, 8, 1, 64, true));
  {
    SweepCase c{"varlen_empty_causal_f16_d64",
                VarlenProblem(f16, {0, 17, 1, 177, 0, 33}, {5, 17, 33, 177, 0, 0}, 4, 2, 64, true)};
    s.push_back(c);
  }
  s.push_back(
      {"varlen_bf16_d96_gqa8", VarlenProblem(bf16, {33, 100, 7}, {50, 64, 7}, 8, 1, 96, false)});
  {
    SweepCase c{"varlen_padded_f32_d80_window",
                VarlenProblem(f32, {17, 0, 177}, {30, 9, 150}, 2, 2, 80, false), true};
    c.problem.window_left = 20;
    c.problem.window_right = 3;
    s.push_back(c);
  }
  {
    SweepCase c = Dense("dense_batch3_padded_bf16_d128_gqa2", bf16, 3, 64, 80, 4, 2, 128, true);
    c.padded = true;
    s.push_back(c);
  }
  {
    SweepCase c = Dense("custom_scale_causal_f32_d80", f32, 2, 177, 177, 2, 2, 80, true);
    c.problem.softmax_scale = 0.3f;
    s.push_back(c);
  }
  s.push_back(Dense("len177_f16_d32_gqa8_batch2", f16, 2, 177, 177, 8, 1, 32, false));
  return s;
}

void PrintTo(const SweepCase& c, std::ostream* os) {
  *os << c.name << " {" << c.problem.DebugString() << (c.padded ? " padded" : "") << "}";
}

}  // namespace attn::testing
