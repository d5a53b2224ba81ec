#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "attn/mask.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/element_convert.cuh"
#include "cuda/naive/naive_kernels.h"

namespace attn::cuda::naive {
namespace {

constexpr int kWarpSize = 32;
constexpr int kRowsPerBlock = 8;  // one warp per row
constexpr int kThreads = kWarpSize * kRowsPerBlock;

__global__ void BuildPointersKernel(ChunkGeometry g, Operands x, GemmPointers out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= g.count) return;
  const int64_t m = g.m0 + i;
  const int64_t b = m / g.num_heads;
  const int64_t h = m % g.num_heads;
  const int64_t kv = h / g.group_size;
  const int64_t q_token = g.q_begin + b * g.lq;
  const int64_t k_token = g.k_begin + b * g.lk;
  const auto at = [&](const void* base, int64_t token, int64_t token_stride, int64_t head,
                      int64_t head_stride) {
    return static_cast<const char*>(base) +
           (token * token_stride + head * head_stride) * x.element_size;
  };
  float* s = g.s + i * g.s_matrix_stride;
  out.a1[i] = at(x.k, k_token, x.k_token_stride, kv, x.k_head_stride);
  out.b1[i] = at(x.q, q_token, x.q_token_stride, h, x.q_head_stride);
  out.c1[i] = s;
  out.a2[i] = at(x.v, k_token, x.v_token_stride, kv, x.v_head_stride);
  out.b2[i] = s;
  out.c2[i] = const_cast<char*>(at(x.o, q_token, x.o_token_stride, h, x.o_head_stride));
}

// Running (max, sum of exp) pair of a softmax, merged without producing NaN from two empty
// states (-inf - -inf). A NaN score is carried by `sum`, never by `max`.
struct RowState {
  float max = -INFINITY;
  float sum = 0.f;
};

__device__ __forceinline__ RowState Merge(RowState a, RowState b) {
  const float max = fmaxf(a.max, b.max);
  if (max == -INFINITY) return {max, a.sum + b.sum};
  return {max, a.sum * expf(a.max - max) + b.sum * expf(b.max - max)};
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    SoftmaxRowsKernel(ChunkGeometry g, int window_left, int window_right, float* lse,
                      int64_t total_q) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + threadIdx.x / kWarpSize;
  if (row >= g.count * g.lq) return;  // uniform across the warp
  const int lane = threadIdx.x % kWarpSize;
  const int64_t local_m = row / g.lq;
  const int64_t i = row % g.lq;
  float* s = g.s + local_m * g.s_matrix_stride + i * g.lk;
  T* p = reinterpret_cast<T*>(s);

  const KeyRange keys = VisibleKeys(i, g.lq, g.lk, window_left, window_right);
  const int64_t begin = keys.begin;
  const int64_t end = keys.end > keys.begin ? keys.end : keys.begin;

  RowState state;
  for (int64_t j = begin + lane; j < end; j += kWarpSize) {
    const float x = s[j];
    // fmaxf would drop a NaN score; make the sum carry it instead (NaN * 0 stays NaN).
    state = isnan(x) ? RowState{state.max, NAN} : Merge(state, RowState{x, 1.f});
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const RowState other{__shfl_xor_sync(0xffffffffu, state.max, offset),
                         __shfl_xor_sync(0xffffffffu, state.sum, offset)};
    state = Merge(state, other);
  }
  const float inv_sum = 1.f / state.sum;

  // P overwrites S in place. A P element (2 or 4 bytes) never lies past the S element of the
  // same column, so once the warp has read a block of 32 scores it may write their
  // probabilities: everything they overwrite has been read.
  for (int64_t c = 0; c < g.lk; c += kWarpSize) {
    const int64_t j = c + lane;
    float prob = 0.f;
    if (j >= begin && j < end) prob = expf(s[j] - state.max) * inv_sum;
    __syncwarp();
    if (j < g.lk) p[j] = FromFloat<T>(prob);
    __syncwarp();
  }

  if (lse != nullptr && lane == 0) {
    const int64_t m = g.m0 + local_m;
    const int64_t b = m / g.num_heads;
    const int64_t h = m % g.num_heads;
    const float value = state.sum == 0.f ? -INFINITY : state.max + logf(state.sum);
    lse[h * total_q + g.q_begin + b * g.lq + i] = value;
  }
}

template <typename T>
__global__ void FillKeylessKernel(T* o, int64_t o_token_stride, int64_t o_head_stride,
                                  int64_t token_begin, int64_t tokens, int num_heads, int head_dim,
                                  float* lse, int64_t total_q) {
  const int64_t rows = tokens * num_heads;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t t = token_begin + r / num_heads;
    const int64_t h = r % num_heads;
    T* row = o + t * o_token_stride + h * o_head_stride;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) row[d] = FromFloat<T>(0.f);
    if (lse != nullptr && threadIdx.x == 0) lse[h * total_q + t] = -INFINITY;
  }
}

int64_t Blocks(int64_t work, int64_t per_block) { return (work + per_block - 1) / per_block; }

}  // namespace

absl::Status LaunchBuildPointers(const ChunkGeometry& g, const Operands& x, GemmPointers out,
                                 cudaStream_t stream) {
  if (g.count == 0) return absl::OkStatus();
  constexpr int kBlock = 256;
  BuildPointersKernel<<<Blocks(g.count, kBlock), kBlock, 0, stream>>>(g, x, out);
  return LaunchStatus("naive BuildPointersKernel");
}

absl::Status LaunchSoftmaxRows(const ChunkGeometry& g, DType p_dtype, int window_left,
                               int window_right, float* lse, int64_t total_q, cudaStream_t stream) {
  const int64_t rows = g.count * g.lq;
  if (rows == 0) return absl::OkStatus();
  const int64_t blocks = Blocks(rows, kRowsPerBlock);
  if (blocks > 0x7fffffff) {
    return absl::InvalidArgumentError("naive softmax: too many rows in one chunk");
  }
  switch (p_dtype) {
    case DType::kF32:
      SoftmaxRowsKernel<float>
          <<<blocks, kThreads, 0, stream>>>(g, window_left, window_right, lse, total_q);
      break;
    case DType::kF16:
      SoftmaxRowsKernel<__half>
          <<<blocks, kThreads, 0, stream>>>(g, window_left, window_right, lse, total_q);
      break;
    case DType::kBF16:
      SoftmaxRowsKernel<__nv_bfloat16>
          <<<blocks, kThreads, 0, stream>>>(g, window_left, window_right, lse, total_q);
      break;
  }
  return LaunchStatus("naive SoftmaxRowsKernel");
}

absl::Status LaunchFillKeyless(void* o, int64_t o_token_stride, int64_t o_head_stride,
                               int64_t token_begin, int64_t tokens, int num_heads, int head_dim,
                               DType dtype, float* lse, int64_t total_q, cudaStream_t stream) {
  const int64_t rows = tokens * num_heads;
  if (rows == 0) return absl::OkStatus();
  const dim3 block(32, 8);
  const unsigned grid =
      static_cast<unsigned>(Blocks(rows, block.y) < 65535 ? Blocks(rows, block.y) : 65535);
  switch (dtype) {
    case DType::kF32:
      FillKeylessKernel<<<grid, block, 0, stream>>>(static_cast<float*>(o), o_token_stride,
                                                    o_head_stride, token_begin, tokens, num_heads,
                                                    head_dim, lse, total_q);
      break;
    case DType::kF16:
      FillKeylessKernel<<<grid, block, 0, stream>>>(static_cast<__half*>(o), o_token_stride,
                                                    o_head_stride, token_begin, tokens, num_heads,
                                                    head_dim, lse, total_q);
      break;
    case DType::kBF16:
      FillKeylessKernel<<<grid, block, 0, stream>>>(static_cast<__nv_bfloat16*>(o), o_token_stride,
                                                    o_head_stride, token_begin, tokens, num_heads,
                                                    head_dim, lse, total_q);
      break;
  }
  return LaunchStatus("naive FillKeylessKernel");
}

}  // namespace attn::cuda::naive
