#include "cuda/fused/fused_forward_launch.cuh"

namespace attn::cuda {
template cudaError_t RunFusedForward<DType::kF16, 128>(const FusedForwardParams&, cudaStream_t);
}  // namespace attn::cuda
