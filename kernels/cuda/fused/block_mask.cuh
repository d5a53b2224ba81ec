// A query block's view of the attention mask, shared by both fused kernels: which K tiles any
// of its rows can see, which of those need per-element masking, and each row's visible keys.
// Rows are monotone in both window edges, so the block's first and last rows bound the rest.
#pragma once

#include <cmath>

#include "cuda/fused/fused_forward.h"
#include "cuda/fused/sequence.cuh"

namespace attn::cuda {

struct RowKeys {
  int begin;  // first visible key
  int end;    // one past the last; end <= begin: none
};

template <int kBlockN>
struct BlockMask {
  int shift;          // seqlen_k - seqlen_q: bottom-right alignment of query rows
  int first_row_pos;  // key position of the block's first and last (valid) rows
  int last_row_pos;
  int window_left, window_right, seqlen_k;
  int n_block_min, n_block_max;  // K tiles [min, max) hold every key a row can see

  __device__ __forceinline__ BlockMask(const FusedForwardParams& p, const SequenceView<int>& seq,
                                       int row0, int rows_in_block)
      : shift(seq.seqlen_k - seq.seqlen_q),
        first_row_pos(row0 + shift),
        last_row_pos(row0 + rows_in_block - 1 + shift),
        window_left(p.window_left),
        window_right(p.window_right),
        seqlen_k(seq.seqlen_k) {
    const int key_begin = window_left < 0 ? 0 : max(0, first_row_pos - window_left);
    const int key_end =
        window_right < 0 ? seqlen_k : min(seqlen_k, last_row_pos + window_right + 1);
    n_block_min = key_begin / kBlockN;
    n_block_max = key_end > key_begin ? (key_end + kBlockN - 1) / kBlockN : n_block_min;
  }

  // True unless every row of the block sees every key of the tile starting at key0: the
  // sequence tail, and tiles crossing the last row's left edge or the first row's right edge.
  __device__ __forceinline__ bool TileNeedsMask(int key0) const {
    return key0 + kBlockN > seqlen_k || (window_left >= 0 && key0 < last_row_pos - window_left) ||
           (window_right >= 0 && key0 + kBlockN > first_row_pos + window_right + 1);
  }

  // Keys visible to the query row at key position `pos` (row + shift).
  __device__ __forceinline__ RowKeys Row(int pos) const {
    return {window_left < 0 ? 0 : pos - window_left,
            window_right < 0 ? seqlen_k : min(seqlen_k, pos + window_right + 1)};
  }

  // Sets to -inf the scores a thread holds in MMA accumulator layout (kNTiles 8-key column
  // tiles from key0; rows at key positions row_pos and row_pos + 8, keys quad_col * 2 and + 1
  // of each column tile) that their rows cannot see.
  template <int kNTiles>
  __device__ __forceinline__ void Apply(float (&s)[kNTiles][4], int key0, int row_pos,
                                        int quad_col) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const RowKeys keys = Row(row_pos + half * 8);
#pragma unroll
      for (int nj = 0; nj < kNTiles; ++nj)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          const int key = key0 + nj * 8 + quad_col * 2 + (e & 1);
          if (key < keys.begin || key >= keys.end) s[nj][e] = -INFINITY;
        }
    }
  }
};

}  // namespace attn::cuda
