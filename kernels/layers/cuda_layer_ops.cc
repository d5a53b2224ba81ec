// LayerOps on a CUDA device (CUDA builds only): GEMMs on cuBLAS (cublasGemmEx, float32
// accumulation, row-major through the transposed column-major product), everything else in the
// kernels of cuda_layer_kernels.cu, all on one stream of the ops' own, which the engines' calls
// share. Reductions land in a small device buffer and come back with one copy and a sync.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"
#include "cuda/common/cuda_status.h"
#include "layers/cuda_layer_kernels.h"
#include "layers/layer_ops_internal.h"

namespace attn::layers {
namespace {

using attn::cuda::CublasStatus;
using attn::cuda::CudaStatus;

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF32:
      break;
  }
  return CUDA_R_32F;
}

class CudaLayerOps final : public LayerOps {
 public:
  ~CudaLayerOps() override {
    sums_ = Buffer();
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init(int device) {
    ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    ATTN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ATTN_CUBLAS_RETURN_IF_ERROR(cublasCreate(&cublas_));
    ATTN_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas_, stream_));
    ATTN_ASSIGN_OR_RETURN(sums_, Allocate(2 * sizeof(double)));
    return absl::OkStatus();
  }

  MemorySpace memory_space() const override { return MemorySpace::kDevice; }
  std::string_view name() const override { return "cuda"; }
  void* stream() const override { return stream_; }

  absl::StatusOr<Buffer> Allocate(int64_t bytes) override {
    void* data = nullptr;
    ATTN_CUDA_RETURN_IF_ERROR(cudaMalloc(&data, std::max<int64_t>(bytes, 1)));
    Buffer buffer(data, bytes, [](void* p) { cudaFree(p); });
    ATTN_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(data, 0, std::max<int64_t>(bytes, 1), stream_));
    return buffer;
  }
  absl::Status Upload(void* dst, const void* host, int64_t bytes) override {
    // From pageable memory the copy has been staged when the call returns: `host` may be
    // reused at once.
    return CudaStatus(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_),
                      "cudaMemcpyAsync (upload)");
  }
  absl::Status Download(void* host, const void* src, int64_t bytes) override {
    ATTN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_));
    return Synchronize();
  }
  absl::Status Synchronize() override {
    return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  absl::Status Gemm(bool transpose_a, bool transpose_b, float alpha, ConstMatrix a, ConstMatrix b,
                    float beta, Matrix c) override {
    ATTN_RETURN_IF_ERROR(ValidateGemm(transpose_a, transpose_b, a, b, beta, c));
    const int64_t m = c.rows, n = c.cols, k = transpose_a ? a.rows : a.cols;
    if (m == 0 || n == 0) return absl::OkStatus();
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a row-major matrix
    // read as column-major is its transpose: B goes first, each op as asked.
    return CublasStatus(
        cublasGemmEx(cublas_, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                     transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
                     static_cast<int>(m), static_cast<int>(k), &alpha, b.data, CudaType(b.dtype),
                     static_cast<int>(b.cols), a.data, CudaType(a.dtype), static_cast<int>(a.cols),
                     &beta, c.data, CudaType(c.dtype), static_cast<int>(n), CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  }

  absl::Status Convert(const void* in, DType in_type, void* out, DType out_type,
                       int64_t n) override {
    return Launched(cuda_kernels::Convert(in, in_type, out, out_type, n, stream_), "convert");
  }
  absl::Status AddTo(const void* x, DType x_type, float* y, int64_t n) override {
    return Launched(cuda_kernels::AddTo(x, x_type, y, n, stream_), "add");
  }

  absl::Status SumRows(const float* table, int64_t table_rows, int64_t cols, const int32_t* row_ids,
                       int rows_per_token, int64_t tokens, void* out, DType out_type) override {
    return Launched(cuda_kernels::SumRows(table, table_rows, cols, row_ids, rows_per_token, tokens,
                                          out, out_type, stream_),
                    "sum of rows");
  }

  absl::Status LayerNormForward(const float* x, const float* gain, const float* bias, int64_t rows,
                                int64_t cols, float epsilon, float* y, float* mean,
                                float* rstd) override {
    return Launched(
        cuda_kernels::LayerNormForward(x, gain, bias, rows, cols, epsilon, y, mean, rstd, stream_),
        "layer norm forward");
  }
  absl::Status LayerNormBackward(const float* dy, const float* x, const float* gain,
                                 const float* mean, const float* rstd, int64_t rows, int64_t cols,
                                 float* dx, float* d_gain, float* d_bias) override {
    ATTN_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(d_gain, 0, cols * sizeof(float), stream_));
    ATTN_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(d_bias, 0, cols * sizeof(float), stream_));
    return Launched(cuda_kernels::LayerNormBackward(dy, x, gain, mean, rstd, rows, cols, dx, d_gain,
                                                    d_bias, stream_),
                    "layer norm backward");
  }

  absl::StatusOr<LossSums> SoftmaxCrossEntropy(const float* logits, const int32_t* labels,
                                               int64_t rows, int64_t classes, float grad_scale,
                                               float* d_logits) override {
    ATTN_RETURN_IF_ERROR(ZeroSums());
    ATTN_RETURN_IF_ERROR(
        Launched(cuda_kernels::SoftmaxCrossEntropy(logits, labels, rows, classes, grad_scale,
                                                   d_logits, sums_.as<double>(), stream_),
                 "cross-entropy"));
    ATTN_ASSIGN_OR_RETURN(const Sums sums, ReadSums());
    return LossSums{sums.values[0], static_cast<int64_t>(sums.values[1] + 0.5)};
  }
  absl::StatusOr<LossSums> SquaredError(const float* out, const float* target, int64_t n,
                                        float grad_scale, float* d_out) override {
    ATTN_RETURN_IF_ERROR(ZeroSums());
    ATTN_RETURN_IF_ERROR(Launched(
        cuda_kernels::SquaredError(out, target, n, grad_scale, d_out, sums_.as<double>(), stream_),
        "squared error"));
    ATTN_ASSIGN_OR_RETURN(const Sums sums, ReadSums());
    return LossSums{sums.values[0], 0};
  }
  absl::StatusOr<double> SumOfSquares(const float* x, int64_t n) override {
    ATTN_RETURN_IF_ERROR(ZeroSums());
    ATTN_RETURN_IF_ERROR(
        Launched(cuda_kernels::SumOfSquares(x, n, sums_.as<double>(), stream_), "sum of squares"));
    ATTN_ASSIGN_OR_RETURN(const Sums sums, ReadSums());
    return sums.values[0];
  }

  absl::Status AdamW(const UpdateStep& step, int64_t n, float* weights, const float* gradients,
                     float* m, float* v) override {
    return Launched(cuda_kernels::AdamW(step, n, weights, gradients, m, v, stream_), "adamw");
  }
  absl::Status Sgd(const UpdateStep& step, int64_t n, float* weights,
                   const float* gradients) override {
    return Launched(cuda_kernels::Sgd(step, n, weights, gradients, stream_), "sgd");
  }

 private:
  struct Sums {
    double values[2];
  };

  static absl::Status Launched(cudaError_t error, const char* kernel) {
    return CudaStatus(error, absl::StrCat("launch of the ", kernel, " kernel"));
  }
  absl::Status ZeroSums() {
    return CudaStatus(cudaMemsetAsync(sums_.data(), 0, 2 * sizeof(double), stream_),
                      "cudaMemsetAsync (sums)");
  }
  absl::StatusOr<Sums> ReadSums() {
    Sums sums;
    ATTN_RETURN_IF_ERROR(Download(sums.values, sums_.data(), sizeof(sums.values)));
    return sums;
  }

  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  Buffer sums_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LayerOps>> CreateCudaLayerOps(const LayerOpsOptions& options) {
  auto ops = std::make_unique<CudaLayerOps>();
  ATTN_RETURN_IF_ERROR(ops->Init(options.device));
  return ops;
}

}  // namespace attn::layers
