#include "tests/training/layer_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "attn/mask.h"

namespace attnserve::training::testing {
namespace {

using attn::layers::ParamSlot;

// c [m, n] = a [m, k] b [k, n], b at `offset` of w.
std::vector<double> Product(const std::vector<double>& a, int64_t m, int64_t k,
                            const std::vector<double>& w, int64_t offset, int64_t n) {
  std::vector<double> c(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t p = 0; p < k; ++p) {
      const double x = a[i * k + p];
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += x * w[offset + p * n + j];
    }
  }
  return c;
}

}  // namespace

double ReferenceLoss(const ReferenceProblem& rp, const std::vector<double>& w) {
  const attn::layers::LayerConfig& c = rp.layer;
  const std::vector<ParamSlot> slots = attn::layers::LayerParams(c);
  const int64_t t = int64_t{rp.batch} * rp.seqlen, d = c.model_dim, hd = c.head_dim;
  const int64_t qw = int64_t{c.num_heads} * hd, kvw = int64_t{c.num_kv_heads} * hd;
  const std::vector<double> q = Product(rp.inputs, t, d, w, slots[0].offset, qw);
  const std::vector<double> k = Product(rp.inputs, t, d, w, slots[1].offset, kvw);
  const std::vector<double> v = Product(rp.inputs, t, d, w, slots[2].offset, kvw);
  std::vector<double> a(t * qw, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const int group = c.num_heads / c.num_kv_heads;
  for (int b = 0; b < rp.batch; ++b) {
    for (int h = 0; h < c.num_heads; ++h) {
      const int kvh = h / group;
      for (int i = 0; i < rp.seqlen; ++i) {
        const attn::KeyRange keys = attn::VisibleKeys(i, rp.seqlen, rp.seqlen, c.window_left,
                                                      c.causal ? 0 : c.window_right);
        if (keys.end <= keys.begin) continue;
        const int64_t qi = (int64_t{b} * rp.seqlen + i) * qw + h * hd;
        std::vector<double> s(keys.end - keys.begin);
        double top = -std::numeric_limits<double>::infinity();
        for (int64_t j = keys.begin; j < keys.end; ++j) {
          const int64_t kj = (int64_t{b} * rp.seqlen + j) * kvw + kvh * hd;
          double dot = 0;
          for (int64_t e = 0; e < hd; ++e) dot += q[qi + e] * k[kj + e];
          s[j - keys.begin] = dot * scale;
          top = std::max(top, s[j - keys.begin]);
        }
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - top));
        for (int64_t j = keys.begin; j < keys.end; ++j) {
          const int64_t vj = (int64_t{b} * rp.seqlen + j) * kvw + kvh * hd;
          const double p = s[j - keys.begin] / sum;
          for (int64_t e = 0; e < hd; ++e) a[qi + e] += p * v[vj + e];
        }
      }
    }
  }
  std::vector<double> out = Product(a, t, qw, w, slots[3].offset, d);
  if (c.residual) {
    for (int64_t i = 0; i < t * d; ++i) out[i] += rp.inputs[i];
  }
  if (c.layer_norm) {
    for (int64_t r = 0; r < t; ++r) {
      double mean = 0, var = 0;
      for (int64_t e = 0; e < d; ++e) mean += out[r * d + e];
      mean /= d;
      for (int64_t e = 0; e < d; ++e) var += (out[r * d + e] - mean) * (out[r * d + e] - mean);
      const double rstd = 1.0 / std::sqrt(var / d + c.layer_norm_epsilon);
      for (int64_t e = 0; e < d; ++e) {
        out[r * d + e] =
            (out[r * d + e] - mean) * rstd * w[slots[4].offset + e] + w[slots[5].offset + e];
      }
    }
  }
  if (rp.labels.empty()) {
    double sse = 0;
    for (int64_t i = 0; i < t * d; ++i) sse += (out[i] - rp.targets[i]) * (out[i] - rp.targets[i]);
    return sse / (t * d);
  }
  const int64_t classes = static_cast<int64_t>(rp.class_embeddings.size()) / d;
  double loss = 0;
  int64_t scored = 0;
  for (int64_t r = 0; r < t; ++r) {
    if (rp.labels[r] < 0) continue;
    std::vector<double> logits(classes, 0.0);
    double top = -std::numeric_limits<double>::infinity();
    for (int64_t cl = 0; cl < classes; ++cl) {
      for (int64_t e = 0; e < d; ++e)
        logits[cl] += out[r * d + e] * rp.class_embeddings[cl * d + e];
      top = std::max(top, logits[cl]);
    }
    double sum = 0;
    for (double z : logits) sum += std::exp(z - top);
    loss += std::log(sum) + top - logits[rp.labels[r]];
    ++scored;
  }
  return loss / scored;
}

std::vector<double> FiniteDifferences(const ReferenceProblem& problem,
                                      const std::vector<double>& weights,
                                      const std::vector<int64_t>& indices, double h) {
  std::vector<double> grads;
  std::vector<double> w = weights;
  for (int64_t i : indices) {
    w[i] = weights[i] + h;
    const double up = ReferenceLoss(problem, w);
    w[i] = weights[i] - h;
    const double down = ReferenceLoss(problem, w);
    w[i] = weights[i];
    grads.push_back((up - down) / (2 * h));
  }
  return grads;
}

std::vector<int64_t> ParameterIndices(const attn::layers::LayerConfig& layer) {
  std::vector<int64_t> indices;
  for (const ParamSlot& slot : attn::layers::LayerParams(layer)) {
    for (int64_t i = 0; i < slot.size(); ++i) indices.push_back(slot.offset + i);
  }
  return indices;
}

}  // namespace attnserve::training::testing
