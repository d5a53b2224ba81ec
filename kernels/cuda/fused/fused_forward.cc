// Supports() and the dtype x head_dim dispatch of the fused forward kernel.
#include "cuda/fused/fused_forward.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "cuda/fused/fused_forward_launch.h"

namespace attn::cuda {
namespace {

bool HasFusedHeadDim(int head_dim) {
  for (int d : kFusedHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

// Tiles move in 16-byte chunks: pointers and row strides must keep every row 16-byte aligned.
absl::Status CheckAligned(const char* name, const void* data, int64_t token_stride,
                          int64_t head_stride) {
  constexpr int64_t kElemsPer16Bytes = 8;  // 16-bit elements
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0) {
    return absl::UnimplementedError(absl::StrCat("cuda_fused: ", name, " is not 16-byte aligned"));
  }
  if (token_stride % kElemsPer16Bytes != 0 || head_stride % kElemsPer16Bytes != 0) {
    return absl::UnimplementedError(absl::StrCat("cuda_fused: ", name,
                                                 " strides must be multiples of 8 elements (got ",
                                                 token_stride, ", ", head_stride, ")"));
  }
  return absl::OkStatus();
}

// Turns the runtime (dtype, head_dim) pair into the matching compiled instantiation.
template <DType kDType>
cudaError_t DispatchHeadDim(const FusedForwardParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32:
      return RunFusedForward<kDType, 32>(p, stream);
    case 64:
      return RunFusedForward<kDType, 64>(p, stream);
    case 96:
      return RunFusedForward<kDType, 96>(p, stream);
    case 128:
      return RunFusedForward<kDType, 128>(p, stream);
    case 256:
      return RunFusedForward<kDType, 256>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

absl::Status FusedForwardSupports(const AttentionProblem& p) {
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) {
    return absl::UnimplementedError(absl::StrCat("cuda_fused: dtype ",
                                                 std::string(DTypeName(p.dtype)),
                                                 " is not covered (float16 and bfloat16 are)"));
  }
  if (!HasFusedHeadDim(p.head_dim)) {
    return absl::UnimplementedError(absl::StrCat("cuda_fused: head_dim ", p.head_dim,
                                                 " is not covered (32, 64, 96, 128, 256 are)"));
  }
  return absl::OkStatus();
}

absl::Status LaunchFusedForward(const FusedForwardParams& p, void* stream) {
  if ((p.dtype != DType::kF16 && p.dtype != DType::kBF16) || !HasFusedHeadDim(p.head_dim)) {
    return absl::UnimplementedError(absl::StrCat("cuda_fused: no kernel for dtype ",
                                                 std::string(DTypeName(p.dtype)), " head_dim ",
                                                 p.head_dim));
  }
  if (auto s = CheckAligned("q", p.q, p.q_token_stride, p.q_head_stride); !s.ok()) return s;
  if (auto s = CheckAligned("k", p.k, p.k_token_stride, p.k_head_stride); !s.ok()) return s;
  if (auto s = CheckAligned("v", p.v, p.v_token_stride, p.v_head_stride); !s.ok()) return s;
  if (auto s = CheckAligned("o", p.o, p.o_token_stride, p.o_head_stride); !s.ok()) return s;
  if (p.max_seqlen_q > (int64_t{1} << 30) || p.seqlen_k > (int64_t{1} << 30)) {
    return absl::UnimplementedError("cuda_fused: sequences longer than 2^30 tokens");
  }
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError("cuda_fused: num_heads must be a multiple of num_kv_heads");
  }
  if (p.batch > 65535 || p.num_heads > 65535) {
    return absl::UnimplementedError("cuda_fused: batch and num_heads must be <= 65535");
  }
  if (p.batch == 0 || p.max_seqlen_q == 0) return absl::OkStatus();
  auto* s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = p.dtype == DType::kF16 ? DispatchHeadDim<DType::kF16>(p, s)
                                                 : DispatchHeadDim<DType::kBF16>(p, s);
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cuda_fused: kernel launch failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace attn::cuda
