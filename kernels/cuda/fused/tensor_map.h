// Tensor maps (the copy engine's descriptors of a global tensor and its tile) for the fused
// kernels' [tokens, heads, head_dim] tensors, made on the host. The encoder is the driver's
// cuTensorMapEncodeTiled, reached through the runtime, so nothing links libcuda directly.
#pragma once

#include <cuda.h>  // CUtensorMap: a type only; no driver call is linked
#include <cuda_runtime_api.h>

#include <cstdint>

#include "attn/dtype.h"
#include "cuda/fused/fused_forward.h"
#include "cuda/fused/paged_forward.h"

namespace attn::cuda {

// A [tokens, heads, head_dim] tensor of 16-bit elements (or float32: the backward's dQ
// accumulator) seen in four dimensions, innermost first: (head_dim, rows, heads, sequences). A
// uniform batch is `sequences` blocks of `rows` tokens `sequence_stride` elements apart, so that
// the rows past a sequence's end read as zeros; a variable-length batch is one sequence of all its
// tokens.
struct TokenTensorView {
  const void* data = nullptr;
  DType dtype = DType::kBF16;
  bool e4m3 = false;  // one-byte e4m3 elements (the FP8 forward's, fp8_forward.h); dtype unread
  int head_dim = 0;
  int64_t rows = 0;
  int heads = 0;
  int sequences = 1;
  int64_t token_stride = 0;     // elements
  int64_t head_stride = 0;      // elements
  int64_t sequence_stride = 0;  // elements; read only when sequences > 1
};

// The view of one of `p`'s [tokens, heads, head_dim] tensors: a dense batch as p.batch
// sequences of `seqlen` rows, a variable-length one as one sequence of its `total` rows (one row
// at least: a map needs one, and a problem without keys never reads it).
TokenTensorView BatchTensorView(const FusedForwardParams& p, const void* data, int head_dim,
                                int64_t seqlen, int64_t total, int heads, int64_t token_stride,
                                int64_t head_stride);

// The map of `p`'s Q, boxes of `box_rows` rows, through BatchTensorView and
// EncodeTokenTensorMap.
cudaError_t EncodeQTensorMap(const FusedForwardParams& p, int head_dim, int box_rows,
                             CUtensorMap* q_map);

// The map of `p`'s O (16-bit, the dtype's), boxes of `box_rows` rows, the same way: what the
// warp-specialised forward's copy-engine epilogue stores through.
cudaError_t EncodeOTensorMap(const FusedForwardParams& p, int head_dim, int box_rows,
                             CUtensorMap* o_map);

// The maps of `p`'s Q (boxes of `q_box_rows` rows) and K and V (`kv_box_rows`), each through
// BatchTensorView and EncodeTokenTensorMap: the first error, or cudaSuccess.
cudaError_t EncodeQkvTensorMaps(const FusedForwardParams& p, int head_dim, int q_box_rows,
                                int kv_box_rows, CUtensorMap* q_map, CUtensorMap* k_map,
                                CUtensorMap* v_map);

// The page pool's K blocks and its V blocks (attn/paged_kv.h: pages p.page_stride elements
// apart from p.k, a page's V block p.v_offset elements after its K block) as two maps through
// EncodeTokenTensorMap, in (head_dim, token in page, KV head, page) coordinates: a view of
// page_tokens rows, num_kv_heads heads and num_pages sequences. Boxes of `box_rows` tokens of
// one page; pages at or past num_pages read as zeros. cudaErrorNotSupported as
// EncodeTokenTensorMap, and for a pool of no pages or of 2^31 pages or more.
cudaError_t EncodePagedKvTensorMaps(const PagedForwardParams& p, int box_rows, CUtensorMap* k_map,
                                    CUtensorMap* v_map);

// Encodes the map of `view` with boxes of 128 bytes of columns (the 128-byte swizzle's span: 64
// 16-bit elements, 32 float32, 128 e4m3) by `box_rows` rows of one head of one sequence, stored
// 128-byte swizzled; elements outside the tensor arrive as zeros (and a reduction into them is
// dropped), columns past a head_dim that is not a multiple of the box (96) as well.
// cudaErrorNotSupported when the driver has no encoder or the view breaks the copy engine's
// rules (addresses and strides in whole 16 bytes, sizes up to 2^32) or a row of head_dim is not
// whole 16-byte chunks.
cudaError_t EncodeTokenTensorMap(const TokenTensorView& view, int box_rows, CUtensorMap* map);

}  // namespace attn::cuda
