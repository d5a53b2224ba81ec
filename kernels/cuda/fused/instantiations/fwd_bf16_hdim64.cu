#include "cuda/fused/fused_forward_launch.cuh"

namespace attn::cuda {
template cudaError_t RunFusedForward<DType::kBF16, 64>(const FusedForwardParams&, cudaStream_t);
}  // namespace attn::cuda
