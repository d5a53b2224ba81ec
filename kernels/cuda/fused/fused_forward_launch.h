// Per-row entry points of the fused forward kernel: one generated .cu per forward row of the
// table (capabilities.h) defines RunFusedForward<dtype, head_dim>; fused_forward.cc calls it.
#pragma once

#include <cuda_runtime_api.h>

#include "attn/dtype.h"
#include "cuda/fused/fused_forward.h"

namespace attn::cuda {

template <DType kDType, int kHeadDim>
cudaError_t RunFusedForward(const FusedForwardParams& params, cudaStream_t stream);

}  // namespace attn::cuda
