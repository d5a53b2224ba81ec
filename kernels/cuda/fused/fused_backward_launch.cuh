// Grid and launch of one instantiation of the fused backward's main kernel, and the choice
// between the Hopper kernel (fused_backward_sm90_kernel.cuh) and the portable one
// (fused_backward_kernel.cuh). Included by the generated instantiation files.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/element_convert.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/fused_backward_kernel.cuh"
#include "cuda/fused/fused_backward_launch.h"
#include "cuda/fused/fused_backward_sm90_kernel.cuh"
#include "cuda/fused/fused_backward_sm90_wide_kernel.cuh"
#include "cuda/fused/sm90a_usable.cuh"
#include "cuda/fused/tensor_map.h"

namespace attn::cuda {

// The Hopper kernels: up to head_dim 128 a CTA of 128 keys, 64 a consumer warpgroup
// (fused_backward_sm90_kernel.cuh); at 256 one of 64 keys that both warpgroups share
// (fused_backward_sm90_wide_kernel.cuh).
template <typename T, int kHeadDim>
struct Sm90Backward {
  using Traits = FusedBackwardSm90Traits<T, kHeadDim>;
  static constexpr auto kKernel = &FusedBackwardSm90Kernel<Traits>;
};
template <typename T>
struct Sm90Backward<T, 256> {
  using Traits = FusedBackwardSm90WideTraits<T, 256>;
  static constexpr auto kKernel = &FusedBackwardSm90WideKernel<Traits>;
};

// A Hopper kernel: tensor maps of Q, dO (kBlockM-row boxes), K, V (kBlockN-row boxes), each
// head_dim wide (so that a tile's columns past it arrive as zeros), and the dQ accumulator
// (64-row boxes), then one CTA per (key block, KV head, sequence). cudaErrorNotSupported when
// it cannot run here (no sm_90a code for this device, no tensor-map encoder, tensors the copy
// engine cannot address).
template <typename Traits, auto kKernel>
cudaError_t LaunchFusedBackwardSm90(const FusedBackwardParams& p,
                                    const FusedBackwardWorkspace& work, bool aligned_outputs,
                                    cudaStream_t stream) {
  if (!Sm90aKernelUsable<kKernel>()) return cudaErrorNotSupported;
  const bool varlen = p.cu_seqlens_q != nullptr;
  // Tile coordinates are 32-bit, and a variable-length batch addresses tokens by them.
  if (p.total_q >= (int64_t{1} << 31) || p.total_k >= (int64_t{1} << 31) ||
      (varlen && p.total_k <= 0)) {
    return cudaErrorNotSupported;
  }
  FusedBackwardTmaParams params;
  params.p = p;
  params.delta = work.delta;
  params.dq_accum = work.dq_accum;
  params.dq_tile_counters = work.dq_tile_counters;
  params.query_tiles = work.query_tiles;
  params.aligned_outputs = aligned_outputs;
  cudaError_t err = EncodeQkvTensorMaps(p, Traits::kHeadDim, Traits::kBlockM, Traits::kBlockN,
                                        &params.q_map, &params.k_map, &params.v_map);
  if (err == cudaSuccess) {
    err = EncodeTokenTensorMap(BatchTensorView(p, p.d_o, Traits::kHeadDim, p.seqlen_q, p.total_q,
                                               p.num_heads, p.do_token_stride, p.do_head_stride),
                               Traits::kBlockM, &params.do_map);
  }
  if (err == cudaSuccess) {
    TokenTensorView dq =
        BatchTensorView(p, work.dq_accum, Traits::kHeadDim, p.seqlen_q, p.total_q, p.num_heads,
                        int64_t{p.num_heads} * Traits::kHeadDim, Traits::kHeadDim);
    dq.dtype = DType::kF32;
    err = EncodeTokenTensorMap(dq, 64, &params.dq_map);
  }
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((p.max_seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN),
                  static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(p.batch));
  return LaunchWithSharedMemory(kKernel, grid, Traits::kThreads, Traits::kSmemBytes, stream,
                                params);
}

template <DType kDType, int kHeadDim>
cudaError_t RunFusedBackwardKernel(const FusedBackwardParams& params,
                                   const FusedBackwardWorkspace& work, bool aligned_inputs,
                                   bool aligned_outputs, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  const FusedKernel pinned = params.kernel;
  if constexpr (HasFusedKernel(Pass::kBackward, kDType, kHeadDim, kSm90aTma)) {
    // kAuto takes it wherever it runs: on the H200 1.3-1.9x the portable kernel at head_dim 64,
    // 1.4-1.9x at 96 (the tiles of 128, a fifth more MMA work than 96 needs), 1.6-2.3x at 128
    // and 1.9-2.3x at 256 (docs/performance.md).
    if (pinned != FusedKernel::kPortable && aligned_inputs) {
      using Hopper = Sm90Backward<T, kHeadDim>;
      const cudaError_t err = LaunchFusedBackwardSm90<typename Hopper::Traits, Hopper::kKernel>(
          params, work, aligned_outputs, stream);
      // kAuto falls back to the portable kernel where this one cannot run.
      if (err != cudaErrorNotSupported || pinned != FusedKernel::kAuto) return err;
    }
  }
  if (pinned == FusedKernel::kSm90Lockstep || pinned == FusedKernel::kSm90Tma) {
    return cudaErrorNotSupported;
  }
  using backward::kBlockK;
  const dim3 grid(static_cast<unsigned>((params.max_seqlen_k + kBlockK - 1) / kBlockK),
                  static_cast<unsigned>(params.num_kv_heads), static_cast<unsigned>(params.batch));
  const auto kernel = params.deterministic ? &backward::BackwardKernel<T, kHeadDim, true>
                                           : &backward::BackwardKernel<T, kHeadDim, false>;
  return LaunchWithSharedMemory(kernel, grid, backward::kThreads,
                                sizeof(backward::SharedTiles<T, kHeadDim>), stream, params,
                                work.delta, work.dq_accum, work.dq_tile_counters, work.query_tiles,
                                aligned_inputs, aligned_outputs);
}

}  // namespace attn::cuda
