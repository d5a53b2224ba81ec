// The fused forward's launch checks, then the table's dispatch to the compiled instantiation.
#include "cuda/fused/fused_forward.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "cuda/common/alignment.h"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/fused_forward_launch.h"

namespace attn::cuda {
namespace {

// Tiles move in 16-byte chunks: pointers and row strides must keep every row 16-byte aligned.
absl::Status CheckAligned(const char* name, const void* data, int64_t token_stride,
                          int64_t head_stride) {
  constexpr int64_t kElementBytes = 2;  // 16-bit elements
  if (!IsAligned16(data)) {
    return absl::UnimplementedError(absl::StrCat("cuda_fused: ", name, " is not 16-byte aligned"));
  }
  if (!StrideAligned16(token_stride, kElementBytes) ||
      !StrideAligned16(head_stride, kElementBytes)) {
    return absl::UnimplementedError(absl::StrCat("cuda_fused: ", name,
                                                 " strides must be multiples of 8 elements (got ",
                                                 token_stride, ", ", head_stride, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchFusedForward(const FusedForwardParams& p, void* stream) {
  if (!HasFusedKernel(Pass::kForward, p.dtype, p.head_dim)) {
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
  const cudaError_t err = DispatchFusedKernel<Pass::kForward>(
      p.dtype, p.head_dim, cudaErrorInvalidValue,
      [&]<DType kDType, int kHeadDim>() { return RunFusedForward<kDType, kHeadDim>(p, s); });
  if (err == cudaErrorNotSupported) {
    return absl::UnimplementedError(
        "cuda_fused: the pinned kernel (FusedForwardParams::kernel, block_n) cannot run on this "
        "device, build or problem");
  }
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cuda_fused: kernel launch failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace attn::cuda
