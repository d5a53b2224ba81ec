// The CUDA engines behind attn::Engine: the fused engine (defined here, around the fused
// kernels' launch API), the factories of both CUDA engines and their engine-less answers.
#include "cuda/cuda_engines.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_buffer.h"
#include "cuda/common/workspace_pool.h"
#include "cuda/fused/fused_backward.h"
#include "cuda/fused/fused_forward.h"
#include "cuda/fused/fused_support.h"
#include "cuda/fused/paged_forward.h"
#include "cuda/naive/naive_engine.h"

namespace attn {
namespace {

using cuda::AsStream;
using cuda::FusedBackwardParams;
using cuda::FusedForwardParams;
using cuda::PagedForwardParams;

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

// Device int32s of the prefix sums UploadSeqlens writes; none for a uniform batch.
size_t SeqlensEntries(const AttentionProblem& p) {
  return p.is_uniform() ? 0 : 2 * p.cu_seqlens_q.size();
}

// The fields both passes read: Q, K, V, O and the LSE (the forward's outputs, the backward's
// inputs), the sizes, scale and mask; and the sequences, given `cu_seqlens` (device, from
// UploadSeqlens) for a variable-length batch.
template <typename OView>
void SetAttentionParams(const AttentionProblem& p, const TensorRef& q, const TensorRef& k,
                        const TensorRef& v, void* o, const OView& o_view, float* lse,
                        const int32_t* cu_seqlens, FusedForwardParams& params) {
  params.q = q.data;
  params.k = k.data;
  params.v = v.data;
  params.o = o;
  params.lse = lse;
  params.q_token_stride = q.token_stride;
  params.q_head_stride = q.head_stride;
  params.k_token_stride = k.token_stride;
  params.k_head_stride = k.head_stride;
  params.v_token_stride = v.token_stride;
  params.v_head_stride = v.head_stride;
  params.o_token_stride = o_view.token_stride;
  params.o_head_stride = o_view.head_stride;
  params.total_q = p.total_q();
  params.total_k = p.total_k();
  if (cu_seqlens == nullptr) {
    params.seqlen_q = p.seqlen_q(0);
    params.seqlen_k = p.seqlen_k(0);
  } else {
    params.cu_seqlens_q = cu_seqlens;
    params.cu_seqlens_k = cu_seqlens + p.cu_seqlens_q.size();
  }
  params.max_seqlen_q = p.max_seqlen_q();
  params.batch = p.batch();
  params.num_heads = p.num_heads;
  params.num_kv_heads = p.num_kv_heads;
  params.head_dim = p.head_dim;
  params.scale = p.scale();
  params.window_left = p.effective_window_left();
  params.window_right = p.effective_window_right();
  params.dtype = p.dtype;
}

// The device facts the paged plan reads, of the engine's device.
absl::StatusOr<cuda::PagedDevice> QueryPagedDevice(int device) {
  cuda::PagedDevice d;
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&d.multiprocessors, cudaDevAttrMultiProcessorCount, device));
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      &d.shared_memory_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  return d;
}

class CudaFusedEngine final : public Engine {
 public:
  CudaFusedEngine(const EngineOptions& options, cuda::FusedKernel kernel,
                  const cuda::PagedOverrides& paged, const cuda::PagedDevice& device,
                  int forward_block_n, int forward_ctas, int forward_consumers)
      : options_(options),
        kernel_(kernel),
        forward_block_n_(forward_block_n),
        forward_ctas_(forward_ctas),
        forward_consumers_(forward_consumers),
        paged_(paged),
        device_(device) {}

  EngineKind kind() const override { return EngineKind::kCudaFused; }
  MemorySpace memory_space() const override { return MemorySpace::kDevice; }

  Support SupportsForward(const AttentionProblem& p) const override {
    return cuda::FusedSupports(Pass::kForward, p);
  }
  Support SupportsBackward(const AttentionProblem& p) const override {
    return cuda::FusedSupports(Pass::kBackward, p);
  }
  Support SupportsPagedForward(const AttentionProblem& p) const override {
    return cuda::FusedSupports(Pass::kPagedForward, p);
  }

  absl::Status Backward(const AttentionProblem& p, const BackwardArgs& args) override {
    ATTN_RETURN_IF_ERROR(ValidateBackward(p, args));
    ATTN_RETURN_IF_ERROR(cuda::FusedSupports(Pass::kBackward, p).status());
    if (p.total_q() == 0 && p.total_k() == 0) return absl::OkStatus();
    cuda::ScopedDevice device(options_.device);
    ATTN_RETURN_IF_ERROR(device.status());
    const cudaStream_t stream = AsStream(args.stream);

    // One lease: D and the dQ accumulator, then (variable lengths) the prefix sums.
    const int64_t work = cuda::FusedBackwardWorkspaceBytes(p);
    const size_t bytes = static_cast<size_t>(work) + SeqlensEntries(p) * sizeof(int32_t);
    ATTN_ASSIGN_OR_RETURN(cuda::WorkspaceLease lease, pool_.Acquire(bytes, stream));
    int32_t* cu_seqlens = nullptr;
    if (!p.is_uniform()) {
      cu_seqlens = reinterpret_cast<int32_t*>(static_cast<char*>(lease.data()) + work);
      ATTN_RETURN_IF_ERROR(UploadSeqlens(p, cu_seqlens, stream));
    }

    FusedBackwardParams params;
    // The backward only reads O and the LSE; the params type holds them as the forward writes
    // them.
    SetAttentionParams(p, args.q, args.k, args.v, const_cast<void*>(args.o.data), args.o,
                       const_cast<float*>(args.lse), cu_seqlens, params);
    params.d_o = args.d_o.data;
    params.dq = args.dq.data;
    params.dk = args.dk.data;
    params.dv = args.dv.data;
    params.do_token_stride = args.d_o.token_stride;
    params.do_head_stride = args.d_o.head_stride;
    params.dq_token_stride = args.dq.token_stride;
    params.dq_head_stride = args.dq.head_stride;
    params.dk_token_stride = args.dk.token_stride;
    params.dk_head_stride = args.dk.head_stride;
    params.dv_token_stride = args.dv.token_stride;
    params.dv_head_stride = args.dv.head_stride;
    params.max_seqlen_k = p.max_seqlen_k();
    params.kernel = kernel_;
    params.deterministic = args.deterministic;
    params.workspace = lease.data();
    return cuda::LaunchFusedBackward(params, stream);
  }

  absl::Status Forward(const AttentionProblem& p, const ForwardArgs& args) override {
    ATTN_RETURN_IF_ERROR(ValidateForward(p, args));
    ATTN_RETURN_IF_ERROR(cuda::FusedSupports(Pass::kForward, p).status());
    if (p.total_q() == 0) return absl::OkStatus();
    cuda::ScopedDevice device(options_.device);
    ATTN_RETURN_IF_ERROR(device.status());
    const cudaStream_t stream = AsStream(args.stream);

    // The lease orders the users of the workspace (variable lengths: the prefix sums travel to
    // the device through it) and of the TMA kernel's queue counters across streams.
    const size_t seqlens_bytes = p.is_uniform() ? 0 : SeqlensEntries(p) * sizeof(int32_t);
    ATTN_ASSIGN_OR_RETURN(cuda::WorkspaceLease lease, pool_.Acquire(seqlens_bytes, stream));
    int32_t* cu_seqlens = nullptr;
    if (!p.is_uniform()) {
      cu_seqlens = static_cast<int32_t*>(lease.data());
      ATTN_RETURN_IF_ERROR(UploadSeqlens(p, cu_seqlens, stream));
    }
    FusedForwardParams params;
    SetAttentionParams(p, args.q, args.k, args.v, args.o.data, args.o, args.lse, cu_seqlens,
                       params);
    params.kernel = kernel_;
    params.block_n = forward_block_n_;
    params.consumer_warpgroups = forward_consumers_;
    params.persistent_ctas = forward_ctas_;
    ATTN_ASSIGN_OR_RETURN(params.tile_counters, ZeroedCounters(kTileCounters));
    return cuda::LaunchFusedForward(params, stream);
  }

  absl::Status ForwardPaged(const AttentionProblem& p, const PagedForwardArgs& args) override {
    ATTN_RETURN_IF_ERROR(ValidatePagedForward(p, args));
    ATTN_RETURN_IF_ERROR(cuda::FusedSupports(Pass::kPagedForward, p).status());
    if (p.total_q() == 0) return absl::OkStatus();
    cuda::ScopedDevice device(options_.device);
    ATTN_RETURN_IF_ERROR(device.status());
    const cudaStream_t stream = AsStream(args.stream);

    const cuda::PagedForwardPlan plan = cuda::PlanPagedForward(p, device_, paged_);
    // One lease, which also orders the users of the counters across streams: the split
    // partials (float32, 16-byte aligned), then the prefix sums.
    const size_t partials = static_cast<size_t>(plan.workspace_bytes);
    const size_t bytes = partials + SeqlensEntries(p) * sizeof(int32_t);
    ATTN_ASSIGN_OR_RETURN(cuda::WorkspaceLease lease, pool_.Acquire(bytes, stream));
    char* workspace = static_cast<char*>(lease.data());
    int32_t* cu_seqlens = nullptr;
    if (!p.is_uniform()) {
      cu_seqlens = reinterpret_cast<int32_t*>(workspace + partials);
      ATTN_RETURN_IF_ERROR(UploadSeqlens(p, cu_seqlens, stream));
    }

    PagedForwardParams params;
    const PagedKV& kv = args.kv;
    const TensorRef pages{kv.pages, PagedKV::TokenStride(p), p.head_dim};
    SetAttentionParams(p, args.q, pages, pages, args.o.data, args.o, args.lse, cu_seqlens, params);
    params.block_table = kv.block_table;
    params.max_blocks = kv.max_blocks;
    params.page_stride = kv.page_stride;
    params.num_pages = kv.num_pages;
    while ((1 << params.page_shift) < kv.page_tokens) ++params.page_shift;
    params.v_offset = kv.v_offset(p);
    params.plan = plan;
    params.kernel = kernel_;
    params.persistent_ctas = forward_ctas_;
    if (plan.num_splits > 1) {
      params.o_partial = reinterpret_cast<float*>(workspace);
      params.lse_partial =
          params.o_partial + int64_t{plan.num_splits} * p.total_q() * p.num_heads * p.head_dim;
      ATTN_ASSIGN_OR_RETURN(params.split_counters, ZeroedCounters(plan.split_counters));
    }
    ATTN_ASSIGN_OR_RETURN(params.tile_counters, ZeroedCounters(kTileCounters));
    return cuda::LaunchPagedForward(params, stream);
  }

 private:
  // The TMA forward's queue (FusedForwardParams::tile_counters).
  static constexpr int64_t kTileCounters = 2;

  // `count` zeroed counters, which the kernels given them leave zero: the decode kernel's split
  // counters, the TMA forward's queue (one call is one kernel, so they share the first ones).
  // Used only while a workspace lease is held, so the lease orders their users across streams;
  // growing waits for the device, since work in flight may still count in the old ones.
  absl::StatusOr<int*> ZeroedCounters(int64_t count) {
    if (count > counters_capacity_) {
      ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
      zeroed_counters_.Reset();
      const int64_t capacity = std::max<int64_t>(count, 4096);
      ATTN_ASSIGN_OR_RETURN(zeroed_counters_, cuda::DeviceBuffer::Allocate(capacity * sizeof(int)));
      ATTN_CUDA_RETURN_IF_ERROR(cudaMemset(zeroed_counters_.get(), 0, capacity * sizeof(int)));
      ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the memset is asynchronous
      counters_capacity_ = capacity;
    }
    return zeroed_counters_.as<int>();
  }

  EngineOptions options_;
  cuda::FusedKernel kernel_;
  int forward_block_n_;
  int forward_ctas_;
  int forward_consumers_;
  cuda::PagedOverrides paged_;
  cuda::PagedDevice device_;
  cuda::WorkspacePool pool_;
  cuda::DeviceBuffer zeroed_counters_;
  int64_t counters_capacity_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> MakeCudaFusedEngine(const EngineOptions& options,
                                                            cuda::FusedKernel kernel,
                                                            const cuda::PagedOverrides& paged,
                                                            int forward_block_n, int forward_ctas,
                                                            int forward_consumers) {
  ATTN_RETURN_IF_ERROR(cuda::CheckDevice("cuda_fused", options.device));
  ATTN_ASSIGN_OR_RETURN(const cuda::PagedDevice device, QueryPagedDevice(options.device));
  return std::unique_ptr<Engine>(std::make_unique<CudaFusedEngine>(
      options, kernel, paged, device, forward_block_n, forward_ctas, forward_consumers));
}

absl::StatusOr<std::unique_ptr<Engine>> MakeCudaNaiveEngine(const EngineOptions& options) {
  return cuda::MakeNaiveEngine(options);
}

absl::Status CudaEngineAvailable(EngineKind kind, const EngineOptions& options) {
  return cuda::CheckDevice(EngineKindName(kind), options.device);
}

Support CudaEngineSupports(EngineKind kind, Pass pass, const AttentionProblem& p,
                           const EngineOptions& options) {
  if (kind == EngineKind::kCudaFused) return cuda::FusedSupports(pass, p);
  if (pass == Pass::kPagedForward) {
    return Support(Refusal::kOther,
                   absl::UnimplementedError(absl::StrCat(std::string(EngineKindName(kind)),
                                                         ": keys and values in pages are not "
                                                         "supported")));
  }
  return cuda::NaiveSupports(pass, p, options.workspace_limit_bytes);
}

}  // namespace attn
