#include "common/naive_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "cpu/thread_pool.h"

namespace attn::testing {
namespace {

// The work is split by rows, never a sum: query rows for P, dS, dQ and O, blocks of keys for dK
// and dV. Every element is one thread's sum over its terms in a fixed order, so the results are
// the same bits on any number of threads. A block's dK and dV rows reuse each query's rows.
constexpr int64_t kKeysPerItem = 16;

// Calls fn(item) for every item in [0, n) on a process-wide pool. The pool runs one ParallelFor at
// a time, so callers on several threads take turns.
void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) {
  static absl::Mutex mu(absl::kConstInit);
  static cpu::ThreadPool& pool = *new cpu::ThreadPool(0, "attn-naive");
  absl::MutexLock lock(&mu);
  pool.ParallelFor(n, [&](int, int64_t item) { fn(item); });
}

// The stored values of a tensor as float32 (exact), packed [tokens][heads][head_dim].
std::vector<float> Floats(const HostTensor& t) {
  const std::vector<double> d = t.ToDouble();
  return std::vector<float>(d.begin(), d.end());
}

// Packed float views of the four inputs.
struct Inputs {
  const AttentionProblem& p;
  std::vector<float> q, k, v, d_o;
  const float* Q(int64_t token, int h) const { return &q[(token * p.num_heads + h) * p.head_dim]; }
  const float* K(int64_t token, int h) const {
    return &k[(token * p.num_kv_heads + h) * p.head_dim];
  }
  const float* V(int64_t token, int h) const {
    return &v[(token * p.num_kv_heads + h) * p.head_dim];
  }
  const float* DO(int64_t token, int h) const {
    return &d_o[(token * p.num_heads + h) * p.head_dim];
  }
};

// Query row i of one (sequence, head): the softmax probabilities P, rounded to the dtype, into
// prob[0, lk), and the LSE. Masked entries are 0; a row that sees no key is all 0, LSE = -inf.
float NaiveProbabilities(const Inputs& in, int b, int h, int64_t i, float* prob) {
  const AttentionProblem& p = in.p;
  const int d = p.head_dim, kvh = h / p.group_size();
  const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
  const int64_t lk = p.seqlen_k(b);
  const DType t = p.dtype;
  const float scale = RoundToDType(p.scale(), t);
  std::fill(prob, prob + lk, 0.f);
  const KeyRange r = p.visible_keys(b, i);
  if (r.end <= r.begin) return -std::numeric_limits<float>::infinity();
  std::vector<float> s(static_cast<size_t>(lk));
  const float* qi = in.Q(q0 + i, h);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = r.begin; j < r.end; ++j) {
    const float* kj = in.K(k0 + j, kvh);
    float dot = 0.f;
    for (int c = 0; c < d; ++c) dot += qi[c] * kj[c];
    s[j] = RoundToDType(RoundToDType(dot, t) * scale, t);
    if (s[j] > m) m = s[j];
  }
  float sum = 0.f;
  for (int64_t j = r.begin; j < r.end; ++j) sum += std::exp(s[j] - m);
  for (int64_t j = r.begin; j < r.end; ++j) prob[j] = RoundToDType(std::exp(s[j] - m) / sum, t);
  return m + std::log(sum);
}

}  // namespace

// Each (sequence, head) in turn, its rows on the pool.
NaiveForwardResult NaiveForward(const AttentionProblem& p, const HostTensor& q, const HostTensor& k,
                                const HostTensor& v) {
  const Inputs in{p, Floats(q), Floats(k), Floats(v), {}};
  const int d = p.head_dim, hq = p.num_heads;
  const int64_t total_q = p.total_q();
  NaiveForwardResult res;
  res.o.assign(static_cast<size_t>(total_q * hq * d), 0.0);
  res.lse.assign(static_cast<size_t>(total_q * hq), 0.0);
  for (int b = 0; b < p.batch(); ++b) {
    const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
    ParallelFor(lq * hq, [&](int64_t item) {
      const int h = static_cast<int>(item / lq), kvh = h / p.group_size();
      const int64_t i = item % lq;
      std::vector<float> prob(static_cast<size_t>(lk)), acc(d, 0.f);
      res.lse[h * total_q + q0 + i] = NaiveProbabilities(in, b, h, i, prob.data());
      const KeyRange r = p.visible_keys(b, i);
      for (int64_t j = r.begin; j < r.end; ++j) {
        const float pij = prob[j];
        const float* vj = in.V(k0 + j, kvh);
        for (int c = 0; c < d; ++c) acc[c] += pij * vj[c];
      }
      for (int c = 0; c < d; ++c)
        res.o[((q0 + i) * hq + h) * d + c] = RoundToDType(acc[c], p.dtype);
    });
  }
  return res;
}

// Per (sequence, KV head), per query head of its group in turn: a pass over query rows (P, dS,
// dQ), then a pass over blocks of keys (the head's dK and dV terms, added to the group sums).
NaiveBackwardResult NaiveBackward(const AttentionProblem& p, const HostTensor& q,
                                  const HostTensor& k, const HostTensor& v, const HostTensor& d_o) {
  const Inputs in{p, Floats(q), Floats(k), Floats(v), Floats(d_o)};
  const int d = p.head_dim, hq = p.num_heads, hk = p.num_kv_heads;
  const DType t = p.dtype;
  const float scale = RoundToDType(p.scale(), t);
  NaiveBackwardResult res;
  res.dq.assign(static_cast<size_t>(p.total_q() * hq * d), 0.0);
  res.dk.assign(static_cast<size_t>(p.total_k() * hk * d), 0.0);
  res.dv.assign(res.dk.size(), 0.0);
  for (int b = 0; b < p.batch(); ++b) {
    const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
    std::vector<float> prob(static_cast<size_t>(lq * lk)), ds(prob.size());
    for (int kvh = 0; kvh < hk; ++kvh) {
      // Group sums of dK and dV in float32, each head's term rounded as a framework would.
      std::vector<float> dk_sum(static_cast<size_t>(lk * d), 0.f), dv_sum(dk_sum.size(), 0.f);
      for (int h = kvh * p.group_size(); h < (kvh + 1) * p.group_size(); ++h) {
        ParallelFor(lq, [&](int64_t i) {
          float* pi = prob.data() + i * lk;
          NaiveProbabilities(in, b, h, i, pi);
          const KeyRange r = p.visible_keys(b, i);
          const float* doi = in.DO(q0 + i, h);
          std::vector<float> dp(static_cast<size_t>(lk)), acc(d, 0.f);
          float row_dot = 0.f;
          for (int64_t j = r.begin; j < r.end; ++j) {
            const float* vj = in.V(k0 + j, kvh);
            float dot = 0.f;
            for (int c = 0; c < d; ++c) dot += doi[c] * vj[c];
            dp[j] = RoundToDType(dot, t);
            row_dot += pi[j] * dp[j];
          }
          for (int64_t j = r.begin; j < r.end; ++j) {
            const float g = RoundToDType(pi[j] * (dp[j] - row_dot), t);
            ds[i * lk + j] = RoundToDType(g * scale, t);
          }
          for (int64_t j = r.begin; j < r.end; ++j) {
            const float dsij = ds[i * lk + j];
            const float* kj = in.K(k0 + j, kvh);
            for (int c = 0; c < d; ++c) acc[c] += dsij * kj[c];
          }
          for (int c = 0; c < d; ++c) res.dq[((q0 + i) * hq + h) * d + c] = RoundToDType(acc[c], t);
        });
        ParallelFor((lk + kKeysPerItem - 1) / kKeysPerItem, [&](int64_t item) {
          const int64_t j0 = item * kKeysPerItem, j1 = std::min(j0 + kKeysPerItem, lk);
          std::vector<float> dk_h(static_cast<size_t>((j1 - j0) * d), 0.f), dv_h(dk_h.size(), 0.f);
          for (int64_t i = 0; i < lq; ++i) {
            const KeyRange r = p.visible_keys(b, i);
            const float* qi = in.Q(q0 + i, h);
            const float* doi = in.DO(q0 + i, h);
            for (int64_t j = std::max(j0, r.begin); j < std::min(j1, r.end); ++j) {
              const float dsij = ds[i * lk + j], pij = prob[i * lk + j];
              float* dkj = &dk_h[(j - j0) * d];
              float* dvj = &dv_h[(j - j0) * d];
              for (int c = 0; c < d; ++c) {
                dkj[c] += dsij * qi[c];
                dvj[c] += pij * doi[c];
              }
            }
          }
          for (int64_t e = 0; e < (j1 - j0) * d; ++e) {
            dk_sum[j0 * d + e] += RoundToDType(dk_h[e], t);
            dv_sum[j0 * d + e] += RoundToDType(dv_h[e], t);
          }
        });
      }
      for (int64_t j = 0; j < lk; ++j) {
        for (int c = 0; c < d; ++c) {
          res.dk[((k0 + j) * hk + kvh) * d + c] = RoundToDType(dk_sum[j * d + c], t);
          res.dv[((k0 + j) * hk + kvh) * d + c] = RoundToDType(dv_sum[j * d + c], t);
        }
      }
    }
  }
  return res;
}

}  // namespace attn::testing
