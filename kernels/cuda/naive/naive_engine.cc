#include "cuda/naive/naive_engine.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"
#include "cuda/common/alignment.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_buffer.h"
#include "cuda/common/workspace_pool.h"
#include "cuda/naive/naive_backward.h"
#include "cuda/naive/naive_kernels.h"
#include "cuda/naive/sequence_runs.h"

namespace attn::cuda {
namespace {

using naive::kAlign;
using naive::kDeviceHeadroom;
using naive::MatrixFloats;
using naive::RoundUp;
using naive::SequenceRun;
using naive::SplitRuns;

constexpr int64_t kPointerArrays = 6;  // see naive::GemmPointers

// Bytes per score matrix in a chunk: the matrix and its six pointer-array entries.
int64_t BytesPerMatrix(const SequenceRun& r) {
  return MatrixFloats(r) * int64_t{sizeof(float)} + kPointerArrays * int64_t{sizeof(void*)};
}

// Slack for aligning the pointer arrays behind the matrices.
constexpr int64_t kLayoutSlack = (kPointerArrays + 1) * kAlign;

cudaDataType CudaType(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
  }
  return CUDA_R_32F;
}

// RESOURCE_EXHAUSTED when the smallest workspace of the forward exceeds the limit.
absl::Status CheckLimit(const AttentionProblem& p, const NaiveWorkspace& need, int64_t limit) {
  if (need.min_bytes > limit) {
    const int64_t lq = p.max_seqlen_q(), lk = p.max_seqlen_k();
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda_naive: needs at least ", need.min_bytes,
                     " bytes of device workspace (one head's float32 score matrix, up to ", lq,
                     " x ", lk, "), more than workspace_limit_bytes = ", limit));
  }
  return absl::OkStatus();
}

class CudaNaiveEngine final : public Engine {
 public:
  CudaNaiveEngine(const EngineOptions& options, cublasHandle_t cublas)
      : options_(options), cublas_(cublas) {}
  ~CudaNaiveEngine() override {
    ScopedDevice device(options_.device);
    cublasDestroy(cublas_);
  }

  EngineKind kind() const override { return EngineKind::kCudaNaive; }
  MemorySpace memory_space() const override { return MemorySpace::kDevice; }

  Support SupportsForward(const AttentionProblem& p) const override {
    return NaiveSupports(Pass::kForward, p, options_.workspace_limit_bytes);
  }
  Support SupportsBackward(const AttentionProblem& p) const override {
    return NaiveSupports(Pass::kBackward, p, options_.workspace_limit_bytes);
  }
  absl::Status Backward(const AttentionProblem& p, const BackwardArgs& args) override {
    ATTN_RETURN_IF_ERROR(ValidateBackward(p, args));
    ScopedDevice device(options_.device);
    ATTN_RETURN_IF_ERROR(device.status());
    return RunNaiveBackward(cublas_, pool_, options_.workspace_limit_bytes, p, args);
  }

  absl::Status Forward(const AttentionProblem& p, const ForwardArgs& args) override;

 private:
  // Workspace bytes to hold: as much of the full need as the limit and the device allow.
  absl::StatusOr<int64_t> ChooseWorkspaceBytes(const AttentionProblem& p,
                                               const NaiveWorkspace& need) {
    ATTN_RETURN_IF_ERROR(CheckLimit(p, need, options_.workspace_limit_bytes));
    int64_t bytes = std::min(need.full_bytes, options_.workspace_limit_bytes);
    if (bytes <= static_cast<int64_t>(pool_.capacity())) return bytes;
    ATTN_ASSIGN_OR_RETURN(const size_t available, pool_.AvailableBytes());
    const int64_t usable = static_cast<int64_t>(available) - kDeviceHeadroom;
    if (bytes > usable) bytes = std::max(need.min_bytes, usable);
    if (bytes > usable) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda_naive: needs at least ", need.min_bytes,
                       " bytes of device workspace (one head's float32 score matrix, up to ",
                       p.max_seqlen_q(), " x ", p.max_seqlen_k(), "), but the device has only ",
                       available, " bytes free (", kDeviceHeadroom, " kept back)"));
    }
    return bytes;
  }

  absl::Status RunChunks(const AttentionProblem& p, const ForwardArgs& args, const SequenceRun& run,
                         void* workspace, int64_t workspace_bytes, cudaStream_t stream);
  // The same chunk with one cuBLAS call per matrix and product (for unaligned tensors).
  absl::Status RunChunkUnbatched(const AttentionProblem& p, const ForwardArgs& args,
                                 const naive::ChunkGeometry& g, const naive::Operands& x,
                                 cudaStream_t stream);

  EngineOptions options_;
  cublasHandle_t cublas_;
  WorkspacePool pool_;
};

absl::Status CudaNaiveEngine::Forward(const AttentionProblem& p, const ForwardArgs& args) {
  ATTN_RETURN_IF_ERROR(ValidateForward(p, args));
  if (p.total_q() == 0) return absl::OkStatus();
  const NaiveWorkspace need = NaiveWorkspaceBytes(p);
  ATTN_RETURN_IF_ERROR(CheckLimit(p, need, options_.workspace_limit_bytes));

  ScopedDevice device(options_.device);
  ATTN_RETURN_IF_ERROR(device.status());
  const cudaStream_t stream = AsStream(args.stream);
  ATTN_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas_, stream));

  const std::vector<SequenceRun> runs = SplitRuns(p);
  ATTN_ASSIGN_OR_RETURN(const int64_t workspace_bytes, ChooseWorkspaceBytes(p, need));
  ATTN_ASSIGN_OR_RETURN(WorkspaceLease lease,
                        pool_.Acquire(static_cast<size_t>(workspace_bytes), stream));
  for (const SequenceRun& run : runs) {
    if (run.lq == 0) continue;
    const int64_t q_begin = p.cu_seqlens_q[run.first_sequence];
    if (run.lk == 0) {
      ATTN_RETURN_IF_ERROR(naive::LaunchFillKeyless(
          args.o.data, args.o.token_stride, args.o.head_stride, q_begin, run.sequences * run.lq,
          p.num_heads, p.head_dim, p.dtype, args.lse, p.total_q(), stream));
      continue;
    }
    ATTN_RETURN_IF_ERROR(RunChunks(p, args, run, lease.data(), workspace_bytes, stream));
  }
  return absl::OkStatus();
}

absl::Status CudaNaiveEngine::RunChunks(const AttentionProblem& p, const ForwardArgs& args,
                                        const SequenceRun& run, void* workspace,
                                        int64_t workspace_bytes, cudaStream_t stream) {
  const int64_t matrices = int64_t{run.sequences} * p.num_heads;
  const int64_t capacity =
      std::min(matrices, (workspace_bytes - kLayoutSlack) / BytesPerMatrix(run));
  if (capacity < 1) {
    return absl::InternalError("cuda_naive: workspace smaller than one score matrix");
  }
  char* const base = static_cast<char*>(workspace);
  float* const scores = reinterpret_cast<float*>(base);
  const int64_t scores_bytes =
      RoundUp(capacity * MatrixFloats(run) * int64_t{sizeof(float)}, kAlign);
  const int64_t array_bytes = RoundUp(capacity * int64_t{sizeof(void*)}, kAlign);
  void** arrays = reinterpret_cast<void**>(base + scores_bytes);
  const auto array = [&](int i) {
    return reinterpret_cast<void**>(reinterpret_cast<char*>(arrays) + i * array_bytes);
  };
  naive::GemmPointers ptrs{
      const_cast<const void**>(array(0)), const_cast<const void**>(array(1)), array(2),
      const_cast<const void**>(array(3)), const_cast<const void**>(array(4)), array(5)};

  const int d = p.head_dim;
  const int es = static_cast<int>(DTypeSize(p.dtype));
  const naive::Operands x{args.q.data,
                          args.k.data,
                          args.v.data,
                          args.o.data,
                          args.q.token_stride,
                          args.q.head_stride,
                          args.k.token_stride,
                          args.k.head_stride,
                          args.v.token_stride,
                          args.v.head_stride,
                          args.o.token_stride,
                          args.o.head_stride,
                          es};
  // cuBLAS wants leading dimensions >= the rows it reads; a tensor of one token may carry any
  // token stride, and only one column is read then.
  const int64_t ldq = std::max<int64_t>(args.q.token_stride, d);
  const int64_t ldk = std::max<int64_t>(args.k.token_stride, d);
  const int64_t ldv = std::max<int64_t>(args.v.token_stride, d);
  const int64_t ldo = std::max<int64_t>(args.o.token_stride, d);
  const int64_t ldp = run.lk * int64_t{sizeof(float)} / es;  // P rows overlay S rows
  const cudaDataType type = CudaType(p.dtype);
  const float scale = p.scale(), one = 1.f, zero = 0.f;

  naive::ChunkGeometry g = naive::RunGeometry(p, run, scores);
  // cuBLAS cannot see the alignment of matrices behind pointer arrays; unless every matrix
  // starts 16-byte aligned, each product is issued on its own and cuBLAS checks its pointers.
  const bool aligned = CheckRowsAligned16(p, args).ok();
  for (int64_t m0 = 0; m0 < matrices; m0 += capacity) {
    g.m0 = m0;
    g.count = std::min(capacity, matrices - m0);
    if (!aligned) {
      ATTN_RETURN_IF_ERROR(RunChunkUnbatched(p, args, g, x, stream));
      continue;
    }
    ATTN_RETURN_IF_ERROR(naive::LaunchBuildPointers(g, x, ptrs, stream));
    // S^T (lk x lq, column-major) = K_bh (d x lk)^T * Q_bh (d x lq), times the softmax scale.
    ATTN_CUBLAS_RETURN_IF_ERROR(
        cublasGemmBatchedEx_64(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, run.lk, run.lq, d, &scale,
                               ptrs.a1, type, ldk, ptrs.b1, type, ldq, &zero, ptrs.c1, CUDA_R_32F,
                               run.lk, g.count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    ATTN_RETURN_IF_ERROR(naive::LaunchSoftmaxRows(g, p.dtype, p.effective_window_left(),
                                                  p.effective_window_right(), args.lse, p.total_q(),
                                                  stream));
    // O^T (d x lq) = V_bh^T (d x lk) * P^T (lk x lq).
    ATTN_CUBLAS_RETURN_IF_ERROR(cublasGemmBatchedEx_64(
        cublas_, CUBLAS_OP_N, CUBLAS_OP_N, d, run.lq, run.lk, &one, ptrs.a2, type, ldv, ptrs.b2,
        type, ldp, &zero, ptrs.c2, type, ldo, g.count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  return absl::OkStatus();
}

absl::Status CudaNaiveEngine::RunChunkUnbatched(const AttentionProblem& p, const ForwardArgs& args,
                                                const naive::ChunkGeometry& g,
                                                const naive::Operands& x, cudaStream_t stream) {
  const int d = p.head_dim;
  const int64_t es = x.element_size;
  const int64_t ldq = std::max<int64_t>(x.q_token_stride, d);
  const int64_t ldk = std::max<int64_t>(x.k_token_stride, d);
  const int64_t ldv = std::max<int64_t>(x.v_token_stride, d);
  const int64_t ldo = std::max<int64_t>(x.o_token_stride, d);
  const int64_t ldp = g.lk * int64_t{sizeof(float)} / es;
  const cudaDataType type = CudaType(p.dtype);
  const float scale = p.scale(), one = 1.f, zero = 0.f;
  const auto at = [es](const void* base, int64_t token, int64_t token_stride, int64_t head,
                       int64_t head_stride) {
    return static_cast<const char*>(base) + (token * token_stride + head * head_stride) * es;
  };
  for (int64_t i = 0; i < g.count; ++i) {
    const int64_t m = g.m0 + i;
    const int64_t b = m / g.num_heads, h = m % g.num_heads, kv = h / g.group_size;
    const int64_t q_token = g.q_begin + b * g.lq, k_token = g.k_begin + b * g.lk;
    float* s = g.s + i * g.s_matrix_stride;
    ATTN_CUBLAS_RETURN_IF_ERROR(
        cublasGemmEx_64(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, g.lk, g.lq, d, &scale,
                        at(x.k, k_token, x.k_token_stride, kv, x.k_head_stride), type, ldk,
                        at(x.q, q_token, x.q_token_stride, h, x.q_head_stride), type, ldq, &zero, s,
                        CUDA_R_32F, g.lk, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  ATTN_RETURN_IF_ERROR(naive::LaunchSoftmaxRows(g, p.dtype, p.effective_window_left(),
                                                p.effective_window_right(), args.lse, p.total_q(),
                                                stream));
  for (int64_t i = 0; i < g.count; ++i) {
    const int64_t m = g.m0 + i;
    const int64_t b = m / g.num_heads, h = m % g.num_heads, kv = h / g.group_size;
    const int64_t q_token = g.q_begin + b * g.lq, k_token = g.k_begin + b * g.lk;
    float* s = g.s + i * g.s_matrix_stride;
    ATTN_CUBLAS_RETURN_IF_ERROR(cublasGemmEx_64(
        cublas_, CUBLAS_OP_N, CUBLAS_OP_N, d, g.lq, g.lk, &one,
        at(x.v, k_token, x.v_token_stride, kv, x.v_head_stride), type, ldv, s, type, ldp, &zero,
        const_cast<char*>(at(x.o, q_token, x.o_token_stride, h, x.o_head_stride)), type, ldo,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  return absl::OkStatus();
}

}  // namespace

NaiveWorkspace NaiveWorkspaceBytes(const AttentionProblem& p) {
  NaiveWorkspace need;
  for (const SequenceRun& run : SplitRuns(p)) {
    if (run.lq == 0 || run.lk == 0) continue;
    const int64_t per_matrix = BytesPerMatrix(run);
    need.min_bytes = std::max(need.min_bytes, per_matrix + kLayoutSlack);
    need.full_bytes =
        std::max(need.full_bytes, per_matrix * run.sequences * p.num_heads + kLayoutSlack);
  }
  return need;
}

Support NaiveSupports(Pass pass, const AttentionProblem& p, int64_t workspace_limit_bytes) {
  if (Support valid = ValidProblemSupport(p); !valid.ok()) return valid;
  absl::Status fits;
  if (pass == Pass::kForward) {
    fits = CheckLimit(p, NaiveWorkspaceBytes(p), workspace_limit_bytes);
  } else if (const NaiveBackwardWorkspace need = NaiveBackwardWorkspaceBytes(p);
             need.min_bytes > workspace_limit_bytes) {
    fits = absl::ResourceExhaustedError(absl::StrCat(
        "cuda_naive backward: needs at least ", need.min_bytes,
        " bytes of device workspace, more than workspace_limit_bytes = ", workspace_limit_bytes));
  }
  if (!fits.ok()) return Support(Refusal::kTooLarge, std::move(fits));
  return Support();
}

absl::StatusOr<std::unique_ptr<Engine>> MakeNaiveEngine(const EngineOptions& options) {
  ATTN_RETURN_IF_ERROR(CheckDevice("cuda_naive", options.device));
  ScopedDevice device(options.device);
  ATTN_RETURN_IF_ERROR(device.status());
  cublasHandle_t handle = nullptr;
  ATTN_CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  // Default math: float32 storage gets plain float32 products (no TF32), the precision
  // baseline; fp16/bf16 use tensor cores with float32 accumulation.
  const cublasStatus_t mode = cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH);
  if (mode != CUBLAS_STATUS_SUCCESS) {
    cublasDestroy(handle);
    return CublasStatus(mode, "cublasSetMathMode");
  }
  return std::unique_ptr<Engine>(std::make_unique<CudaNaiveEngine>(options, handle));
}

}  // namespace attn::cuda
