// The paged forward's plan (which kernel, how many splits, what workspace), its launch checks,
// then the table's dispatch to the compiled instantiation.
#include "cuda/fused/paged_forward.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "cuda/common/alignment.h"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/paged_forward_launch.h"
#include "cuda/fused/paged_traits.h"

namespace attn::cuda {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

absl::Status CheckAligned(const char* name, const void* data, int64_t token_stride,
                          int64_t head_stride) {
  constexpr int64_t kElementBytes = 2;
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

PagedForwardPlan PlanPagedForward(const AttentionProblem& p, const PagedDevice& device,
                                  const PagedOverrides& overrides) {
  PagedForwardPlan plan;
  const int64_t rows = p.max_seqlen_q() * p.group_size();
  plan.kernel = overrides.kernel != PagedKernel::kAuto ? overrides.kernel
                : rows <= kPagedDecodeMaxRows          ? PagedKernel::kDecode
                                                       : PagedKernel::kPrefill;
  if (plan.kernel == PagedKernel::kPrefill) return plan;

  plan.m_blocks = static_cast<int>(std::max<int64_t>(1, CeilDiv(rows, kPagedDecodeRows)));
  const PagedDecodeShape shape = PagedDecodeTileShape(p.head_dim);
  const int64_t tiles = CeilDiv(p.max_seqlen_k(), shape.block_n);
  // Resident decode CTAs per SM: its launch bounds allow two, shared memory may allow fewer
  // (1 KiB of every CTA's shared memory is the system's, up to 1 KiB more its static part).
  const int smem =
      PagedDecodeSharedLayout(p.head_dim, static_cast<int>(DTypeSize(p.dtype))).smem_bytes;
  const int per_sm = std::clamp(device.shared_memory_per_sm / (smem + 2048), 1, 2);
  const int64_t ctas = int64_t{p.batch()} * p.num_kv_heads * plan.m_blocks;
  const int64_t slots = int64_t{device.multiprocessors} * per_sm;
  int splits =
      overrides.decode_splits > 0 ? overrides.decode_splits : PagedDecodeSplits(ctas, tiles, slots);
  splits = std::clamp(splits, 1, 65535);
  plan.tiles_per_split = static_cast<int>(std::max<int64_t>(1, CeilDiv(tiles, splits)));
  plan.num_splits = splits;
  if (splits > 1) {
    const int64_t partial_rows = int64_t{splits} * p.total_q() * p.num_heads;
    plan.workspace_bytes = partial_rows * (p.head_dim + 1) * static_cast<int64_t>(sizeof(float));
    plan.split_counters = ctas;
  }
  return plan;
}

absl::Status LaunchPagedForward(const PagedForwardParams& p, void* stream) {
  if (!HasFusedKernel(Pass::kPagedForward, p.dtype, p.head_dim)) {
    return absl::UnimplementedError(absl::StrCat("cuda_fused: no paged kernel for dtype ",
                                                 std::string(DTypeName(p.dtype)), " head_dim ",
                                                 p.head_dim));
  }
  if (auto s = CheckAligned("q", p.q, p.q_token_stride, p.q_head_stride); !s.ok()) return s;
  if (auto s = CheckAligned("o", p.o, p.o_token_stride, p.o_head_stride); !s.ok()) return s;
  // Rows in a page start 16-byte aligned when the pool, the page stride and the V block's
  // offset do (the token and head strides are multiples of head_dim, itself of 16).
  if (auto s = CheckAligned("kv.pages", p.k, p.page_stride, p.v_offset); !s.ok()) return s;
  if (p.max_seqlen_q > (int64_t{1} << 30) || p.seqlen_k > (int64_t{1} << 30)) {
    return absl::UnimplementedError("cuda_fused: sequences longer than 2^30 tokens");
  }
  if (p.batch > 65535 || p.num_heads > 65535) {
    return absl::UnimplementedError("cuda_fused: batch and num_heads must be <= 65535");
  }
  if (p.plan.kernel == PagedKernel::kAuto) {
    return absl::InvalidArgumentError("cuda_fused: the paged plan names no kernel");
  }
  if (p.plan.num_splits > 1 &&
      (p.o_partial == nullptr || p.lse_partial == nullptr || p.split_counters == nullptr)) {
    return absl::InvalidArgumentError("cuda_fused: a split plan needs its workspace");
  }
  if (p.batch == 0 || p.max_seqlen_q == 0) return absl::OkStatus();
  auto* s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = DispatchFusedKernel<Pass::kPagedForward>(
      p.dtype, p.head_dim, cudaErrorInvalidValue,
      [&]<DType kDType, int kHeadDim>() { return RunPagedForward<kDType, kHeadDim>(p, s); });
  if (err == cudaErrorNotSupported) {
    return absl::UnimplementedError(
        "cuda_fused: the pinned paged prefill kernel (FusedForwardParams::kernel) cannot run on "
        "this device, build or layout");
  }
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cuda_fused: paged kernel launch failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace attn::cuda
