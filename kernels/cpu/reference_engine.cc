// The float64 reference engine: materialises S and P for each (sequence, head), then applies the
// textbook formulas. Slow and memory-hungry on purpose; every other engine is tested against it.
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

// One sequence's rows of one head of a tensor, as float64 [rows][d].
std::vector<double> LoadHead(const void* data, int64_t token_stride, int64_t head_stride, DType t,
                             int64_t first_token, int64_t rows, int head, int d) {
  std::vector<double> out(static_cast<size_t>(rows) * d);
  for (int64_t i = 0; i < rows; ++i) {
    LoadRow(data, t, (first_token + i) * token_stride + head * head_stride, d, &out[i * d]);
  }
  return out;
}

double Dot(const double* a, const double* b, int d) {
  double s = 0;
  for (int c = 0; c < d; ++c) s += a[c] * b[c];
  return s;
}

// The forward of one (sequence, query head) in float64: S (scaled, -inf where masked), then P
// normalised in place, O = P V and the LSE. Rows that see no key keep P = 0, O = 0, LSE = -inf.
struct HeadForward {
  std::vector<double> p;    // [lq][lk]: S, then P
  std::vector<double> o;    // [lq][d]
  std::vector<double> lse;  // [lq]
};

HeadForward ForwardHead(const AttentionProblem& p, int b, const std::vector<double>& q,
                        const std::vector<double>& k, const std::vector<double>& v) {
  const int d = p.head_dim;
  const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
  const double scale = p.scale();
  HeadForward f;
  f.p.assign(static_cast<size_t>(lq * lk), 0.0);
  f.o.assign(static_cast<size_t>(lq * d), 0.0);
  f.lse.assign(static_cast<size_t>(lq), kNegInf);
  for (int64_t i = 0; i < lq; ++i) {
    const KeyRange r = p.visible_keys(b, i);
    if (r.end <= r.begin) continue;
    double* s = &f.p[i * lk];
    for (int64_t j = 0; j < lk; ++j) s[j] = kNegInf;
    double m = kNegInf;
    for (int64_t j = r.begin; j < r.end; ++j) {
      s[j] = scale * Dot(&q[i * d], &k[j * d], d);
      if (s[j] > m) m = s[j];  // NaN scores are skipped here but poison P below
    }
    double l = 0;
    for (int64_t j = r.begin; j < r.end; ++j) {
      s[j] = std::exp(s[j] - m);
      l += s[j];
    }
    for (int64_t j = 0; j < lk; ++j) s[j] = (j >= r.begin && j < r.end) ? s[j] / l : 0.0;
    double* o = &f.o[i * d];
    for (int64_t j = r.begin; j < r.end; ++j) {
      for (int c = 0; c < d; ++c) o[c] += s[j] * v[j * d + c];
    }
    f.lse[i] = m + std::log(l);
  }
  return f;
}

class CpuReferenceEngine final : public cpu::HostEngine {
 public:
  explicit CpuReferenceEngine(const EngineOptions& options) : HostEngine(options, "attn-cpu-ref") {}

  EngineKind kind() const override { return EngineKind::kCpuReference; }

  absl::Status Forward(const AttentionProblem& p, const ForwardArgs& a) override {
    ATTN_RETURN_IF_ERROR(ValidateForward(p, a));
    const int d = p.head_dim, group = p.group_size();
    const int64_t total_q = p.total_q();
    pool().ParallelFor(int64_t{p.batch()} * p.num_heads, [&](int, int64_t item) {
      const int b = static_cast<int>(item / p.num_heads);
      const int h = static_cast<int>(item % p.num_heads);
      const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
      const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
      if (lq == 0) return;
      const auto q = LoadHead(a.q.data, a.q.token_stride, a.q.head_stride, p.dtype, q0, lq, h, d);
      const auto k =
          LoadHead(a.k.data, a.k.token_stride, a.k.head_stride, p.dtype, k0, lk, h / group, d);
      const auto v =
          LoadHead(a.v.data, a.v.token_stride, a.v.head_stride, p.dtype, k0, lk, h / group, d);
      const HeadForward f = ForwardHead(p, b, q, k, v);
      for (int64_t i = 0; i < lq; ++i) {
        StoreRow(a.o.data, p.dtype, a.o.offset(q0 + i, h), d, &f.o[i * d]);
        if (a.lse != nullptr) a.lse[h * total_q + q0 + i] = static_cast<float>(f.lse[i]);
      }
    });
    return absl::OkStatus();
  }

  // The exact gradient of the attention function at (Q, K, V): P and O are recomputed in
  // float64 rather than read from args.o / args.lse, so a low-precision forward does not leak
  // into the reference. D = rowsum(dO * O), dP = dO V^T, dS = P * (dP - D), dQ = scale dS K,
  // dK = scale dS^T Q, dV = P^T dO; dK and dV sum over the query heads of each KV head.
  absl::Status Backward(const AttentionProblem& p, const BackwardArgs& a) override {
    ATTN_RETURN_IF_ERROR(ValidateBackward(p, a));
    const int d = p.head_dim, group = p.group_size();
    const double scale = p.scale();
    pool().ParallelFor(int64_t{p.batch()} * p.num_kv_heads, [&](int, int64_t item) {
      const int b = static_cast<int>(item / p.num_kv_heads);
      const int kvh = static_cast<int>(item % p.num_kv_heads);
      const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
      const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
      const auto k = LoadHead(a.k.data, a.k.token_stride, a.k.head_stride, p.dtype, k0, lk, kvh, d);
      const auto v = LoadHead(a.v.data, a.v.token_stride, a.v.head_stride, p.dtype, k0, lk, kvh, d);
      std::vector<double> dk(static_cast<size_t>(lk * d), 0.0), dv(dk.size(), 0.0);
      std::vector<double> dq(static_cast<size_t>(lq * d)), dp(static_cast<size_t>(lk));
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        const auto q = LoadHead(a.q.data, a.q.token_stride, a.q.head_stride, p.dtype, q0, lq, h, d);
        const auto d_o =
            LoadHead(a.d_o.data, a.d_o.token_stride, a.d_o.head_stride, p.dtype, q0, lq, h, d);
        const HeadForward f = ForwardHead(p, b, q, k, v);
        std::fill(dq.begin(), dq.end(), 0.0);
        for (int64_t i = 0; i < lq; ++i) {
          const KeyRange r = p.visible_keys(b, i);
          if (r.end <= r.begin) continue;
          const double* pi = &f.p[i * lk];
          const double* doi = &d_o[i * d];
          const double di = Dot(doi, &f.o[i * d], d);
          for (int64_t j = r.begin; j < r.end; ++j) {
            dp[j] = Dot(doi, &v[j * d], d);
            const double ds = pi[j] * (dp[j] - di);
            for (int c = 0; c < d; ++c) {
              dq[i * d + c] += scale * ds * k[j * d + c];
              dk[j * d + c] += scale * ds * q[i * d + c];
              dv[j * d + c] += pi[j] * doi[c];
            }
          }
        }
        for (int64_t i = 0; i < lq; ++i) {
          StoreRow(a.dq.data, p.dtype, a.dq.offset(q0 + i, h), d, &dq[i * d]);
        }
      }
      for (int64_t j = 0; j < lk; ++j) {
        StoreRow(a.dk.data, p.dtype, a.dk.offset(k0 + j, kvh), d, &dk[j * d]);
        StoreRow(a.dv.data, p.dtype, a.dv.offset(k0 + j, kvh), d, &dv[j * d]);
      }
    });
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Engine> MakeCpuReferenceEngine(const EngineOptions& options) {
  return std::make_unique<CpuReferenceEngine>(options);
}

}  // namespace attn
