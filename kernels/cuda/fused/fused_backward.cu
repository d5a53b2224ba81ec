// The fused backward's launch (see fused_backward.h for the algorithm): the D kernel (which
// also zeroes the dQ accumulator), the main kernel of the table's row (fused_backward_kernel.cuh,
// one generated file per row), the dQ kernel, and the workspace they share.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "cuda/common/alignment.h"
#include "cuda/common/element_convert.cuh"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/dq_order.cuh"
#include "cuda/fused/fused_backward.h"
#include "cuda/fused/fused_backward_launch.h"
#include "cuda/fused/ptx.cuh"

namespace attn::cuda {
namespace {

// Block size of the D and dQ kernels.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// How the D and dQ kernels lay a (token, head) row of head_dim elements over lanes: a lane
// takes 16-byte pieces of it (8 elements), a group of kLanes lanes (a power of two) one row,
// 32 / kLanes rows a warp. The kernels they replace (a warp a row with a 2-byte element a lane
// for D, a thread an element with 64-bit index arithmetic for dQ, a memset for the
// accumulator) cost a fixed time per token that weighs most at short sequences.
template <int kHeadDim>
struct RowLanes {
  static constexpr int kPieceElements = 8;  // 16 bytes of 16-bit elements
  static constexpr int kPieces = kHeadDim / kPieceElements;
  static constexpr int kLanes = kPieces >= 32 ? 32 : kPieces > 8 ? 16 : kPieces > 4 ? 8 : 4;
  static constexpr int kRowsPerWarp = 32 / kLanes;
  static constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
  static_assert(kHeadDim % kPieceElements == 0, "rows of whole 16-byte pieces");
};

// A row's 16-byte piece: one vector access where the rows are 16-byte aligned (`vector`, the
// same for every thread), element by element otherwise.
template <typename T>
__device__ __forceinline__ void LoadPiece(const T* src, bool vector, float (&out)[8]) {
  if (vector) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = ToFloat(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = ToFloat(src[i]);
  }
}

template <typename T>
__device__ __forceinline__ void StorePiece(T* dst, bool vector, const float (&in)[8]) {
  if (vector) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = FromFloat<T>(in[i]);
    ptx::StoreGlobal128(dst, raw);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = FromFloat<T>(in[i]);
  }
}

// The (token, head) row of this thread's lane group, and the lane's place in the group; `live`
// is false for the groups of the last block past the rows.
template <int kHeadDim>
struct RowOfLane {
  int64_t row;
  int lane;
  bool live;
  int64_t token;
  int head;
  __device__ __forceinline__ explicit RowOfLane(const FusedBackwardParams& p) {
    using Lanes = RowLanes<kHeadDim>;
    const int lane_id = static_cast<int>(threadIdx.x % 32);
    row = int64_t{blockIdx.x} * Lanes::kRowsPerBlock +
          static_cast<int>(threadIdx.x / 32) * Lanes::kRowsPerWarp + lane_id / Lanes::kLanes;
    lane = lane_id % Lanes::kLanes;
    live = row < p.total_q * p.num_heads;
    token = row / p.num_heads;
    head = static_cast<int>(row % p.num_heads);
  }
};

// delta[h, t] = sum_c dO[t, h, c] * O[t, h, c] in float32, and the row's dQ accumulator
// ([total_q, heads, head_dim] float32) set to zero: one pass over the rows where a memset and a
// second kernel were.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    PrepareBackwardKernel(const FusedBackwardParams p, float* delta, float* dq_accum,
                          bool vector_rows) {
  using Lanes = RowLanes<kHeadDim>;
  const RowOfLane<kHeadDim> at(p);
  float sum = 0.f;
  if (at.live) {
    const T* o =
        static_cast<const T*>(p.o) + at.token * p.o_token_stride + at.head * p.o_head_stride;
    const T* d_o =
        static_cast<const T*>(p.d_o) + at.token * p.do_token_stride + at.head * p.do_head_stride;
    float4* accum = reinterpret_cast<float4*>(dq_accum + at.row * kHeadDim);
#pragma unroll
    for (int piece = at.lane; piece < Lanes::kPieces; piece += Lanes::kLanes) {
      float o_piece[8], do_piece[8];
      LoadPiece(o + piece * Lanes::kPieceElements, vector_rows, o_piece);
      LoadPiece(d_o + piece * Lanes::kPieceElements, vector_rows, do_piece);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += o_piece[i] * do_piece[i];
      accum[2 * piece] = make_float4(0.f, 0.f, 0.f, 0.f);
      accum[2 * piece + 1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  // Every lane takes part (rows past the end with 0); the groups are closed under these xors.
#pragma unroll
  for (int offset = Lanes::kLanes / 2; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  if (at.live && at.lane == 0) delta[at.head * p.total_q + at.token] = sum;
}

// dq[t, h, c] = accumulator, rounded to the dtype.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    StoreDqKernel(const FusedBackwardParams p, const float* dq_accum, bool vector_rows) {
  using Lanes = RowLanes<kHeadDim>;
  const RowOfLane<kHeadDim> at(p);
  if (!at.live) return;
  T* dq = static_cast<T*>(p.dq) + at.token * p.dq_token_stride + at.head * p.dq_head_stride;
  const float4* accum = reinterpret_cast<const float4*>(dq_accum + at.row * kHeadDim);
#pragma unroll
  for (int piece = at.lane; piece < Lanes::kPieces; piece += Lanes::kLanes) {
    const float4 lo = accum[2 * piece];
    const float4 hi = accum[2 * piece + 1];
    const float values[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    StorePiece(dq + piece * Lanes::kPieceElements, vector_rows, values);
  }
}

// The workspace holds D, padded to 16 bytes so that the dQ accumulator after it takes vector
// atomics and bulk reductions, then the accumulator, then the deterministic mode's counters.
int64_t DeltaFloats(int64_t rows) { return (rows + 3) / 4 * 4; }

int64_t DqCounterTiles(int64_t max_seqlen_q) {
  return (max_seqlen_q + kDqCounterRows - 1) / kDqCounterRows;
}

bool Aligned16(const void* data, int64_t token_stride, int64_t head_stride) {
  return RowsAligned16(data, token_stride, head_stride, /*element_bytes=*/2);
}

template <DType kDType, int kHeadDim>
cudaError_t RunBackward(const FusedBackwardParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  const int64_t rows = p.total_q * p.num_heads;
  const int64_t accum_elems = rows * kHeadDim;
  FusedBackwardWorkspace work;
  float* delta = static_cast<float*>(p.workspace);
  work.delta = delta;
  work.dq_accum = delta + DeltaFloats(rows);
  work.dq_tile_counters = reinterpret_cast<int*>(work.dq_accum + accum_elems);
  work.query_tiles = DqCounterTiles(p.max_seqlen_q);
  if (p.deterministic) {
    const int64_t counters = int64_t{p.batch} * p.num_heads * work.query_tiles;
    if (cudaError_t e = cudaMemsetAsync(work.dq_tile_counters, 0, counters * sizeof(int), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  using Lanes = RowLanes<kHeadDim>;
  const auto row_blocks =
      static_cast<unsigned>((rows + Lanes::kRowsPerBlock - 1) / Lanes::kRowsPerBlock);
  if (rows > 0) {
    const bool vector_rows = Aligned16(p.o, p.o_token_stride, p.o_head_stride) &&
                             Aligned16(p.d_o, p.do_token_stride, p.do_head_stride);
    PrepareBackwardKernel<T, kHeadDim>
        <<<row_blocks, kThreads, 0, stream>>>(p, delta, work.dq_accum, vector_rows);
  }

  const bool aligned_inputs = Aligned16(p.q, p.q_token_stride, p.q_head_stride) &&
                              Aligned16(p.k, p.k_token_stride, p.k_head_stride) &&
                              Aligned16(p.v, p.v_token_stride, p.v_head_stride) &&
                              Aligned16(p.d_o, p.do_token_stride, p.do_head_stride);
  const bool aligned_outputs = Aligned16(p.dk, p.dk_token_stride, p.dk_head_stride) &&
                               Aligned16(p.dv, p.dv_token_stride, p.dv_head_stride);
  if (cudaError_t e = RunFusedBackwardKernel<kDType, kHeadDim>(p, work, aligned_inputs,
                                                               aligned_outputs, stream);
      e != cudaSuccess) {
    return e;
  }
  if (rows > 0) {
    StoreDqKernel<T, kHeadDim><<<row_blocks, kThreads, 0, stream>>>(
        p, work.dq_accum, Aligned16(p.dq, p.dq_token_stride, p.dq_head_stride));
  }
  return cudaGetLastError();
}

}  // namespace

int64_t FusedBackwardWorkspaceBytes(const AttentionProblem& p) {
  const int64_t rows = p.total_q() * p.num_heads;
  const int64_t counters = int64_t{p.batch()} * p.num_heads * DqCounterTiles(p.max_seqlen_q());
  return (DeltaFloats(rows) + rows * p.head_dim) * static_cast<int64_t>(sizeof(float)) +
         counters * static_cast<int64_t>(sizeof(int));
}

absl::Status LaunchFusedBackward(const FusedBackwardParams& p, void* stream) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError("cuda_fused: num_heads must be a multiple of num_kv_heads");
  }
  if (p.total_q == 0 && p.max_seqlen_k == 0) return absl::OkStatus();
  auto* s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = DispatchFusedKernel<Pass::kBackward>(
      p.dtype, p.head_dim, cudaErrorInvalidValue,
      [&]<DType kDType, int kHeadDim>() { return RunBackward<kDType, kHeadDim>(p, s); });
  if (err == cudaErrorNotSupported) {
    return absl::UnimplementedError(
        "cuda_fused: the pinned backward kernel (FusedBackwardParams::kernel) cannot run on this "
        "device, build or problem");
  }
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cuda_fused: backward launch failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace attn::cuda
