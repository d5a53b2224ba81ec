// Grids and launches of one paged-forward instantiation: the decode kernel (which merges its
// own splits), or a prefill kernel: on Hopper the warp-specialised one over the paged source or
// the lockstep wgmma one where the table has them, else the portable one. Included by the
// generated instantiation files.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/element_convert.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/fused_forward_sm90_tma_kernel.cuh"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/kernel_traits.h"
#include "cuda/fused/paged_decode_kernel.cuh"
#include "cuda/fused/paged_forward_launch.h"
#include "cuda/fused/paged_prefill_kernel.cuh"
#include "cuda/fused/paged_prefill_sm90_kernel.cuh"
#include "cuda/fused/paged_tma_source.cuh"
#include "cuda/fused/paged_traits.h"
#include "cuda/fused/sm90a_usable.cuh"
#include "cuda/fused/tensor_map.h"

namespace attn::cuda {

// One CTA per (query block, head, sequence), as the dense forward (QueryBlock).
template <typename Traits, typename Kernel>
cudaError_t LaunchPagedPrefill(Kernel one_page, Kernel many_pages, const PagedForwardParams& p,
                               cudaStream_t stream) {
  const dim3 grid((p.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.num_heads, p.batch);
  return LaunchWithSharedMemory(p.page_shift >= Log2(Traits::kBlockN) ? one_page : many_pages, grid,
                                Traits::kThreads, Traits::kSmemBytes, stream, p);
}

// The warp-specialised kernel over the paged source, with Traits' shape: the maps of Q and of
// the pool's K and V blocks, then the kernel's persistent grid (query_schedule.cuh).
// cudaErrorNotSupported where it cannot run: no sm_90a code for this device, pages of fewer than
// kPagedTmaMinPageTokens tokens, a variable-length batch of 2^31 query tokens or more (its
// coordinates are 32-bit), no queue counters given or 2^31 query blocks or more
// (query_schedule.cuh), no tensor-map encoder, tensors the copy engine cannot address.
template <typename Traits>
cudaError_t LaunchPagedPrefillSm90Tma(const PagedForwardParams& p, cudaStream_t stream) {
  constexpr auto kKernel = &FusedForwardSm90TmaKernel<Traits, sm90_tma::PagedKvTiles<Traits>>;
  if (p.page_shift < Log2(kPagedTmaMinPageTokens) ||
      (p.cu_seqlens_q != nullptr && p.total_q >= (int64_t{1} << 31)) ||
      p.tile_counters == nullptr || QueryBlocksOf<Traits::kBlockM>(p) >= (int64_t{1} << 31)) {
    return cudaErrorNotSupported;
  }
  if (!Sm90aKernelUsable<kKernel>()) return cudaErrorNotSupported;
  PagedForwardTmaParams params;
  params.p = p;
  const int box_rows = std::min(1 << std::min(p.page_shift, 30), Traits::kBlockN);
  cudaError_t err = EncodeQTensorMap(p, Traits::kHeadDim, Traits::kBlockM, &params.q_map);
  if (err == cudaSuccess) err = EncodePagedKvTensorMaps(p, box_rows, &params.k_map, &params.v_map);
  unsigned ctas = 0;
  if (err == cudaSuccess) {
    err = PersistentCtas(QueryBlocksOf<Traits::kBlockM>(p), p.persistent_ctas, &ctas);
  }
  if (err != cudaSuccess) return err;
  return LaunchWithSharedMemory(kKernel, dim3(ctas), Traits::kThreads, Traits::kSmemBytes, stream,
                                params);
}

// The prefill kernel FusedForwardParams::kernel pins, or with kAuto the first of the row's that
// can run: the warp-specialised one, the lockstep one, the portable one. A pinned Hopper kernel
// that cannot run answers cudaErrorNotSupported.
template <DType kDType, int kHeadDim>
cudaError_t RunPagedPrefill(const PagedForwardParams& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  const FusedKernel pinned = params.kernel;
  if constexpr (HasFusedKernel(Pass::kPagedForward, kDType, kHeadDim, kSm90aTma)) {
    // kAuto: where PagedPrefillPrefersTma says so, or where the lockstep kernel does not exist.
    const bool auto_tma = !HasFusedKernel(Pass::kPagedForward, kDType, kHeadDim, kSm90a) ||
                          PagedPrefillPrefersTma(kHeadDim, 1 << params.page_shift);
    if ((pinned == FusedKernel::kAuto && auto_tma) || pinned == FusedKernel::kSm90Tma) {
      constexpr Sm90TmaTileShape kShape = Sm90TmaPagedTileShape(kHeadDim);
      using Traits = FusedForwardSm90TmaTraits<Element, kHeadDim, kShape.block_n, kShape.stages>;
      const cudaError_t err = LaunchPagedPrefillSm90Tma<Traits>(params, stream);
      if (err != cudaErrorNotSupported || pinned == FusedKernel::kSm90Tma) return err;
    }
  }
  if constexpr (HasFusedKernel(Pass::kPagedForward, kDType, kHeadDim, kSm90a)) {
    constexpr Sm90TileShape kShape = Sm90FusedTileShape(kHeadDim);
    using Sm90Traits =
        FusedForwardSm90Traits<Element, kHeadDim, kShape.block_n, kShape.ctas_per_sm>;
    if ((pinned == FusedKernel::kAuto || pinned == FusedKernel::kSm90Lockstep) &&
        Sm90aKernelUsable<&PagedPrefillSm90Kernel<Sm90Traits, true>>()) {
      return LaunchPagedPrefill<Sm90Traits>(&PagedPrefillSm90Kernel<Sm90Traits, true>,
                                            &PagedPrefillSm90Kernel<Sm90Traits, false>, params,
                                            stream);
    }
  }
  if (pinned == FusedKernel::kSm90Lockstep || pinned == FusedKernel::kSm90Tma) {
    return cudaErrorNotSupported;
  }
  using Traits = FusedForwardTraits<Element, kHeadDim>;
  return LaunchPagedPrefill<Traits>(&PagedPrefillKernel<Traits, true>,
                                    &PagedPrefillKernel<Traits, false>, params, stream);
}

template <DType kDType, int kHeadDim>
cudaError_t RunPagedForward(const PagedForwardParams& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  if (params.plan.kernel == PagedKernel::kPrefill) {
    return RunPagedPrefill<kDType, kHeadDim>(params, stream);
  }
  using Traits = PagedDecodeTraits<kHeadDim, sizeof(Element)>;
  // The CTAs of one (split, sequence) sit next to each other in the grid, so the KV heads of a
  // token, neighbours in its page, are read at about the same time.
  const dim3 grid(params.plan.m_blocks * params.num_kv_heads, params.plan.num_splits, params.batch);
  const auto kernel = params.page_shift >= Log2(Traits::kBlockN)
                          ? &PagedDecodeKernel<Element, kHeadDim, true>
                          : &PagedDecodeKernel<Element, kHeadDim, false>;
  return LaunchWithSharedMemory(kernel, grid, Traits::kThreads, Traits::kSmemBytes, stream, params);
}

}  // namespace attn::cuda
