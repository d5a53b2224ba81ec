// Grid and launch of one fused-forward instantiation, and the choice among the Hopper kernels
// (warp-specialised TMA, lockstep wgmma) and the portable (mma.sync) one. Included by the
// generated instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/element_convert.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/fused_forward_kernel.cuh"
#include "cuda/fused/fused_forward_launch.h"
#include "cuda/fused/fused_forward_sm90_kernel.cuh"
#include "cuda/fused/fused_forward_sm90_tma_kernel.cuh"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/sm90a_usable.cuh"
#include "cuda/fused/tensor_map.h"

namespace attn::cuda {

// One CTA per (query block, head, sequence); see QueryBlock for the order blocks run in.
template <typename Traits>
cudaError_t LaunchQueryBlocks(void (*kernel)(FusedForwardParams), const FusedForwardParams& params,
                              cudaStream_t stream) {
  const dim3 grid((params.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.num_heads,
                  params.batch);
  return LaunchWithSharedMemory(kernel, grid, Traits::kThreads, Traits::kSmemBytes, stream, params);
}

// The warp-specialised kernel with Traits' shape: the tensor maps of Q, K and V (and O, for the
// copy-engine epilogue), then its
// persistent grid (query_schedule.cuh). cudaErrorNotSupported when it cannot run here (no
// sm_90a code for this device, no tensor-map encoder, tensors the copy engine cannot address,
// no queue counters given, 2^31 query blocks or more).
template <typename Traits>
cudaError_t LaunchFusedForwardSm90Tma(const FusedForwardParams& p, cudaStream_t stream) {
  constexpr auto kKernel = &FusedForwardSm90TmaKernel<Traits>;
  if (!Sm90aKernelUsable<kKernel>()) return cudaErrorNotSupported;
  const bool varlen = p.cu_seqlens_q != nullptr;
  // Tile coordinates are 32-bit: a variable-length batch addresses tokens by them. Its key
  // bounds come from total_k, which callers that predate this kernel leave 0.
  if (varlen &&
      (p.total_q >= (int64_t{1} << 31) || p.total_k >= (int64_t{1} << 31) || p.total_k <= 0)) {
    return cudaErrorNotSupported;
  }
  // Its CTAs draw query blocks from a queue (query_schedule.cuh) in 32-bit places.
  if (p.tile_counters == nullptr || QueryBlocksOf<Traits::kBlockM>(p) >= (int64_t{1} << 31)) {
    return cudaErrorNotSupported;
  }
  FusedForwardTmaParams params;
  params.p = p;
  cudaError_t err = EncodeQkvTensorMaps(p, Traits::kHeadDim, Traits::kBlockM, Traits::kBlockN,
                                        &params.q_map, &params.k_map, &params.v_map);
  // The shapes with the copy-engine epilogue need O's map too (O's rows and their start in
  // whole 16 bytes, as Q's): without one, cudaErrorNotSupported, and kAuto goes on to the next
  // kernel.
  if (err == cudaSuccess && Traits::kCopyEngineEpilogue) {
    err = EncodeOTensorMap(p, Traits::kHeadDim, Traits::kOutputBoxRows, &params.o_map);
  }
  unsigned ctas = 0;
  if (err == cudaSuccess) {
    err = PersistentCtas(QueryBlocksOf<Traits::kBlockM>(p), p.persistent_ctas, &ctas);
  }
  if (err != cudaSuccess) return err;
  return LaunchWithSharedMemory(kKernel, dim3(ctas), Traits::kThreads, Traits::kSmemBytes, stream,
                                params);
}

// The warp-specialised kernel at the shape heuristics.h gives the problem (its mask and mean
// keys a sequence), or at the shape params.block_n and consumer_warpgroups pin where set (one
// compiled for the row: the full and the masked one, which are one at 256; at 64 they differ in
// their consumers only).
template <typename Element, int kHeadDim>
cudaError_t RunFusedForwardSm90Tma(const FusedForwardParams& params, bool masked, int64_t mean_keys,
                                   cudaStream_t stream) {
  constexpr Sm90TmaTileShape kFull = Sm90TmaFusedTileShape(kHeadDim, /*masked=*/false);
  constexpr Sm90TmaTileShape kMasked = Sm90TmaFusedTileShape(kHeadDim, /*masked=*/true);
  using FullTraits = FusedForwardSm90TmaTraits<Element, kHeadDim, kFull.block_n, kFull.stages,
                                               kFull.consumer_warpgroups>;
  using MaskedTraits = FusedForwardSm90TmaTraits<Element, kHeadDim, kMasked.block_n, kMasked.stages,
                                                 kMasked.consumer_warpgroups>;
  const auto pinned = [&](const Sm90TmaTileShape& shape) {
    return (params.block_n == 0 || params.block_n == shape.block_n) &&
           (params.consumer_warpgroups == 0 ||
            params.consumer_warpgroups == shape.consumer_warpgroups);
  };
  // The heuristic's shape where the pins allow it, else the other one if they allow that.
  bool masked_shape = Sm90TmaTakesMaskedShape(kHeadDim, mean_keys, masked);
  if (!pinned(masked_shape ? kMasked : kFull)) masked_shape = !masked_shape;
  if (!pinned(masked_shape ? kMasked : kFull)) return cudaErrorNotSupported;
  return masked_shape ? LaunchFusedForwardSm90Tma<MaskedTraits>(params, stream)
                      : LaunchFusedForwardSm90Tma<FullTraits>(params, stream);
}

// kAuto tries, in order, the kernels the row has (heuristics.h): the warp-specialised one, the
// lockstep one, the portable one. The rows at 96 and 256 have no lockstep kernel, so there kAuto
// falls from the first straight to the last and a pinned kSm90Lockstep answers
// cudaErrorNotSupported.
template <DType kDType, int kHeadDim>
cudaError_t RunFusedForward(const FusedForwardParams& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  const FusedKernel pinned = params.kernel;
  if constexpr (HasFusedKernel(Pass::kForward, kDType, kHeadDim, kSm90aTma)) {
    const bool masked = params.window_left >= 0 || params.window_right >= 0;
    const int64_t mean_keys = params.cu_seqlens_k == nullptr
                                  ? params.seqlen_k
                                  : params.total_k / std::max(params.batch, 1);
    if (pinned == FusedKernel::kSm90Tma || pinned == FusedKernel::kAuto) {
      const cudaError_t err =
          RunFusedForwardSm90Tma<Element, kHeadDim>(params, masked, mean_keys, stream);
      // kAuto falls back to the next kernel where this one cannot run.
      if (err != cudaErrorNotSupported || pinned == FusedKernel::kSm90Tma) return err;
    }
  }
  if constexpr (HasFusedKernel(Pass::kForward, kDType, kHeadDim, kSm90a)) {
    constexpr Sm90TileShape kShape = Sm90FusedTileShape(kHeadDim);
    using Sm90Traits =
        FusedForwardSm90Traits<Element, kHeadDim, kShape.block_n, kShape.ctas_per_sm>;
    constexpr auto kKernel = &FusedForwardSm90Kernel<Sm90Traits>;
    if ((pinned == FusedKernel::kAuto || pinned == FusedKernel::kSm90Lockstep) &&
        Sm90aKernelUsable<kKernel>()) {
      return LaunchQueryBlocks<Sm90Traits>(kKernel, params, stream);
    }
  }
  if (pinned == FusedKernel::kSm90Lockstep || pinned == FusedKernel::kSm90Tma) {
    return cudaErrorNotSupported;
  }
  using Traits = FusedForwardTraits<Element, kHeadDim>;
  return LaunchQueryBlocks<Traits>(&FusedForwardKernel<Traits>, params, stream);
}

}  // namespace attn::cuda
