// The CUDA engines behind attn::Engine: the fused engine (defined here, around the fused
// kernel's launch API) and the factories of both CUDA engines.
#include "cuda/cuda_engines.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_buffer.h"
#include "cuda/common/workspace_pool.h"
#include "cuda/fused/fused_backward.h"
#include "cuda/fused/fused_forward.h"
#include "cuda/naive/naive_engine.h"

namespace attn {
namespace {

using cuda::AsStream;
using cuda::FusedForwardParams;

// Copies a variable-length problem's prefix sums to device memory at `at` (room for
// 2 * cu_seqlens_q.size() int32s): the query sums, then the key sums. The copies are from
// pageable memory, so they have read p's vectors when they return.
absl::Status UploadSeqlens(const AttentionProblem& p, int32_t* at, cudaStream_t stream) {
  const size_t entries = p.cu_seqlens_q.size();
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(at, p.cu_seqlens_q.data(), entries * sizeof(int32_t),
                                            cudaMemcpyHostToDevice, stream));
  return cuda::CudaStatus(
      cudaMemcpyAsync(at + entries, p.cu_seqlens_k.data(), entries * sizeof(int32_t),
                      cudaMemcpyHostToDevice, stream),
      "cudaMemcpyAsync(cu_seqlens_k)");
}

class CudaFusedEngine final : public Engine {
 public:
  CudaFusedEngine(const EngineOptions& options, cuda::FusedKernel kernel)
      : options_(options), kernel_(kernel) {}

  EngineKind kind() const override { return EngineKind::kCudaFused; }
  MemorySpace memory_space() const override { return MemorySpace::kDevice; }

  absl::Status SupportsForward(const AttentionProblem& p) const override {
    ATTN_RETURN_IF_ERROR(ValidateProblem(p));
    return cuda::FusedForwardSupports(p);
  }
  absl::Status SupportsBackward(const AttentionProblem& p) const override {
    ATTN_RETURN_IF_ERROR(ValidateProblem(p));
    return cuda::FusedBackwardSupports(p);
  }

  absl::Status Backward(const AttentionProblem& p, const BackwardArgs& args) override {
    ATTN_RETURN_IF_ERROR(ValidateBackward(p, args));
    ATTN_RETURN_IF_ERROR(cuda::FusedBackwardSupports(p));
    if (p.total_q() == 0 && p.total_k() == 0) return absl::OkStatus();
    cuda::ScopedDevice device(options_.device);
    ATTN_RETURN_IF_ERROR(device.status());
    const cudaStream_t stream = AsStream(args.stream);

    cuda::FusedBackwardParams params;
    params.q = args.q.data;
    params.k = args.k.data;
    params.v = args.v.data;
    params.o = args.o.data;
    params.d_o = args.d_o.data;
    params.lse = args.lse;
    params.dq = args.dq.data;
    params.dk = args.dk.data;
    params.dv = args.dv.data;
    params.q_token_stride = args.q.token_stride;
    params.q_head_stride = args.q.head_stride;
    params.k_token_stride = args.k.token_stride;
    params.k_head_stride = args.k.head_stride;
    params.v_token_stride = args.v.token_stride;
    params.v_head_stride = args.v.head_stride;
    params.o_token_stride = args.o.token_stride;
    params.o_head_stride = args.o.head_stride;
    params.do_token_stride = args.d_o.token_stride;
    params.do_head_stride = args.d_o.head_stride;
    params.dq_token_stride = args.dq.token_stride;
    params.dq_head_stride = args.dq.head_stride;
    params.dk_token_stride = args.dk.token_stride;
    params.dk_head_stride = args.dk.head_stride;
    params.dv_token_stride = args.dv.token_stride;
    params.dv_head_stride = args.dv.head_stride;
    params.total_q = p.total_q();
    params.batch = p.batch();
    params.num_heads = p.num_heads;
    params.num_kv_heads = p.num_kv_heads;
    params.head_dim = p.head_dim;
    params.scale = p.scale();
    params.window_left = p.effective_window_left();
    params.window_right = p.effective_window_right();
    params.dtype = p.dtype;
    params.max_seqlen_k = p.max_seqlen_k();

    // One lease: D and the dQ accumulator, then (variable lengths) the prefix sums.
    const int64_t work = cuda::FusedBackwardWorkspaceBytes(p);
    const size_t entries = p.is_uniform() ? 0 : p.cu_seqlens_q.size();
    const size_t bytes = static_cast<size_t>(work) + 2 * entries * sizeof(int32_t);
    ATTN_ASSIGN_OR_RETURN(cuda::WorkspaceLease lease, pool_.Acquire(bytes, stream));
    params.workspace = lease.data();
    if (p.is_uniform()) {
      params.seqlen_q = p.seqlen_q(0);
      params.seqlen_k = p.seqlen_k(0);
    } else {
      auto* cu_q = reinterpret_cast<int32_t*>(static_cast<char*>(lease.data()) + work);
      ATTN_RETURN_IF_ERROR(UploadSeqlens(p, cu_q, stream));
      params.cu_seqlens_q = cu_q;
      params.cu_seqlens_k = cu_q + entries;
    }
    return cuda::LaunchFusedBackward(params, stream);
  }

  absl::Status Forward(const AttentionProblem& p, const ForwardArgs& args) override {
    ATTN_RETURN_IF_ERROR(ValidateForward(p, args));
    ATTN_RETURN_IF_ERROR(cuda::FusedForwardSupports(p));
    if (p.total_q() == 0) return absl::OkStatus();
    cuda::ScopedDevice device(options_.device);
    ATTN_RETURN_IF_ERROR(device.status());
    const cudaStream_t stream = AsStream(args.stream);

    FusedForwardParams params;
    params.q = args.q.data;
    params.k = args.k.data;
    params.v = args.v.data;
    params.o = args.o.data;
    params.lse = args.lse;
    params.q_token_stride = args.q.token_stride;
    params.q_head_stride = args.q.head_stride;
    params.k_token_stride = args.k.token_stride;
    params.k_head_stride = args.k.head_stride;
    params.v_token_stride = args.v.token_stride;
    params.v_head_stride = args.v.head_stride;
    params.o_token_stride = args.o.token_stride;
    params.o_head_stride = args.o.head_stride;
    params.total_q = p.total_q();
    params.max_seqlen_q = p.max_seqlen_q();
    params.batch = p.batch();
    params.num_heads = p.num_heads;
    params.num_kv_heads = p.num_kv_heads;
    params.head_dim = p.head_dim;
    params.scale = p.scale();
    params.window_left = p.effective_window_left();
    params.window_right = p.effective_window_right();
    params.dtype = p.dtype;
    params.kernel = kernel_;

    if (p.is_uniform()) {
      params.seqlen_q = p.seqlen_q(0);
      params.seqlen_k = p.seqlen_k(0);
      return cuda::LaunchFusedForward(params, stream);
    }
    // Variable lengths: the prefix sums travel to the device through the workspace.
    const size_t entries = p.cu_seqlens_q.size();
    ATTN_ASSIGN_OR_RETURN(cuda::WorkspaceLease lease,
                          pool_.Acquire(2 * entries * sizeof(int32_t), stream));
    auto* cu_q = static_cast<int32_t*>(lease.data());
    ATTN_RETURN_IF_ERROR(UploadSeqlens(p, cu_q, stream));
    params.cu_seqlens_q = cu_q;
    params.cu_seqlens_k = cu_q + entries;
    return cuda::LaunchFusedForward(params, stream);
  }

 private:
  EngineOptions options_;
  cuda::FusedKernel kernel_;
  cuda::WorkspacePool pool_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> MakeCudaFusedEngine(const EngineOptions& options,
                                                            cuda::FusedKernel kernel) {
  ATTN_ASSIGN_OR_RETURN(const int devices, cuda::CountDevices());
  if (options.device < 0 || options.device >= devices) {
    return absl::UnavailableError(absl::StrCat("cuda_fused: device ", options.device,
                                               " does not exist (", devices, " devices)"));
  }
  return std::unique_ptr<Engine>(std::make_unique<CudaFusedEngine>(options, kernel));
}

absl::StatusOr<std::unique_ptr<Engine>> MakeCudaNaiveEngine(const EngineOptions& options) {
  return cuda::MakeNaiveEngine(options);
}

}  // namespace attn
