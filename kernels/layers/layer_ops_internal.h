// Between the LayerOps implementations and their factory: the constructors, and the checks they
// share.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layers/layer_ops.h"

namespace attn::layers {

// The shape and dtype rules of LayerOps::Gemm.
absl::Status ValidateGemm(bool transpose_a, bool transpose_b, ConstMatrix a, ConstMatrix b,
                          float beta, Matrix c);

std::unique_ptr<LayerOps> CreateCpuLayerOps(const LayerOpsOptions& options);
#if defined(ATTN_HAVE_CUDA)
absl::StatusOr<std::unique_ptr<LayerOps>> CreateCudaLayerOps(const LayerOpsOptions& options);
#endif

}  // namespace attn::layers
