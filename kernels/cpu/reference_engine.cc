// The float64 reference engine: computes S and P in full for each (sequence, head), then applies
// the textbook formulas. Slow and memory-hungry on purpose; every other engine is tested against
// it.
//
// The pool splits the work by rows, never inside a sum: the forward and the dQ part of the
// backward hand out query rows, the dK and dV sums hand out blocks of key rows. Every output
// element is one thread's sum over its terms in a fixed order, so the bits do not depend on the
// number of threads. The backward holds one head's [lq][lk] P and dS at a time.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "attn/status_macros.h"
#include "cpu/cpu_engines.h"
#include "cpu/float_rows.h"
#include "cpu/host_engine.h"

namespace attn {
namespace {

using cpu::LoadRow;
using cpu::StoreRow;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The dK / dV pass hands out this many keys at a time, so that each query's Q and dO rows are
// read once for several keys: 16 rather than 1 takes a fifth off a one-thread backward at
// q1013_k2011_d256; larger blocks gain a few per cent more but leave a 16-thread pool short of
// items below about 1000 keys.
constexpr int64_t kKeysPerItem = 16;

// One sequence's rows of one head of a tensor, as float64 [rows][d].
std::vector<double> LoadHead(const TensorRef& t, DType dtype, int64_t first_token, int64_t rows,
                             int head, int d) {
  std::vector<double> out(static_cast<size_t>(rows) * d);
  for (int64_t i = 0; i < rows; ++i) {
    LoadRow(t.data, dtype, t.offset(first_token + i, head), d, &out[i * d]);
  }
  return out;
}

double Dot(const double* a, const double* b, int d) {
  double s = 0;
  for (int c = 0; c < d; ++c) s += a[c] * b[c];
  return s;
}

// out[j] = Dot(a, rows + j d) for j in [first, last): four rows side by side, each its own sum in
// Dot's order (the same bits), so that the four addition chains overlap instead of waiting on
// one another.
void Dots(const double* a, const double* rows, int64_t first, int64_t last, int d, double* out) {
  int64_t j = first;
  for (; j + 4 <= last; j += 4) {
    const double* r0 = rows + j * d;
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int c = 0; c < d; ++c) {
      s0 += a[c] * r0[c];
      s1 += a[c] * r0[d + c];
      s2 += a[c] * r0[2 * d + c];
      s3 += a[c] * r0[3 * d + c];
    }
    out[j] = s0;
    out[j + 1] = s1;
    out[j + 2] = s2;
    out[j + 3] = s3;
  }
  for (; j < last; ++j) out[j] = Dot(a, rows + j * d, d);
}

// Query row i of the forward of one (sequence, query head) in float64: s[0, lk) gets S (scaled,
// -inf where masked), then P normalised in place; o[0, d) gets O = P V; returns the LSE. A row
// that sees no key gets P = 0, O = 0, LSE = -inf.
double ForwardRow(const AttentionProblem& p, int b, int64_t i, const std::vector<double>& q,
                  const std::vector<double>& k, const std::vector<double>& v, double* s,
                  double* o) {
  const int d = p.head_dim;
  const int64_t lk = p.seqlen_k(b);
  const double scale = p.scale();
  std::fill(o, o + d, 0.0);
  const KeyRange r = p.visible_keys(b, i);
  if (r.end <= r.begin) {
    std::fill(s, s + lk, 0.0);
    return kNegInf;
  }
  for (int64_t j = 0; j < lk; ++j) s[j] = kNegInf;
  Dots(&q[i * d], k.data(), r.begin, r.end, d, s);
  double m = kNegInf;
  for (int64_t j = r.begin; j < r.end; ++j) {
    s[j] = scale * s[j];
    if (s[j] > m) m = s[j];  // NaN scores are skipped here but poison P below
  }
  double l = 0;
  for (int64_t j = r.begin; j < r.end; ++j) {
    s[j] = std::exp(s[j] - m);
    l += s[j];
  }
  for (int64_t j = 0; j < lk; ++j) s[j] = (j >= r.begin && j < r.end) ? s[j] / l : 0.0;
  for (int64_t j = r.begin; j < r.end; ++j) {
    for (int c = 0; c < d; ++c) o[c] += s[j] * v[j * d + c];
  }
  return m + std::log(l);
}

class CpuReferenceEngine final : public cpu::HostEngine {
 public:
  explicit CpuReferenceEngine(const EngineOptions& options) : HostEngine(options, "attn-cpu-ref") {}

  EngineKind kind() const override { return EngineKind::kCpuReference; }

  // One sequence at a time, its (query head, query row) pairs spread over the pool.
  absl::Status Forward(const AttentionProblem& p, const ForwardArgs& a) override {
    ATTN_RETURN_IF_ERROR(ValidateForward(p, a));
    const int d = p.head_dim, group = p.group_size();
    const int64_t total_q = p.total_q();
    for (int b = 0; b < p.batch(); ++b) {
      const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
      const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
      if (lq == 0) continue;
      std::vector<std::vector<double>> q(p.num_heads), k(p.num_kv_heads), v(p.num_kv_heads);
      for (int h = 0; h < p.num_heads; ++h) q[h] = LoadHead(a.q, p.dtype, q0, lq, h, d);
      for (int h = 0; h < p.num_kv_heads; ++h) {
        k[h] = LoadHead(a.k, p.dtype, k0, lk, h, d);
        v[h] = LoadHead(a.v, p.dtype, k0, lk, h, d);
      }
      pool().ParallelFor(lq * p.num_heads, [&](int, int64_t item) {
        const int h = static_cast<int>(item / lq);
        const int64_t i = item % lq;
        std::vector<double> s(static_cast<size_t>(lk)), o(d);
        const double lse =
            ForwardRow(p, b, i, q[h], k[h / group], v[h / group], s.data(), o.data());
        StoreRow(a.o.data, p.dtype, a.o.offset(q0 + i, h), d, o.data());
        if (a.lse != nullptr) a.lse[h * total_q + q0 + i] = static_cast<float>(lse);
      });
    }
    return absl::OkStatus();
  }

  // The exact gradient of the attention function at (Q, K, V): P and O are recomputed in
  // float64 rather than read from args.o / args.lse, so a low-precision forward does not leak
  // into the reference. D = rowsum(dO * O), dP = dO V^T, dS = P * (dP - D), dQ = scale dS K,
  // dK = scale dS^T Q, dV = P^T dO; dK and dV sum over the query heads of each KV head.
  //
  // Per (sequence, KV head), per query head of its group in turn: a pass over query rows (P,
  // dS and dQ, each dQ row summed over keys in order), then a pass over blocks of keys that adds
  // the head's terms into dK and dV, summed over queries in order.
  absl::Status Backward(const AttentionProblem& p, const BackwardArgs& a) override {
    ATTN_RETURN_IF_ERROR(ValidateBackward(p, a));
    const int d = p.head_dim, group = p.group_size();
    const double scale = p.scale();
    for (int b = 0; b < p.batch(); ++b) {
      const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
      const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
      std::vector<double> prob(static_cast<size_t>(lq * lk)), ds(prob.size());
      for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
        const auto k = LoadHead(a.k, p.dtype, k0, lk, kvh, d);
        const auto v = LoadHead(a.v, p.dtype, k0, lk, kvh, d);
        std::vector<double> dk(static_cast<size_t>(lk * d), 0.0), dv(dk.size(), 0.0);
        for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
          const auto q = LoadHead(a.q, p.dtype, q0, lq, h, d);
          const auto d_o = LoadHead(a.d_o, p.dtype, q0, lq, h, d);
          pool().ParallelFor(lq, [&](int, int64_t i) {
            double* pi = prob.data() + i * lk;
            std::vector<double> o(d), dq(d, 0.0), dp(static_cast<size_t>(lk));
            ForwardRow(p, b, i, q, k, v, pi, o.data());
            const KeyRange r = p.visible_keys(b, i);
            const double* doi = &d_o[i * d];
            const double di = Dot(doi, o.data(), d);
            Dots(doi, v.data(), r.begin, r.end, d, dp.data());
            for (int64_t j = r.begin; j < r.end; ++j) {
              const double dsij = pi[j] * (dp[j] - di);
              ds[i * lk + j] = dsij;
              const double* kj = &k[j * d];
              for (int c = 0; c < d; ++c) dq[c] += scale * dsij * kj[c];
            }
            StoreRow(a.dq.data, p.dtype, a.dq.offset(q0 + i, h), d, dq.data());
          });
          pool().ParallelFor((lk + kKeysPerItem - 1) / kKeysPerItem, [&](int, int64_t item) {
            const int64_t j0 = item * kKeysPerItem, j1 = std::min(j0 + kKeysPerItem, lk);
            for (int64_t i = 0; i < lq; ++i) {
              const KeyRange r = p.visible_keys(b, i);
              const double* qi = &q[i * d];
              const double* doi = &d_o[i * d];
              for (int64_t j = std::max(j0, r.begin); j < std::min(j1, r.end); ++j) {
                const double dsij = ds[i * lk + j], pij = prob[i * lk + j];
                double* dkj = &dk[j * d];
                double* dvj = &dv[j * d];
                for (int c = 0; c < d; ++c) {
                  dkj[c] += scale * dsij * qi[c];
                  dvj[c] += pij * doi[c];
                }
              }
            }
          });
        }
        for (int64_t j = 0; j < lk; ++j) {
          StoreRow(a.dk.data, p.dtype, a.dk.offset(k0 + j, kvh), d, &dk[j * d]);
          StoreRow(a.dv.data, p.dtype, a.dv.offset(k0 + j, kvh), d, &dv[j * d]);
        }
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Engine> MakeCpuReferenceEngine(const EngineOptions& options) {
  return std::make_unique<CpuReferenceEngine>(options);
}

}  // namespace attn
