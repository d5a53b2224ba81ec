#include "cuda/naive/naive_backward.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"
#include "cuda/common/alignment.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_buffer.h"
#include "cuda/naive/naive_backward_kernels.h"
#include "cuda/naive/naive_kernels.h"
#include "cuda/naive/sequence_runs.h"

namespace attn::cuda {
namespace {

using naive::ChunkGeometry;
using naive::OperandSpec;
using naive::OperandTable;

using naive::kAlign;
using naive::kDeviceHeadroom;
using naive::MatrixFloats;
using naive::RoundUp;
using naive::RunGeometry;
using naive::SequenceRun;
using naive::SplitRuns;

// The operands of the five products, in OperandTable order.
enum Operand : int { kK, kQ, kP, kV, kDO, kDS, kDQ, kDKAcc, kDVAcc, kNumOperands };
constexpr int64_t kSlack = (kNumOperands + 4) * kAlign;

// S/P and dP/dS of one (sequence, head), plus its pointer-array entries.
int64_t BytesPerMatrix(const SequenceRun& r) {
  return 2 * MatrixFloats(r) * int64_t{sizeof(float)} + kNumOperands * int64_t{sizeof(void*)};
}
int64_t AccumulatorBytes(const AttentionProblem& p) {
  return RoundUp(p.total_k() * p.num_heads * p.head_dim * int64_t{sizeof(float)}, kAlign);
}

cudaDataType CudaType(DType t) {
  return t == DType::kF16 ? CUDA_R_16F : t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
}

// One batched product: C = alpha * op(A) op(B), operands by index.
struct Product {
  cublasOperation_t op_a, op_b;
  int64_t m, n, k;
  float alpha;
  int a, b, c;
  int64_t lda, ldb, ldc;
  cudaDataType c_type;
};

class BackwardRunner {
 public:
  BackwardRunner(cublasHandle_t cublas, const AttentionProblem& p, const BackwardArgs& args,
                 cudaStream_t stream)
      : cublas_(cublas), p_(p), args_(args), stream_(stream), type_(CudaType(p.dtype)) {}

  absl::Status Run(char* workspace, int64_t workspace_bytes) {
    const int64_t acc_bytes = AccumulatorBytes(p_);
    float* dk_acc = reinterpret_cast<float*>(workspace);
    float* dv_acc = reinterpret_cast<float*>(workspace + acc_bytes);
    if (acc_bytes > 0) {
      ATTN_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(workspace, 0, 2 * acc_bytes, stream_));
    }
    char* chunk_area = workspace + 2 * acc_bytes;
    const int64_t chunk_bytes = workspace_bytes - 2 * acc_bytes;
    for (const SequenceRun& run : SplitRuns(p_)) {
      if (run.lq == 0) continue;
      if (run.lk == 0) {
        ATTN_RETURN_IF_ERROR(naive::LaunchFillKeyless(
            args_.dq.data, args_.dq.token_stride, args_.dq.head_stride,
            p_.cu_seqlens_q[run.first_sequence], run.sequences * run.lq, p_.num_heads, p_.head_dim,
            p_.dtype, nullptr, p_.total_q(), stream_));
        continue;
      }
      ATTN_RETURN_IF_ERROR(RunChunks(run, chunk_area, chunk_bytes, dk_acc, dv_acc));
    }
    const int64_t tk = p_.total_k();
    ATTN_RETURN_IF_ERROR(naive::LaunchReduceGroups(
        dk_acc, tk, p_.num_heads, p_.num_kv_heads, p_.head_dim, args_.dk.data,
        args_.dk.token_stride, args_.dk.head_stride, p_.dtype, stream_));
    return naive::LaunchReduceGroups(dv_acc, tk, p_.num_heads, p_.num_kv_heads, p_.head_dim,
                                     args_.dv.data, args_.dv.token_stride, args_.dv.head_stride,
                                     p_.dtype, stream_);
  }

 private:
  OperandSpec Tensor(const void* base, int64_t token_stride, int64_t head_stride,
                     OperandSpec::Token token, OperandSpec::Head head, int64_t element_size) {
    OperandSpec s;
    s.base = static_cast<const char*>(base);
    s.token = token;
    s.head = head;
    s.token_stride = token_stride;
    s.head_stride = head_stride;
    s.element_size = element_size;
    return s;
  }

  absl::Status RunChunks(const SequenceRun& run, char* area, int64_t area_bytes, float* dk_acc,
                         float* dv_acc) {
    const int64_t matrices = int64_t{run.sequences} * p_.num_heads;
    const int64_t capacity = std::min(matrices, (area_bytes - kSlack) / BytesPerMatrix(run));
    if (capacity < 1) return absl::InternalError("cuda_naive backward: workspace too small");
    const int64_t slot_bytes = MatrixFloats(run) * int64_t{sizeof(float)};
    float* s_region = reinterpret_cast<float*>(area);
    float* dp_region = reinterpret_cast<float*>(area + RoundUp(capacity * slot_bytes, kAlign));
    void** arrays = reinterpret_cast<void**>(area + 2 * RoundUp(capacity * slot_bytes, kAlign));

    const int64_t es = DTypeSize(p_.dtype);
    const int d = p_.head_dim;
    const int64_t acc_token_stride = int64_t{p_.num_heads} * d;
    OperandTable table;
    table.count = kNumOperands;
    table.spec[kK] = Tensor(args_.k.data, args_.k.token_stride, args_.k.head_stride,
                            OperandSpec::kKey, OperandSpec::kKvHead, es);
    table.spec[kQ] = Tensor(args_.q.data, args_.q.token_stride, args_.q.head_stride,
                            OperandSpec::kQuery, OperandSpec::kQueryHead, es);
    table.spec[kV] = Tensor(args_.v.data, args_.v.token_stride, args_.v.head_stride,
                            OperandSpec::kKey, OperandSpec::kKvHead, es);
    table.spec[kDO] = Tensor(args_.d_o.data, args_.d_o.token_stride, args_.d_o.head_stride,
                             OperandSpec::kQuery, OperandSpec::kQueryHead, es);
    table.spec[kDQ] = Tensor(args_.dq.data, args_.dq.token_stride, args_.dq.head_stride,
                             OperandSpec::kQuery, OperandSpec::kQueryHead, es);
    table.spec[kDKAcc] = Tensor(dk_acc, acc_token_stride, d, OperandSpec::kKey,
                                OperandSpec::kQueryHead, sizeof(float));
    table.spec[kDVAcc] = Tensor(dv_acc, acc_token_stride, d, OperandSpec::kKey,
                                OperandSpec::kQueryHead, sizeof(float));
    table.spec[kP].base = reinterpret_cast<const char*>(s_region);
    table.spec[kP].slot_bytes = slot_bytes;
    table.spec[kDS].base = reinterpret_cast<const char*>(dp_region);
    table.spec[kDS].slot_bytes = slot_bytes;

    const auto ld = [d](int64_t token_stride) { return std::max<int64_t>(token_stride, d); };
    const int64_t ldq = ld(args_.q.token_stride), ldk = ld(args_.k.token_stride);
    const int64_t ldv = ld(args_.v.token_stride), ldo = ld(args_.d_o.token_stride);
    const int64_t ldq_out = ld(args_.dq.token_stride);
    const int64_t lds = run.lk;                                // float32 S and dP
    const int64_t ldp = run.lk * int64_t{sizeof(float)} / es;  // P and dS over them
    const float scale = p_.scale();
    const cublasOperation_t N = CUBLAS_OP_N, T = CUBLAS_OP_T;
    // Column-major views: a [tokens, d] slice of a tensor is d x tokens with ld = token stride;
    // S, P, dP, dS are lk x lq.
    const Product scores{T, N, run.lk, run.lq, d, scale, kK, kQ, kP, ldk, ldq, lds, CUDA_R_32F};
    const Product dprobs{T, N, run.lk, run.lq, d, 1.f, kV, kDO, kDS, ldv, ldo, lds, CUDA_R_32F};
    const Product dq{N, N, d, run.lq, run.lk, 1.f, kK, kDS, kDQ, ldk, ldp, ldq_out, type_};
    const Product dk{N,   T,      d,   run.lk, run.lq,           1.f,       kQ,
                     kDS, kDKAcc, ldq, ldp,    acc_token_stride, CUDA_R_32F};
    const Product dv{N,  T,      d,   run.lk, run.lq,           1.f,       kDO,
                     kP, kDVAcc, ldo, ldp,    acc_token_stride, CUDA_R_32F};

    // cuBLAS cannot see the alignment behind pointer arrays (see naive_engine.cc); the float32
    // accumulators' head stride is d floats.
    ForwardArgs view;
    view.q = args_.q;
    view.k = args_.k;
    view.v = args_.v;
    view.o = args_.dq;
    const bool aligned =
        d % 4 == 0 && CheckRowsAligned16(p_, view).ok() &&
        CheckRowsAligned16(p_, ForwardArgs{args_.d_o, args_.k, args_.v, args_.dq, nullptr, nullptr})
            .ok();

    ChunkGeometry g = RunGeometry(p_, run, s_region);
    for (int64_t m0 = 0; m0 < matrices; m0 += capacity) {
      g.m0 = m0;
      g.count = std::min(capacity, matrices - m0);
      if (aligned) {
        ATTN_RETURN_IF_ERROR(naive::LaunchOperandPointers(g, table, arrays, capacity, stream_));
      }
      const auto product = [&](const Product& x) {
        return Multiply(x, g, table, aligned ? arrays : nullptr, capacity);
      };
      ATTN_RETURN_IF_ERROR(product(scores));
      ATTN_RETURN_IF_ERROR(naive::LaunchRecomputeProbs(g, p_.dtype, p_.effective_window_left(),
                                                       p_.effective_window_right(), args_.lse,
                                                       p_.total_q(), stream_));
      ATTN_RETURN_IF_ERROR(product(dprobs));
      ATTN_RETURN_IF_ERROR(
          naive::LaunchScoreGradients(g, p_.dtype, s_region, dp_region, scale, stream_));
      ATTN_RETURN_IF_ERROR(product(dq));
      ATTN_RETURN_IF_ERROR(product(dk));
      ATTN_RETURN_IF_ERROR(product(dv));
    }
    return absl::OkStatus();
  }

  // One product over the chunk: batched through the pointer arrays, or (arrays == null) one
  // call per matrix with host-computed addresses.
  absl::Status Multiply(const Product& x, const ChunkGeometry& g, const OperandTable& table,
                        void** arrays, int64_t capacity) {
    const float zero = 0.f;
    if (arrays != nullptr) {
      return CublasStatus(
          cublasGemmBatchedEx_64(cublas_, x.op_a, x.op_b, x.m, x.n, x.k, &x.alpha,
                                 arrays + x.a * capacity, type_, x.lda, arrays + x.b * capacity,
                                 type_, x.ldb, &zero, arrays + x.c * capacity, x.c_type, x.ldc,
                                 g.count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmBatchedEx_64 (naive backward)");
    }
    for (int64_t i = 0; i < g.count; ++i) {
      ATTN_CUBLAS_RETURN_IF_ERROR(
          cublasGemmEx_64(cublas_, x.op_a, x.op_b, x.m, x.n, x.k, &x.alpha,
                          naive::OperandAddress(table.spec[x.a], g, i), type_, x.lda,
                          naive::OperandAddress(table.spec[x.b], g, i), type_, x.ldb, &zero,
                          const_cast<char*>(naive::OperandAddress(table.spec[x.c], g, i)), x.c_type,
                          x.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    return absl::OkStatus();
  }

  cublasHandle_t cublas_;
  const AttentionProblem& p_;
  const BackwardArgs& args_;
  cudaStream_t stream_;
  cudaDataType type_;
};

}  // namespace

NaiveBackwardWorkspace NaiveBackwardWorkspaceBytes(const AttentionProblem& p) {
  NaiveBackwardWorkspace need;
  const int64_t acc = 2 * AccumulatorBytes(p) + kSlack;
  need.min_bytes = acc;
  need.full_bytes = acc;
  for (const SequenceRun& run : SplitRuns(p)) {
    if (run.lq == 0 || run.lk == 0) continue;
    const int64_t per_matrix = BytesPerMatrix(run);
    need.min_bytes = std::max(need.min_bytes, acc + per_matrix);
    need.full_bytes = std::max(need.full_bytes, acc + per_matrix * run.sequences * p.num_heads);
  }
  return need;
}

absl::Status RunNaiveBackward(cublasHandle_t cublas, WorkspacePool& pool, int64_t limit_bytes,
                              const AttentionProblem& p, const BackwardArgs& args) {
  if (p.total_q() == 0 && p.total_k() == 0) return absl::OkStatus();
  const NaiveBackwardWorkspace need = NaiveBackwardWorkspaceBytes(p);
  const auto exhausted = [&](const std::string& what) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda_naive backward: needs at least ", need.min_bytes,
        " bytes of device workspace (float32 dK/dV accumulators and two float32 score matrices "
        "of up to ",
        p.max_seqlen_q(), " x ", p.max_seqlen_k(), "), ", what));
  };
  if (need.min_bytes > limit_bytes) {
    return exhausted(absl::StrCat("more than workspace_limit_bytes = ", limit_bytes));
  }
  int64_t bytes = std::min(need.full_bytes, limit_bytes);
  if (bytes > static_cast<int64_t>(pool.capacity())) {
    ATTN_ASSIGN_OR_RETURN(const size_t available, pool.AvailableBytes());
    const int64_t usable = static_cast<int64_t>(available) - kDeviceHeadroom;
    if (bytes > usable) bytes = std::max(need.min_bytes, usable);
    if (bytes > usable) {
      return exhausted(absl::StrCat("but the device has only ", available, " bytes free"));
    }
  }
  const cudaStream_t stream = AsStream(args.stream);
  ATTN_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas, stream));
  ATTN_ASSIGN_OR_RETURN(WorkspaceLease lease, pool.Acquire(static_cast<size_t>(bytes), stream));
  BackwardRunner runner(cublas, p, args, stream);
  return runner.Run(static_cast<char*>(lease.data()), bytes);
}

}  // namespace attn::cuda
