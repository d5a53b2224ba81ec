// The primitive operations an attention layer is trained with, besides attention itself: GEMMs,
// dtype conversion, layer norm, the two losses, the optimiser updates. The layer
// (attention_layer.h), its objectives and optimiser are written once over this interface; the CPU
// implementation (cpu_layer_ops.cc) and the CUDA one (cuda_layer_ops.cc, cuBLAS and small
// kernels, CUDA builds only) run them. Pointers are in the ops' memory space unless named
// `host`; matrices are row-major and contiguous.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/dtype.h"
#include "attn/engine.h"

namespace attn::layers {

struct ConstMatrix {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
};

struct Matrix {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  operator ConstMatrix() const { return {data, dtype, rows, cols}; }
};

// Memory the ops allocated; frees it when destroyed. Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(void* data, int64_t bytes, std::function<void(void*)> release)
      : data_(data), bytes_(bytes), release_(std::move(release)) {}
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  int64_t bytes() const { return bytes_; }

 private:
  void Reset();
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  std::function<void(void*)> release_;
};

// Sums a loss reduction hands back to the host.
struct LossSums {
  double loss = 0;      // summed over the scored rows (cross-entropy) or elements (squared error)
  int64_t correct = 0;  // cross-entropy: scored rows whose argmax is the label
};

// One AdamW (or SGD) update of a tensor. Gradients are multiplied by grad_scale first (the
// inverse loss scale times the clipping factor).
struct UpdateStep {
  float learning_rate = 0;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float weight_decay = 0;
  float bias_correction1 = 1;  // 1 - beta1^t
  float bias_correction2 = 1;  // 1 - beta2^t
  float grad_scale = 1;
};

class LayerOps {
 public:
  virtual ~LayerOps() = default;

  virtual MemorySpace memory_space() const = 0;
  virtual std::string_view name() const = 0;
  // Where engines launch (a cudaStream_t); null on the CPU. Engine calls use it so that they
  // order with the ops' own work.
  virtual void* stream() const = 0;

  // Zero-filled.
  virtual absl::StatusOr<Buffer> Allocate(int64_t bytes) = 0;
  virtual absl::Status Upload(void* dst, const void* host, int64_t bytes) = 0;
  virtual absl::Status Download(void* host, const void* src, int64_t bytes) = 0;
  // Waits for everything issued so far.
  virtual absl::Status Synchronize() = 0;

  // c = alpha * op(a) op(b) + beta * c, op = transpose when asked. a and b share a dtype; c is
  // float32 (any beta) or that dtype (beta 0). Accumulates in float32.
  virtual absl::Status Gemm(bool transpose_a, bool transpose_b, float alpha, ConstMatrix a,
                            ConstMatrix b, float beta, Matrix c) = 0;
  // out = in, element by element, rounded to nearest even.
  virtual absl::Status Convert(const void* in, DType in_type, void* out, DType out_type,
                               int64_t n) = 0;
  // y += x.
  virtual absl::Status AddTo(const void* x, DType x_type, float* y, int64_t n) = 0;
  // Row t of out [tokens, cols] = the sum of rows row_ids[t * rows_per_token + j] of table
  // [table_rows, cols] float32, over j in order, added in float32 from zero and rounded to
  // out_type (the values a host sum then Convert gives). Ids outside [0, table_rows) add nothing.
  virtual absl::Status SumRows(const float* table, int64_t table_rows, int64_t cols,
                               const int32_t* row_ids, int rows_per_token, int64_t tokens,
                               void* out, DType out_type) = 0;

  // y = (x - mean) * rstd * gain + bias over each row of `cols`; keeps mean and rstd per row.
  virtual absl::Status LayerNormForward(const float* x, const float* gain, const float* bias,
                                        int64_t rows, int64_t cols, float epsilon, float* y,
                                        float* mean, float* rstd) = 0;
  // dx, d_gain and d_bias are overwritten.
  virtual absl::Status LayerNormBackward(const float* dy, const float* x, const float* gain,
                                         const float* mean, const float* rstd, int64_t rows,
                                         int64_t cols, float* dx, float* d_gain, float* d_bias) = 0;

  // Rows with label >= 0 are scored: loss -log softmax(logits)[label], and d_logits =
  // grad_scale * (softmax - onehot(label)); other rows get d_logits = 0. Sums come to the host.
  virtual absl::StatusOr<LossSums> SoftmaxCrossEntropy(const float* logits, const int32_t* labels,
                                                       int64_t rows, int64_t classes,
                                                       float grad_scale, float* d_logits) = 0;
  // loss = sum (out - target)^2; d_out = grad_scale * 2 (out - target).
  virtual absl::StatusOr<LossSums> SquaredError(const float* out, const float* target, int64_t n,
                                                float grad_scale, float* d_out) = 0;

  // sum x^2, in float64 on the host (not finite when an element is not).
  virtual absl::StatusOr<double> SumOfSquares(const float* x, int64_t n) = 0;
  virtual absl::Status AdamW(const UpdateStep& step, int64_t n, float* weights,
                             const float* gradients, float* m, float* v) = 0;
  // weights -= lr * (grad_scale * g + weight_decay * weights).
  virtual absl::Status Sgd(const UpdateStep& step, int64_t n, float* weights,
                           const float* gradients) = 0;
};

struct LayerOpsOptions {
  int num_threads = 1;  // CPU: GEMM and row-loop threads, the caller's included
  int device = 0;       // CUDA: the ordinal
};

// kHost: the CPU ops. kDevice: the CUDA ops (cuBLAS), UNAVAILABLE in a build without CUDA or
// without a usable device.
absl::StatusOr<std::unique_ptr<LayerOps>> CreateLayerOps(MemorySpace space,
                                                         const LayerOpsOptions& options = {});

}  // namespace attn::layers
