// The combine of split-KV decode: merging the num_splits partial results of a row tile by the
// online-softmax rule. With split s holding O_s (already divided by its own row sum) and LSE_s:
//   LSE = log(sum_s exp(LSE_s)),  O = sum_s exp(LSE_s - LSE) O_s,
// computed against max_s LSE_s so that no exponential overflows. Splits that saw no key carry
// LSE_s = -inf and O_s = 0 and weigh nothing; a row no split saw gets O = 0 and LSE = -inf.
//
// It runs inside the decode kernel, in the CTA that writes the tile's last partial: every split
// CTA writes its partials, fences, and counts itself in the tile's counter; the one that brings
// the count to num_splits resets it for the next call and merges. That saves the launch and
// the latency of a second kernel (measured in docs/cuda-fused.md).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/fused/paged_forward.h"
#include "cuda/fused/ptx.cuh"

namespace attn::cuda {

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Counts this CTA's partials in its tile's counter (all threads call it after writing them);
// true in the CTA that completes the count, which then owns the merge.
__device__ __forceinline__ bool ArriveLastOfSplits(int* counter, int num_splits, int* flag) {
  __threadfence();  // this thread's partials are visible device-wide before it is counted
  __syncthreads();
  if (threadIdx.x == 0) {
    const int arrived = atomicAdd(counter, 1);
    *flag = arrived == num_splits - 1;
    if (*flag) atomicExch(counter, 0);  // every split is in: ready for the next call
  }
  __syncthreads();
  const bool last = *flag != 0;
  if (last) __threadfence();  // order the reads of the other splits' partials after the count
  return last;
}

// Merges the partials of `rows` query rows, row r being (token tokens[r], head heads[r]), and
// writes O and the LSE. `lse_scratch` holds `rows` floats of shared memory. The partials are
// read through L2 (ld.global.cg): other CTAs wrote them during this kernel.
template <typename Element, int kHeadDim, int kThreads>
__device__ __forceinline__ void CombineSplits(const PagedForwardParams& p, int rows,
                                              const int64_t* row_ids, float* lse_scratch) {
  const int64_t rows_total = p.total_q * p.num_heads;
  const int splits = p.plan.num_splits;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int r = warp; r < rows; r += kThreads / 32) {
    const float* lse_parts = p.lse_partial + row_ids[r];
    float lse_max = -INFINITY;
    for (int s = lane; s < splits; s += 32)
      lse_max = fmaxf(lse_max, __ldcg(lse_parts + s * rows_total));
    lse_max = WarpMax(lse_max);
    float sum = 0.f;
    if (lse_max != -INFINITY) {
      for (int s = lane; s < splits; s += 32)
        sum += expf(__ldcg(lse_parts + s * rows_total) - lse_max);
    }
    sum = WarpSum(sum);
    if (lane == 0) lse_scratch[r] = lse_max == -INFINITY ? -INFINITY : lse_max + logf(sum);
  }
  __syncthreads();

  // Each thread merges 4 columns of a row at a time over every split: independent loads, many
  // in flight.
  constexpr int kVectors = kHeadDim / 4;
  for (int c = threadIdx.x; c < rows * kVectors; c += kThreads) {
    const int r = c / kVectors;
    const int col = (c % kVectors) * 4;
    const int64_t row = row_ids[r];
    const float lse = lse_scratch[r];
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (lse != -INFINITY) {
#pragma unroll 8
      for (int s = 0; s < splits; ++s) {
        const int64_t at = s * rows_total + row;
        const float weight = expf(__ldcg(p.lse_partial + at) - lse);
        const float4 part =
            __ldcg(reinterpret_cast<const float4*>(p.o_partial + at * kHeadDim + col));
        o.x += weight * part.x;
        o.y += weight * part.y;
        o.z += weight * part.z;
        o.w += weight * part.w;
      }
    }
    const int64_t token = row / p.num_heads;
    const int head = static_cast<int>(row % p.num_heads);
    Element* out =
        static_cast<Element*>(p.o) + token * p.o_token_stride + head * p.o_head_stride + col;
    *reinterpret_cast<uint2*>(out) =
        make_uint2(ptx::PackPair<Element>(o.x, o.y), ptx::PackPair<Element>(o.z, o.w));
    if (col == 0 && p.lse != nullptr) p.lse[head * p.total_q + token] = lse;
  }
}

}  // namespace attn::cuda
