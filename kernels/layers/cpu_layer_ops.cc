// LayerOps on the host: the packed GEMM of cpu_gemm.h over a thread pool, and plain loops for
// everything else (each is O(tokens x model_dim), small beside the GEMMs and attention).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "attn/status_macros.h"
#include "cpu/thread_pool.h"
#include "layers/cpu_gemm.h"
#include "layers/layer_ops_internal.h"

namespace attn::layers {
namespace {

class CpuLayerOps final : public LayerOps {
 public:
  explicit CpuLayerOps(const LayerOpsOptions& options)
      : pool_(std::max(options.num_threads, 1), "attn-train"), gemm_(&pool_) {}

  MemorySpace memory_space() const override { return MemorySpace::kHost; }
  std::string_view name() const override { return "cpu"; }
  void* stream() const override { return nullptr; }

  absl::StatusOr<Buffer> Allocate(int64_t bytes) override {
    if (bytes < 0) return absl::InvalidArgumentError("allocate: negative size");
    // 64-byte aligned: the CPU engine's vector loads and the GEMM's rows.
    const size_t size = static_cast<size_t>((std::max<int64_t>(bytes, 1) + 63) / 64 * 64);
    void* data = std::aligned_alloc(64, size);
    if (data == nullptr) {
      return absl::ResourceExhaustedError("allocate: out of host memory");
    }
    std::memset(data, 0, size);
    return Buffer(data, bytes, [](void* p) { std::free(p); });
  }
  absl::Status Upload(void* dst, const void* host, int64_t bytes) override {
    std::memcpy(dst, host, bytes);
    return absl::OkStatus();
  }
  absl::Status Download(void* host, const void* src, int64_t bytes) override {
    std::memcpy(host, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status Gemm(bool transpose_a, bool transpose_b, float alpha, ConstMatrix a, ConstMatrix b,
                    float beta, Matrix c) override {
    if (absl::Status valid = ValidateGemm(transpose_a, transpose_b, a, b, beta, c); !valid.ok()) {
      return valid;
    }
    gemm_.Run(transpose_a, transpose_b, alpha, a, b, beta, c);
    return absl::OkStatus();
  }

  absl::Status Convert(const void* in, DType in_type, void* out, DType out_type,
                       int64_t n) override {
    if (in_type == out_type) {
      std::memmove(out, in, n * DTypeSize(in_type));
      return absl::OkStatus();
    }
    if (in_type == DType::kF32 && out_type == DType::kF16) {
      FloatToHalfRow(static_cast<const float*>(in), static_cast<uint16_t*>(out), n);
      return absl::OkStatus();
    }
    if (in_type == DType::kF16 && out_type == DType::kF32) {
      HalfToFloatRow(static_cast<const uint16_t*>(in), static_cast<float*>(out), n);
      return absl::OkStatus();
    }
    for (int64_t i = 0; i < n; ++i) StoreFromFloat(out, out_type, i, LoadAsFloat(in, in_type, i));
    return absl::OkStatus();
  }

  absl::Status AddTo(const void* x, DType x_type, float* y, int64_t n) override {
    if (x_type == DType::kF32) {
      const float* xs = static_cast<const float*>(x);
      for (int64_t i = 0; i < n; ++i) y[i] += xs[i];
    } else {
      for (int64_t i = 0; i < n; ++i) y[i] += LoadAsFloat(x, x_type, i);
    }
    return absl::OkStatus();
  }

  absl::Status SumRows(const float* table, int64_t table_rows, int64_t cols, const int32_t* row_ids,
                       int rows_per_token, int64_t tokens, void* out, DType out_type) override {
    std::vector<float> row(cols);
    char* out_bytes = static_cast<char*>(out);
    for (int64_t t = 0; t < tokens; ++t) {
      std::fill(row.begin(), row.end(), 0.f);
      for (int j = 0; j < rows_per_token; ++j) {
        const int32_t id = row_ids[t * rows_per_token + j];
        if (id < 0 || id >= table_rows) continue;
        const float* r = table + id * cols;
        for (int64_t c = 0; c < cols; ++c) row[c] += r[c];
      }
      ATTN_RETURN_IF_ERROR(Convert(row.data(), DType::kF32,
                                   out_bytes + t * cols * DTypeSize(out_type), out_type, cols));
    }
    return absl::OkStatus();
  }

  absl::Status LayerNormForward(const float* x, const float* gain, const float* bias, int64_t rows,
                                int64_t cols, float epsilon, float* y, float* mean,
                                float* rstd) override {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * cols;
      double sum = 0;
      for (int64_t c = 0; c < cols; ++c) sum += xr[c];
      const float mu = static_cast<float>(sum / cols);
      double var = 0;
      for (int64_t c = 0; c < cols; ++c) var += (xr[c] - mu) * (xr[c] - mu);
      const float rs = 1.f / std::sqrt(static_cast<float>(var / cols) + epsilon);
      float* yr = y + r * cols;
      for (int64_t c = 0; c < cols; ++c) yr[c] = (xr[c] - mu) * rs * gain[c] + bias[c];
      mean[r] = mu;
      rstd[r] = rs;
    }
    return absl::OkStatus();
  }

  absl::Status LayerNormBackward(const float* dy, const float* x, const float* gain,
                                 const float* mean, const float* rstd, int64_t rows, int64_t cols,
                                 float* dx, float* d_gain, float* d_bias) override {
    std::fill(d_gain, d_gain + cols, 0.f);
    std::fill(d_bias, d_bias + cols, 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * cols;
      const float* dyr = dy + r * cols;
      float* dxr = dx + r * cols;
      // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gain.
      double g_sum = 0, gx_sum = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const float xhat = (xr[c] - mean[r]) * rstd[r];
        const float g = dyr[c] * gain[c];
        g_sum += g;
        gx_sum += g * xhat;
        d_gain[c] += dyr[c] * xhat;
        d_bias[c] += dyr[c];
      }
      const float g_mean = static_cast<float>(g_sum / cols);
      const float gx_mean = static_cast<float>(gx_sum / cols);
      for (int64_t c = 0; c < cols; ++c) {
        const float xhat = (xr[c] - mean[r]) * rstd[r];
        dxr[c] = rstd[r] * (dyr[c] * gain[c] - g_mean - xhat * gx_mean);
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<LossSums> SoftmaxCrossEntropy(const float* logits, const int32_t* labels,
                                               int64_t rows, int64_t classes, float grad_scale,
                                               float* d_logits) override {
    LossSums sums;
    for (int64_t r = 0; r < rows; ++r) {
      const float* z = logits + r * classes;
      float* dz = d_logits + r * classes;
      const int32_t label = labels[r];
      if (label < 0) {
        std::fill(dz, dz + classes, 0.f);
        continue;
      }
      if (label >= classes) {
        return absl::InvalidArgumentError("cross-entropy: a label is not below the classes");
      }
      int64_t best = 0;
      float top = z[0];
      for (int64_t c = 1; c < classes; ++c) {
        if (z[c] > top) {
          top = z[c];
          best = c;
        }
      }
      double sum = 0;
      for (int64_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(z[c] - top));
      const double log_sum = std::log(sum);
      sums.loss += log_sum - (z[label] - top);
      sums.correct += best == label ? 1 : 0;
      for (int64_t c = 0; c < classes; ++c) {
        const double p = std::exp(static_cast<double>(z[c] - top) - log_sum);
        dz[c] = grad_scale * static_cast<float>(p - (c == label ? 1.0 : 0.0));
      }
    }
    return sums;
  }

  absl::StatusOr<LossSums> SquaredError(const float* out, const float* target, int64_t n,
                                        float grad_scale, float* d_out) override {
    LossSums sums;
    for (int64_t i = 0; i < n; ++i) {
      const float e = out[i] - target[i];
      sums.loss += static_cast<double>(e) * e;
      d_out[i] = grad_scale * 2.f * e;
    }
    return sums;
  }

  absl::StatusOr<double> SumOfSquares(const float* x, int64_t n) override {
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
    return sum;
  }

  absl::Status AdamW(const UpdateStep& s, int64_t n, float* weights, const float* gradients,
                     float* m, float* v) override {
    for (int64_t i = 0; i < n; ++i) {
      const float g = gradients[i] * s.grad_scale;
      m[i] = s.beta1 * m[i] + (1.f - s.beta1) * g;
      v[i] = s.beta2 * v[i] + (1.f - s.beta2) * g * g;
      const float m_hat = m[i] / s.bias_correction1;
      const float v_hat = v[i] / s.bias_correction2;
      weights[i] -=
          s.learning_rate * (m_hat / (std::sqrt(v_hat) + s.epsilon) + s.weight_decay * weights[i]);
    }
    return absl::OkStatus();
  }

  absl::Status Sgd(const UpdateStep& s, int64_t n, float* weights,
                   const float* gradients) override {
    for (int64_t i = 0; i < n; ++i) {
      weights[i] -= s.learning_rate * (gradients[i] * s.grad_scale + s.weight_decay * weights[i]);
    }
    return absl::OkStatus();
  }

 private:
  cpu::ThreadPool pool_;
  CpuGemm gemm_;
};

}  // namespace

std::unique_ptr<LayerOps> CreateCpuLayerOps(const LayerOpsOptions& options) {
  return std::make_unique<CpuLayerOps>(options);
}

}  // namespace attn::layers
