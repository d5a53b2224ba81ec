#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "attn/mask.h"
#include "cuda/common/cuda_status.h"
#include "cuda/naive/naive_backward_kernels.h"

namespace attn::cuda::naive {
namespace {

constexpr int kWarpSize = 32;
constexpr int kRowsPerBlock = 8;  // one warp per row
constexpr int kThreads = kWarpSize * kRowsPerBlock;

// Element access by run-time dtype: these kernels are few and memory-bound, so one instantiation
// serves every dtype.
__device__ __forceinline__ float LoadAs(const void* base, int64_t i, DType t) {
  switch (t) {
    case DType::kF16:
      return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

__device__ __forceinline__ void StoreAs(void* base, int64_t i, DType t, float x) {
  switch (t) {
    case DType::kF16:
      static_cast<__half*>(base)[i] = __float2half_rn(x);
      break;
    case DType::kBF16:
      static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x);
      break;
    default:
      static_cast<float*>(base)[i] = x;
      break;
  }
}

__global__ void OperandPointersKernel(ChunkGeometry g, OperandTable table, void** arrays,
                                      int64_t capacity) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= g.count) return;
  for (int s = 0; s < table.count; ++s)
    arrays[s * capacity + i] = const_cast<char*>(OperandAddress(table.spec[s], g, i));
}

__device__ __forceinline__ int64_t RowOf(const ChunkGeometry& g, int64_t* local_m, int64_t* i) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + threadIdx.x / kWarpSize;
  *local_m = row / g.lq;
  *i = row % g.lq;
  return row;
}

__global__ void __launch_bounds__(kThreads)
    RecomputeProbsKernel(ChunkGeometry g, DType dtype, int window_left, int window_right,
                         const float* lse, int64_t total_q) {
  int64_t local_m, i;
  if (RowOf(g, &local_m, &i) >= g.count * g.lq) return;  // uniform across the warp
  const int lane = threadIdx.x % kWarpSize;
  const int64_t m = g.m0 + local_m;
  const int64_t b = m / g.num_heads, h = m % g.num_heads;
  const float row_lse = lse[h * total_q + g.q_begin + b * g.lq + i];
  float* s = g.s + local_m * g.s_matrix_stride + i * g.lk;
  const KeyRange keys = VisibleKeys(i, g.lq, g.lk, window_left, window_right);
  // In place, as in the forward softmax: a P element never lies past its S element.
  for (int64_t c = 0; c < g.lk; c += kWarpSize) {
    const int64_t j = c + lane;
    float prob = 0.f;
    if (j >= keys.begin && j < keys.end) prob = expf(s[j] - row_lse);
    __syncwarp();
    if (j < g.lk) StoreAs(s, j, dtype, prob);
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kThreads)
    ScoreGradientsKernel(ChunkGeometry g, DType dtype, const float* p_base, float* dp_base,
                         float scale) {
  int64_t local_m, i;
  if (RowOf(g, &local_m, &i) >= g.count * g.lq) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t offset = local_m * g.s_matrix_stride + i * g.lk;
  const float* p = p_base + offset;  // dtype elements from here
  float* dp = dp_base + offset;
  float dot = 0.f;
  for (int64_t j = lane; j < g.lk; j += kWarpSize) dot += LoadAs(p, j, dtype) * dp[j];
  for (int o = kWarpSize / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  for (int64_t c = 0; c < g.lk; c += kWarpSize) {
    const int64_t j = c + lane;
    float ds = 0.f;
    if (j < g.lk) ds = scale * LoadAs(p, j, dtype) * (dp[j] - dot);
    __syncwarp();
    if (j < g.lk) StoreAs(dp, j, dtype, ds);
    __syncwarp();
  }
}

__global__ void ReduceGroupsKernel(const float* acc, int64_t tokens, int num_heads,
                                   int num_kv_heads, int head_dim, void* out,
                                   int64_t out_token_stride, int64_t out_head_stride, DType dtype) {
  const int group = num_heads / num_kv_heads;
  const int64_t n = tokens * num_kv_heads * head_dim;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(e % head_dim);
    const int64_t kv = (e / head_dim) % num_kv_heads;
    const int64_t t = e / (static_cast<int64_t>(head_dim) * num_kv_heads);
    const float* src = acc + (t * num_heads + kv * group) * head_dim + c;
    float sum = 0.f;
    for (int j = 0; j < group; ++j) sum += src[j * head_dim];
    StoreAs(out, t * out_token_stride + kv * out_head_stride + c, dtype, sum);
  }
}

int64_t Blocks(int64_t work, int64_t per_block) { return (work + per_block - 1) / per_block; }

absl::Status RowBlocks(const ChunkGeometry& g, int64_t* blocks) {
  *blocks = Blocks(g.count * g.lq, kRowsPerBlock);
  if (*blocks > 0x7fffffff) return absl::InvalidArgumentError("naive backward: chunk too large");
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchOperandPointers(const ChunkGeometry& g, const OperandTable& table, void** arrays,
                                   int64_t capacity, cudaStream_t stream) {
  if (g.count == 0) return absl::OkStatus();
  constexpr int kBlock = 256;
  OperandPointersKernel<<<Blocks(g.count, kBlock), kBlock, 0, stream>>>(g, table, arrays, capacity);
  return LaunchStatus("naive OperandPointersKernel");
}

absl::Status LaunchRecomputeProbs(const ChunkGeometry& g, DType dtype, int window_left,
                                  int window_right, const float* lse, int64_t total_q,
                                  cudaStream_t stream) {
  int64_t blocks = 0;
  ATTN_RETURN_IF_ERROR(RowBlocks(g, &blocks));
  if (blocks == 0) return absl::OkStatus();
  RecomputeProbsKernel<<<blocks, kThreads, 0, stream>>>(g, dtype, window_left, window_right, lse,
                                                        total_q);
  return LaunchStatus("naive RecomputeProbsKernel");
}

absl::Status LaunchScoreGradients(const ChunkGeometry& g, DType dtype, const float* p, float* dp,
                                  float scale, cudaStream_t stream) {
  int64_t blocks = 0;
  ATTN_RETURN_IF_ERROR(RowBlocks(g, &blocks));
  if (blocks == 0) return absl::OkStatus();
  ScoreGradientsKernel<<<blocks, kThreads, 0, stream>>>(g, dtype, p, dp, scale);
  return LaunchStatus("naive ScoreGradientsKernel");
}

absl::Status LaunchReduceGroups(const float* acc, int64_t tokens, int num_heads, int num_kv_heads,
                                int head_dim, void* out, int64_t out_token_stride,
                                int64_t out_head_stride, DType dtype, cudaStream_t stream) {
  const int64_t n = tokens * num_kv_heads * head_dim;
  if (n == 0) return absl::OkStatus();
  constexpr int kBlock = 256;
  const int64_t blocks = std::min<int64_t>(Blocks(n, kBlock), 65535);
  ReduceGroupsKernel<<<blocks, kBlock, 0, stream>>>(acc, tokens, num_heads, num_kv_heads, head_dim,
                                                    out, out_token_stride, out_head_stride, dtype);
  return LaunchStatus("naive ReduceGroupsKernel");
}

}  // namespace attn::cuda::naive
