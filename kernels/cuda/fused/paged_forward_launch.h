// Per-row entry points of the paged forward: one generated .cu per paged row of the table
// (capabilities.h) defines RunPagedForward<dtype, head_dim>; paged_forward.cc calls it.
#pragma once

#include <cuda_runtime_api.h>

#include "attn/dtype.h"
#include "cuda/fused/paged_forward.h"

namespace attn::cuda {

template <DType kDType, int kHeadDim>
cudaError_t RunPagedForward(const PagedForwardParams& params, cudaStream_t stream);

}  // namespace attn::cuda
