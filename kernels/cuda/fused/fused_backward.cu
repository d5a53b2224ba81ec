// The fused backward's launch (see fused_backward.h for the algorithm): the D kernel, the main
// kernel of the table's row (fused_backward_kernel.cuh, one generated file per row), the dQ
// kernel, and the workspace they share.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "cuda/common/alignment.h"
#include "cuda/common/element_convert.cuh"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/dq_order.cuh"
#include "cuda/fused/fused_backward.h"
#include "cuda/fused/fused_backward_launch.h"

namespace attn::cuda {
namespace {

// Block size of the D and dQ kernels: 8 warps, D taking one (token, head) row per warp.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// delta[h, t] = sum_c dO[t, h, c] * O[t, h, c] in float32: one warp per (token, head).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RowDotKernel(const FusedBackwardParams p, float* delta) {
  const int64_t row = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  if (row >= p.total_q * p.num_heads) return;
  const int64_t t = row / p.num_heads;
  const int h = static_cast<int>(row % p.num_heads);
  const T* o = static_cast<const T*>(p.o) + t * p.o_token_stride + h * p.o_head_stride;
  const T* d_o = static_cast<const T*>(p.d_o) + t * p.do_token_stride + h * p.do_head_stride;
  float sum = 0.f;
  for (int c = threadIdx.x % 32; c < p.head_dim; c += 32) sum += ToFloat(o[c]) * ToFloat(d_o[c]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) delta[h * p.total_q + t] = sum;
}

// dq[t, h, c] = accumulator, rounded to the dtype.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    StoreDqKernel(const FusedBackwardParams p, const float* dq_accum) {
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  const int64_t row_elems = int64_t{p.num_heads} * p.head_dim;
  if (i >= p.total_q * row_elems) return;
  const int64_t t = i / row_elems;
  const int h = static_cast<int>((i % row_elems) / p.head_dim);
  const int c = static_cast<int>(i % p.head_dim);
  static_cast<T*>(p.dq)[t * p.dq_token_stride + h * p.dq_head_stride + c] =
      FromFloat<T>(dq_accum[i]);
}

// The workspace holds D, padded to 16 bytes so that the dQ accumulator after it takes vector
// atomics and bulk reductions, then the accumulator, then the deterministic mode's counters.
int64_t DeltaFloats(int64_t rows) { return (rows + 3) / 4 * 4; }

int64_t DqCounterTiles(int64_t max_seqlen_q) {
  return (max_seqlen_q + kDqCounterRows - 1) / kDqCounterRows;
}

bool Aligned16(const void* data, int64_t token_stride, int64_t head_stride) {
  return RowsAligned16(data, token_stride, head_stride, /*element_bytes=*/2);
}

template <DType kDType, int kHeadDim>
cudaError_t RunBackward(const FusedBackwardParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  const int64_t rows = p.total_q * p.num_heads;
  const int64_t accum_elems = rows * kHeadDim;
  FusedBackwardWorkspace work;
  float* delta = static_cast<float*>(p.workspace);
  work.delta = delta;
  work.dq_accum = delta + DeltaFloats(rows);
  work.dq_tile_counters = reinterpret_cast<int*>(work.dq_accum + accum_elems);
  work.query_tiles = DqCounterTiles(p.max_seqlen_q);
  if (cudaError_t e = cudaMemsetAsync(work.dq_accum, 0, accum_elems * sizeof(float), stream);
      e != cudaSuccess) {
    return e;
  }
  if (p.deterministic) {
    const int64_t counters = int64_t{p.batch} * p.num_heads * work.query_tiles;
    if (cudaError_t e = cudaMemsetAsync(work.dq_tile_counters, 0, counters * sizeof(int), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  if (rows > 0) {
    RowDotKernel<T>
        <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(p, delta);
  }

  const bool aligned_inputs = Aligned16(p.q, p.q_token_stride, p.q_head_stride) &&
                              Aligned16(p.k, p.k_token_stride, p.k_head_stride) &&
                              Aligned16(p.v, p.v_token_stride, p.v_head_stride) &&
                              Aligned16(p.d_o, p.do_token_stride, p.do_head_stride);
  const bool aligned_outputs = Aligned16(p.dk, p.dk_token_stride, p.dk_head_stride) &&
                               Aligned16(p.dv, p.dv_token_stride, p.dv_head_stride);
  if (cudaError_t e = RunFusedBackwardKernel<kDType, kHeadDim>(p, work, aligned_inputs,
                                                               aligned_outputs, stream);
      e != cudaSuccess) {
    return e;
  }
  if (accum_elems > 0) {
    StoreDqKernel<T>
        <<<static_cast<unsigned>((accum_elems + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
            p, work.dq_accum);
  }
  return cudaGetLastError();
}

}  // namespace

int64_t FusedBackwardWorkspaceBytes(const AttentionProblem& p) {
  const int64_t rows = p.total_q() * p.num_heads;
  const int64_t counters = int64_t{p.batch()} * p.num_heads * DqCounterTiles(p.max_seqlen_q());
  return (DeltaFloats(rows) + rows * p.head_dim) * static_cast<int64_t>(sizeof(float)) +
         counters * static_cast<int64_t>(sizeof(int));
}

absl::Status LaunchFusedBackward(const FusedBackwardParams& p, void* stream) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError("cuda_fused: num_heads must be a multiple of num_kv_heads");
  }
  if (p.total_q == 0 && p.max_seqlen_k == 0) return absl::OkStatus();
  auto* s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = DispatchFusedKernel<Pass::kBackward>(
      p.dtype, p.head_dim, cudaErrorInvalidValue,
      [&]<DType kDType, int kHeadDim>() { return RunBackward<kDType, kHeadDim>(p, s); });
  if (err == cudaErrorNotSupported) {
    return absl::UnimplementedError(
        "cuda_fused: the pinned backward kernel (FusedBackwardParams::kernel) cannot run on this "
        "device, build or problem");
  }
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cuda_fused: backward launch failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace attn::cuda
