// The small CUDA kernels of the CUDA LayerOps (CUDA builds only): element-wise conversions and
// updates, layer norm rows, the loss reductions. Every launcher returns the launch's error
// (cudaGetLastError); reductions add into float64 sums the caller zeroed on the same stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attn/dtype.h"
#include "layers/layer_ops.h"

namespace attn::layers::cuda_kernels {

cudaError_t Convert(const void* in, DType in_type, void* out, DType out_type, int64_t n,
                    cudaStream_t stream);
cudaError_t AddTo(const void* x, DType x_type, float* y, int64_t n, cudaStream_t stream);
cudaError_t SumRows(const float* table, int64_t table_rows, int64_t cols, const int32_t* row_ids,
                    int rows_per_token, int64_t tokens, void* out, DType out_type,
                    cudaStream_t stream);

cudaError_t LayerNormForward(const float* x, const float* gain, const float* bias, int64_t rows,
                             int64_t cols, float epsilon, float* y, float* mean, float* rstd,
                             cudaStream_t stream);
// d_gain and d_bias must be zero: blocks add their rows' sums into them.
cudaError_t LayerNormBackward(const float* dy, const float* x, const float* gain, const float* mean,
                              const float* rstd, int64_t rows, int64_t cols, float* dx,
                              float* d_gain, float* d_bias, cudaStream_t stream);

// sums[0] += loss, sums[1] += correct rows.
cudaError_t SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int64_t rows,
                                int64_t classes, float grad_scale, float* d_logits, double* sums,
                                cudaStream_t stream);
// sums[0] += squared error.
cudaError_t SquaredError(const float* out, const float* target, int64_t n, float grad_scale,
                         float* d_out, double* sums, cudaStream_t stream);
cudaError_t SumOfSquares(const float* x, int64_t n, double* sums, cudaStream_t stream);

cudaError_t AdamW(const UpdateStep& step, int64_t n, float* weights, const float* gradients,
                  float* m, float* v, cudaStream_t stream);
cudaError_t Sgd(const UpdateStep& step, int64_t n, float* weights, const float* gradients,
                cudaStream_t stream);

}  // namespace attn::layers::cuda_kernels
