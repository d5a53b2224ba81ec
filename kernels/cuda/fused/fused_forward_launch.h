// Per-instantiation entry points of the fused forward kernel (one .cu each, under
// instantiations/), called by the dispatch in fused_forward.cc.
#pragma once

#include <cuda_runtime_api.h>

#include "attn/dtype.h"
#include "cuda/fused/fused_forward.h"

namespace attn::cuda {

// Head dimensions with a compiled kernel; others go to the naive path.
inline constexpr int kFusedHeadDims[] = {32, 64, 96, 128, 256};

template <DType kDType, int kHeadDim>
cudaError_t RunFusedForward(const FusedForwardParams& params, cudaStream_t stream);

}  // namespace attn::cuda
