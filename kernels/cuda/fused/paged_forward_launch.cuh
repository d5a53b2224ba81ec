// Grids and launches of one paged-forward instantiation: the decode kernel (which merges its
// own splits), or the prefill kernel, on Hopper the wgmma one where the table has it. Included
// by the generated instantiation files.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/element_convert.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/kernel_traits.h"
#include "cuda/fused/paged_decode_kernel.cuh"
#include "cuda/fused/paged_forward_launch.h"
#include "cuda/fused/paged_prefill_kernel.cuh"
#include "cuda/fused/paged_prefill_sm90_kernel.cuh"
#include "cuda/fused/paged_traits.h"
#include "cuda/fused/sm90a_usable.cuh"

namespace attn::cuda {

constexpr int Log2(int power_of_two) {
  int shift = 0;
  while ((1 << shift) < power_of_two) ++shift;
  return shift;
}

// One CTA per (query block, head, sequence), as the dense forward (QueryBlock).
template <typename Traits, typename Kernel>
cudaError_t LaunchPagedPrefill(Kernel one_page, Kernel many_pages, const PagedForwardParams& p,
                               cudaStream_t stream) {
  const dim3 grid((p.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.num_heads, p.batch);
  return LaunchWithSharedMemory(p.page_shift >= Log2(Traits::kBlockN) ? one_page : many_pages, grid,
                                Traits::kThreads, Traits::kSmemBytes, stream, p);
}

template <DType kDType, int kHeadDim>
cudaError_t RunPagedForward(const PagedForwardParams& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  if (params.plan.kernel == PagedKernel::kPrefill) {
    if constexpr (HasFusedKernel(Pass::kPagedForward, kDType, kHeadDim, kSm90a)) {
      constexpr Sm90TileShape kShape = Sm90FusedTileShape(kHeadDim);
      using Sm90Traits =
          FusedForwardSm90Traits<Element, kHeadDim, kShape.block_n, kShape.ctas_per_sm>;
      if (params.kernel == FusedKernel::kAuto &&
          Sm90aKernelUsable<&PagedPrefillSm90Kernel<Sm90Traits, true>>()) {
        return LaunchPagedPrefill<Sm90Traits>(&PagedPrefillSm90Kernel<Sm90Traits, true>,
                                              &PagedPrefillSm90Kernel<Sm90Traits, false>, params,
                                              stream);
      }
    }
    using Traits = FusedForwardTraits<Element, kHeadDim>;
    return LaunchPagedPrefill<Traits>(&PagedPrefillKernel<Traits, true>,
                                      &PagedPrefillKernel<Traits, false>, params, stream);
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
