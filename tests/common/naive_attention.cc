#include "common/naive_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace attn::testing {
namespace {

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

// The per-(sequence, head) softmax probabilities P, rounded to the dtype, plus the LSE.
// Masked entries are 0; rows that see no key are all 0 with LSE = -inf.
void NaiveProbabilities(const Inputs& in, int b, int h, std::vector<float>& prob,
                        std::vector<float>& lse) {
  const AttentionProblem& p = in.p;
  const int d = p.head_dim, kvh = h / p.group_size();
  const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
  const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
  const DType t = p.dtype;
  const float scale = RoundToDType(p.scale(), t);
  prob.assign(static_cast<size_t>(lq * lk), 0.f);
  lse.assign(static_cast<size_t>(lq), -std::numeric_limits<float>::infinity());
  std::vector<float> s(static_cast<size_t>(lk));
  for (int64_t i = 0; i < lq; ++i) {
    const KeyRange r = p.visible_keys(b, i);
    if (r.end <= r.begin) continue;
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
    for (int64_t j = r.begin; j < r.end; ++j) {
      prob[i * lk + j] = RoundToDType(std::exp(s[j] - m) / sum, t);
    }
    lse[i] = m + std::log(sum);
  }
}

}  // namespace

NaiveForwardResult NaiveForward(const AttentionProblem& p, const HostTensor& q, const HostTensor& k,
                                const HostTensor& v) {
  const Inputs in{p, Floats(q), Floats(k), Floats(v), {}};
  const int d = p.head_dim, hq = p.num_heads;
  const int64_t total_q = p.total_q();
  NaiveForwardResult res;
  res.o.assign(static_cast<size_t>(total_q * hq * d), 0.0);
  res.lse.assign(static_cast<size_t>(total_q * hq), 0.0);
  std::vector<float> prob, lse, acc(d);
  for (int b = 0; b < p.batch(); ++b) {
    const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
    for (int h = 0; h < hq; ++h) {
      const int kvh = h / p.group_size();
      NaiveProbabilities(in, b, h, prob, lse);
      for (int64_t i = 0; i < lq; ++i) {
        const KeyRange r = p.visible_keys(b, i);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = r.begin; j < r.end; ++j) {
          const float pij = prob[i * lk + j];
          const float* vj = in.V(k0 + j, kvh);
          for (int c = 0; c < d; ++c) acc[c] += pij * vj[c];
        }
        for (int c = 0; c < d; ++c) {
          res.o[((q0 + i) * hq + h) * d + c] = RoundToDType(acc[c], p.dtype);
        }
        res.lse[h * total_q + q0 + i] = lse[i];
      }
    }
  }
  return res;
}

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
  std::vector<float> prob, lse, dp, acc(d);
  for (int b = 0; b < p.batch(); ++b) {
    const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
    dp.assign(static_cast<size_t>(lk), 0.f);
    for (int kvh = 0; kvh < hk; ++kvh) {
      // Group sums of dK and dV in float32, each head's term rounded as a framework would.
      std::vector<float> dk_sum(static_cast<size_t>(lk * d), 0.f), dv_sum(dk_sum.size(), 0.f);
      std::vector<float> dk_h(dk_sum.size()), dv_h(dk_sum.size());
      for (int h = kvh * p.group_size(); h < (kvh + 1) * p.group_size(); ++h) {
        NaiveProbabilities(in, b, h, prob, lse);
        std::vector<float> ds(static_cast<size_t>(lq * lk), 0.f);
        for (int64_t i = 0; i < lq; ++i) {
          const KeyRange r = p.visible_keys(b, i);
          const float* doi = in.DO(q0 + i, h);
          float row_dot = 0.f;
          for (int64_t j = r.begin; j < r.end; ++j) {
            const float* vj = in.V(k0 + j, kvh);
            float dot = 0.f;
            for (int c = 0; c < d; ++c) dot += doi[c] * vj[c];
            dp[j] = RoundToDType(dot, t);
            row_dot += prob[i * lk + j] * dp[j];
          }
          for (int64_t j = r.begin; j < r.end; ++j) {
            const float g = RoundToDType(prob[i * lk + j] * (dp[j] - row_dot), t);
            ds[i * lk + j] = RoundToDType(g * scale, t);
          }
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t j = r.begin; j < r.end; ++j) {
            const float* kj = in.K(k0 + j, kvh);
            for (int c = 0; c < d; ++c) acc[c] += ds[i * lk + j] * kj[c];
          }
          for (int c = 0; c < d; ++c) res.dq[((q0 + i) * hq + h) * d + c] = RoundToDType(acc[c], t);
        }
        std::fill(dk_h.begin(), dk_h.end(), 0.f);
        std::fill(dv_h.begin(), dv_h.end(), 0.f);
        for (int64_t i = 0; i < lq; ++i) {
          const KeyRange r = p.visible_keys(b, i);
          const float* qi = in.Q(q0 + i, h);
          const float* doi = in.DO(q0 + i, h);
          for (int64_t j = r.begin; j < r.end; ++j) {
            const float dsij = ds[i * lk + j], pij = prob[i * lk + j];
            for (int c = 0; c < d; ++c) {
              dk_h[j * d + c] += dsij * qi[c];
              dv_h[j * d + c] += pij * doi[c];
            }
          }
        }
        for (size_t e = 0; e < dk_h.size(); ++e) {
          dk_sum[e] += RoundToDType(dk_h[e], t);
          dv_sum[e] += RoundToDType(dv_h[e], t);
        }
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
