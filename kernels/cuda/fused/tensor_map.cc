#include "cuda/fused/tensor_map.h"

#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace attn::cuda {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 Encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

bool ValidStride(int64_t bytes) {
  return bytes > 0 && bytes % 16 == 0 && bytes < (int64_t{1} << 40);
}

}  // namespace

TokenTensorView BatchTensorView(const FusedForwardParams& p, const void* data, int head_dim,
                                int64_t seqlen, int64_t total, int heads, int64_t token_stride,
                                int64_t head_stride) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  TokenTensorView v;
  v.data = data;
  v.dtype = p.dtype;
  v.head_dim = head_dim;
  v.rows = std::max<int64_t>(1, varlen ? total : seqlen);
  v.heads = heads;
  v.sequences = varlen ? 1 : p.batch;
  v.token_stride = token_stride;
  v.head_stride = head_stride;
  v.sequence_stride = seqlen * token_stride;
  return v;
}

cudaError_t EncodeTokenTensorMap(const TokenTensorView& view, int box_rows, CUtensorMap* map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = Encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const bool f32 = !view.e4m3 && view.dtype == DType::kF32;
  const int64_t kElementBytes = view.e4m3 ? 1 : f32 ? 4 : 2;
  // A single sequence never steps by its stride; any valid value stands in.
  const int64_t sequence_bytes =
      (view.sequences > 1 ? view.sequence_stride : view.token_stride) * kElementBytes;
  const int64_t token_bytes = view.token_stride * kElementBytes;
  // One head: the head stride is never stepped either.
  const int64_t head_bytes =
      (view.heads > 1 ? view.head_stride : view.token_stride) * kElementBytes;
  if (reinterpret_cast<uintptr_t>(view.data) % 16 != 0 || !ValidStride(token_bytes) ||
      !ValidStride(head_bytes) || !ValidStride(sequence_bytes) || view.rows <= 0 ||
      view.rows > (int64_t{1} << 31) - 1 || view.head_dim <= 0 ||
      view.head_dim * kElementBytes % 16 != 0 || box_rows <= 0 || box_rows > 256) {
    return cudaErrorNotSupported;
  }
  const cuuint64_t dims[4] = {
      static_cast<cuuint64_t>(view.head_dim), static_cast<cuuint64_t>(view.rows),
      static_cast<cuuint64_t>(view.heads), static_cast<cuuint64_t>(view.sequences)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(token_bytes),
                                 static_cast<cuuint64_t>(head_bytes),
                                 static_cast<cuuint64_t>(sequence_bytes)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(128 / kElementBytes),
                             static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  // The copy engine moves e4m3 as plain bytes.
  const CUtensorMapDataType type = view.e4m3                   ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : f32                       ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : view.dtype == DType::kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                               : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult result =
      encode(map, type, 4, const_cast<void*>(view.data), dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorNotSupported;
}

cudaError_t EncodeQTensorMap(const FusedForwardParams& p, int head_dim, int box_rows,
                             CUtensorMap* q_map) {
  return EncodeTokenTensorMap(BatchTensorView(p, p.q, head_dim, p.seqlen_q, p.total_q, p.num_heads,
                                              p.q_token_stride, p.q_head_stride),
                              box_rows, q_map);
}

cudaError_t EncodeOTensorMap(const FusedForwardParams& p, int head_dim, int box_rows,
                             CUtensorMap* o_map) {
  if (p.o == nullptr) return cudaErrorNotSupported;
  return EncodeTokenTensorMap(BatchTensorView(p, p.o, head_dim, p.seqlen_q, p.total_q, p.num_heads,
                                              p.o_token_stride, p.o_head_stride),
                              box_rows, o_map);
}

cudaError_t EncodeQkvTensorMaps(const FusedForwardParams& p, int head_dim, int q_box_rows,
                                int kv_box_rows, CUtensorMap* q_map, CUtensorMap* k_map,
                                CUtensorMap* v_map) {
  cudaError_t err = EncodeQTensorMap(p, head_dim, q_box_rows, q_map);
  if (err == cudaSuccess) {
    err = EncodeTokenTensorMap(BatchTensorView(p, p.k, head_dim, p.seqlen_k, p.total_k,
                                               p.num_kv_heads, p.k_token_stride, p.k_head_stride),
                               kv_box_rows, k_map);
  }
  if (err == cudaSuccess) {
    err = EncodeTokenTensorMap(BatchTensorView(p, p.v, head_dim, p.seqlen_k, p.total_k,
                                               p.num_kv_heads, p.v_token_stride, p.v_head_stride),
                               kv_box_rows, v_map);
  }
  return err;
}

cudaError_t EncodePagedKvTensorMaps(const PagedForwardParams& p, int box_rows, CUtensorMap* k_map,
                                    CUtensorMap* v_map) {
  if (p.num_pages <= 0 || p.num_pages > std::numeric_limits<int32_t>::max() || p.page_shift < 0 ||
      p.page_shift > 30) {
    return cudaErrorNotSupported;
  }
  TokenTensorView view;
  view.data = p.k;
  view.dtype = p.dtype;
  view.head_dim = p.head_dim;
  view.rows = int64_t{1} << p.page_shift;
  view.heads = p.num_kv_heads;
  view.sequences = static_cast<int>(p.num_pages);
  view.token_stride = p.k_token_stride;
  view.head_stride = p.k_head_stride;
  view.sequence_stride = p.page_stride;
  cudaError_t err = EncodeTokenTensorMap(view, box_rows, k_map);
  if (err == cudaSuccess) {
    constexpr int64_t kElementBytes = 2;
    view.data = static_cast<const char*>(p.v) + p.v_offset * kElementBytes;
    err = EncodeTokenTensorMap(view, box_rows, v_map);
  }
  return err;
}

}  // namespace attn::cuda
