#include "common/finite_difference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

// The tolerance. A fused backward reads exact 16-bit Q, K, V and dO and accumulates every
// product in float32 (relative error ~1e-7 over these sizes, negligible); what it rounds to the
// dtype (unit roundoff u: 2^-11 float16, 2^-8 bfloat16) is
//   (a) P^T, the A operand of dV = P^T dO, and dS^T, that of dK = scale dS^T Q and
//       dQ = scale dS K;
//   (b) O, which the forward stored in the dtype and D = rowsum(dO * O) reads;
//   (c) dQ, dK and dV themselves.
// Each rounding is an independent relative error of RMS at most u / sqrt(3). Along a direction R,
// (a) moves <dQ, R> by scale * sum_ij delta(dS_ij) (R_i . K_j), a sum of independent terms of
// RMS (u / sqrt(3)) scale sqrt(sum_ij dS_ij^2 (R_i . K_j)^2). With K and R random, that sum is
// in expectation sum_ij dS_ij^2 |K_j|^2, and so is |dQ * R|^2 = sum_ic dQ_ic^2 R_ic^2
// (dQ_i = scale sum_j dS_ij K_j, the K_j independent); likewise dK with Q, and dV with P and
// dO. (c) moves <dX, R> by (u / sqrt(3)) |dX * R| at most, and (b) moves dS_ij by
// P_ij delta(D_i), smaller than (a) by about the square root of the keys the row sees.
// (Subnormal float16 P and dS, below 2^-14, round by at most 2^-25 absolutely: far below.)
// So the error of <dX, R> has an RMS of about u |dX * R|_2 (three sources of at most u^2 / 3
// each), and being a sum of many bounded independent terms it is close to Gaussian: 8 RMS keep
// a false failure out of reach (Hoeffding's bound from the three sources' worst cases,
// 2 exp(-64 / 6) < 1e-4 per check; about 1e-15 if Gaussian). The CPU suite's float64 model of
// the kernels' rounding (tests/cpu/finite_difference_test.cc), run on 150 fresh seeds of every
// case here (9,900 checks), erred by 0.62 u |dX * R| RMS and 2.5 u |dX * R| at most. A gradient
// scaled by 1 + c fails along a direction R with |<dX, R>| > 8 u |dX * R| / c (both sides about
// |dX|): for c = 5%, along 53% of directions at bfloat16 and 94% at float16, six directions a
// problem. The worst-case bound u <|dX|, |R|> is 20-150 times as loose in these problems (about
// 0.6 sqrt(elements)): at bfloat16 it would pass a gradient off by a tenth along most
// directions.
//
// The central difference itself: float64 with a step of 1e-4 (inputs and directions of unit
// scale) leaves a truncation error of order 1e-8 relative and rounding noise near 1e-9
// absolute; |FD(2 eps) - FD(eps)| (three times FD(eps)'s truncation error, plus the noise of
// both) is added to the tolerance as its bound.

namespace attn::testing {
namespace {

constexpr double kStep = 1e-4;

const char* const kInputNames[] = {"dQ", "dK", "dV"};

// x with input `input` moved by step * r.
LossPoint Moved(const LossPoint& x, int input, const std::vector<double>& r, double step) {
  LossPoint y = x;
  std::vector<double>& v = input == 0 ? y.q : input == 1 ? y.k : y.v;
  for (size_t i = 0; i < v.size(); ++i) v[i] += step * r[i];
  return y;
}

double CentralDifference(const AttentionProblem& p, const LossPoint& x, int input,
                         const std::vector<double>& r, double step) {
  return (AttentionLoss(p, Moved(x, input, r, step)) -
          AttentionLoss(p, Moved(x, input, r, -step))) /
         (2 * step);
}

}  // namespace

double UnitRoundoff(DType t) {
  switch (t) {
    case DType::kF16:
      return std::ldexp(1.0, -11);
    case DType::kBF16:
      return std::ldexp(1.0, -8);
    case DType::kF32:
      break;
  }
  return std::ldexp(1.0, -24);
}

LossPoint LossPointOf(const AttentionTensors& t) {
  return {t.q.ToDouble(), t.k.ToDouble(), t.v.ToDouble(), t.d_o.ToDouble()};
}

Gradients GradientsOf(const AttentionTensors& t) {
  return {t.dq.ToDouble(), t.dk.ToDouble(), t.dv.ToDouble()};
}

double AttentionLoss(const AttentionProblem& p, const LossPoint& x) {
  const int d = p.head_dim, hq = p.num_heads, hk = p.num_kv_heads, group = p.group_size();
  const double scale = p.scale();
  double loss = 0;
  std::vector<double> w, o(static_cast<size_t>(d));
  for (int b = 0; b < p.batch(); ++b) {
    const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    w.resize(static_cast<size_t>(p.seqlen_k(b)));
    for (int h = 0; h < hq; ++h) {
      const int kvh = h / group;
      for (int64_t i = 0; i < p.seqlen_q(b); ++i) {
        const KeyRange r = p.visible_keys(b, i);
        if (r.end <= r.begin) continue;
        const double* qi = &x.q[((q0 + i) * hq + h) * d];
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = r.begin; j < r.end; ++j) {
          const double* kj = &x.k[((k0 + j) * hk + kvh) * d];
          double s = 0;
          for (int c = 0; c < d; ++c) s += qi[c] * kj[c];
          w[j] = scale * s;
          m = std::max(m, w[j]);
        }
        double l = 0;
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t j = r.begin; j < r.end; ++j) {
          const double e = std::exp(w[j] - m);
          l += e;
          const double* vj = &x.v[((k0 + j) * hk + kvh) * d];
          for (int c = 0; c < d; ++c) o[c] += e * vj[c];
        }
        const double* gi = &x.g[((q0 + i) * hq + h) * d];
        double og = 0;
        for (int c = 0; c < d; ++c) og += o[c] * gi[c];
        loss += og / l;
      }
    }
  }
  return loss;
}

bool DirectionalCheck::ok() const { return std::abs(numeric - analytic) <= tolerance; }

std::string DirectionalCheck::ToString() const {
  return absl::StrCat(what, ": central difference ", numeric, ", <dX, R> ", analytic, ", error ",
                      std::abs(numeric - analytic), " > tolerance ", tolerance, " (",
                      kFiniteDifferenceSigmas, " x rounding RMS ", rounding, " + step error ",
                      fd_error, ")");
}

FiniteDifferenceCheck::FiniteDifferenceCheck(const AttentionProblem& p, LossPoint x, uint64_t seed,
                                             int directions)
    : p_(p) {
  // Not the streams AttentionTensors::Make fills Q, K, V, dO from (seed + 0..3): a direction
  // along an input itself would not be random.
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + 0xd1b54a32d192ed03ull);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int input = 0; input < 3; ++input) {
    const size_t n = (input == 0 ? x.q : input == 1 ? x.k : x.v).size();
    for (int index = 0; index < directions; ++index) {
      Direction dir{input, index, std::vector<double>(n), 0, 0};
      for (double& e : dir.r) e = normal(rng);
      dir.numeric = CentralDifference(p, x, input, dir.r, kStep);
      dir.fd_error = std::abs(CentralDifference(p, x, input, dir.r, 2 * kStep) - dir.numeric);
      directions_.push_back(std::move(dir));
    }
  }
}

std::vector<DirectionalCheck> FiniteDifferenceCheck::Check(const Gradients& grads) const {
  const double u = UnitRoundoff(p_.dtype);
  std::vector<DirectionalCheck> checks;
  for (const Direction& dir : directions_) {
    const std::vector<double>& g = dir.input == 0 ? grads.dq : dir.input == 1 ? grads.dk : grads.dv;
    DirectionalCheck c;
    c.what = absl::StrCat(kInputNames[dir.input], " along direction ", dir.index);
    c.numeric = dir.numeric;
    c.fd_error = dir.fd_error;
    double weighted = 0, r_norm = 0;
    for (size_t i = 0; i < dir.r.size() && i < g.size(); ++i) {
      c.analytic += g[i] * dir.r[i];
      weighted += g[i] * g[i] * dir.r[i] * dir.r[i];
      r_norm += dir.r[i] * dir.r[i];
    }
    if (g.size() != dir.r.size()) c.analytic = std::numeric_limits<double>::quiet_NaN();
    c.rounding = u * std::sqrt(weighted);
    c.tolerance = kFiniteDifferenceSigmas * c.rounding + c.fd_error + 1e-9 * std::sqrt(r_norm);
    checks.push_back(std::move(c));
  }
  return checks;
}

absl::Status FiniteDifferenceCheck::Verify(const Gradients& grads) const {
  std::vector<std::string> failed;
  for (const DirectionalCheck& c : Check(grads)) {
    if (!c.ok()) failed.push_back(c.ToString());
  }
  if (failed.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(p_.DebugString(), ": ", absl::StrJoin(failed, "; ")));
}

std::vector<SweepCase> FiniteDifferenceCases() {
  constexpr DType f16 = DType::kF16, bf16 = DType::kBF16;
  const auto dense = [](std::string name, DType t, int batch, int64_t lq, int64_t lk, int hq,
                        int hk, int d, bool causal) {
    return SweepCase{std::move(name), DenseProblem(t, batch, lq, lk, hq, hk, d, causal)};
  };
  std::vector<SweepCase> s;
  s.push_back(dense("len37_bf16_d32_gqa2", bf16, 1, 37, 37, 2, 1, 32, false));
  s.push_back(dense("len37_f16_d64_gqa2", f16, 1, 37, 37, 4, 2, 64, false));
  s.push_back(dense("len130_causal_bf16_d64_gqa2", bf16, 1, 130, 130, 4, 2, 64, true));
  s.push_back(dense("q130_k37_causal_f16_d64", f16, 1, 130, 37, 2, 2, 64, true));
  {
    SweepCase c = dense("window20_7_f16_d64", f16, 1, 130, 130, 2, 2, 64, false);
    c.problem.window_left = 20;
    c.problem.window_right = 7;
    s.push_back(c);
  }
  s.push_back(dense("len130_f16_d96_gqa2", f16, 1, 130, 130, 4, 2, 96, false));
  s.push_back(dense("q37_k130_causal_bf16_d96_batch2", bf16, 2, 37, 130, 2, 2, 96, true));
  s.push_back({"varlen_causal_bf16_d96_gqa2",
               VarlenProblem(bf16, {37, 0, 130}, {50, 5, 130}, 4, 2, 96, true)});
  s.push_back(dense("len130_causal_f16_d128_gqa2", f16, 1, 130, 130, 4, 2, 128, true));
  s.push_back(dense("q130_k37_bf16_d128_gqa2", bf16, 1, 130, 37, 4, 2, 128, false));
  s.push_back({"varlen_f16_d128", VarlenProblem(f16, {1, 130, 37}, {37, 130, 64}, 2, 1, 128)});
  return s;
}

}  // namespace attn::testing
