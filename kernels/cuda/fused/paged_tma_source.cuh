// The paged K/V source of the warp-specialised Hopper kernel (fused_forward_sm90_tma_kernel.cuh):
// the paged prefill is that kernel, consumers unchanged, with its producer reading K and V rows
// from the page pool through the block table (attn/paged_kv.h).
//
// The pool's K blocks, and its V blocks, are each one tensor map in (column, token in page,
// KV head, page) coordinates (EncodePagedKvTensorMaps). A stage of kBlockN keys is `pieces`
// boxes of `box rows` = min(page_tokens, kBlockN) rows per 64-column block: kBlockN is a power
// of two (Sm90TmaPagedTileShape), so a tile is a piece of one page (page_tokens >= kBlockN) or
// kBlockN / page_tokens whole pages. Piece i lands at row i * box rows of the stage; a box of a
// multiple of 8 rows keeps every piece on a 1024-byte boundary, where the copy engine's 128-byte
// swizzle continues the stage's pattern (rows XOR-ed by row % 8) unbroken, so the consumers read
// the stage as if one box had filled it. Pages of fewer than 8 tokens run the other kernels.
//
// The lanes of the producer warp look the tile's pages up together (lane i: piece i, one round
// trip a tile) and lane 0 issues the copies. Pieces whose first key is past the sequence's end
// are never looked up: their table slots may hold anything. The tile that holds the sequence's
// last key is the only one with rows past the end:
//   - K: the pieces holding keys are copied whole (the page rows past the last key are the
//     page's, never another page's) and the pieces past the end are not copied at all; what the
//     stage holds there is never used, since those keys' scores are masked to -inf
//     (BlockMask::TileNeedsMask is true for that tile) whatever they were, NaN included;
//   - V: P is 0 for those keys, but 0 times a NaN or infinity left in a page (or in the stage) is
//     NaN, so the rows must be zeros. The whole pieces before the last key are copied by TMA; the
//     rest, from the first row of the piece holding the last key, the warp copies with 16-byte
//     cp.async, rows past the end zero-filled, waits for, and fences for the async proxy that
//     wgmma reads through, before lane 0 makes the one arrival on the stage's `full` barrier
//     (the TMA bytes announced beforehand with expect_tx).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/fused/fused_forward_sm90_tma_kernel.cuh"
#include "cuda/fused/paged_forward.h"
#include "cuda/fused/paged_kv.cuh"
#include "cuda/fused/ptx.cuh"
#include "cuda/fused/query_block.cuh"
#include "cuda/fused/tma.cuh"
#include "cuda/fused/wgmma.cuh"

namespace attn::cuda {

// The smallest page the paged source takes: a box of 8 rows of 128 bytes is one 1024-byte
// swizzle atom.
inline constexpr int kPagedTmaMinPageTokens = 8;

// The paged prefill's parameter block: the paged params and the tensor maps of Q (as the dense
// kernel's) and of the pool's K and V blocks.
struct PagedForwardTmaParams {
  PagedForwardParams p;
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
};

namespace sm90_tma {

template <typename Traits>
struct PagedKvTiles {
  using Params = PagedForwardTmaParams;
  using Element = typename Traits::Element;
  static constexpr int kProducerThreads = 32;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kBoxBytes = 128;  // one row of a 64-column block
  static constexpr int kChunksPerRow = Traits::kTileColumns / 8;
  static constexpr int kBlockShift = Log2(kBlockN);
  static_assert(1 << kBlockShift == kBlockN, "a tile is one page's piece or whole pages");
  static_assert(kBlockN / kPagedTmaMinPageTokens <= 32, "a lane looks up each piece's page");

  const Params& params;
  QueryTileAt q;
  const int32_t* table;  // this sequence's block-table row
  int kv_head;
  int seqlen_k;
  int box_shift;  // log2 of the rows of a box: min(page_tokens, kBlockN)
  int lane;

  __device__ __forceinline__ PagedKvTiles(const Params& params,
                                          const QueryBlock<Traits::kBlockM>& block)
      : params(params),
        q(QueryTileOf(params.p, block)),
        table(params.p.block_table + static_cast<int64_t>(block.batch) * params.p.max_blocks),
        kv_head(block.kv_head(params.p)),
        seqlen_k(block.seq.seqlen_k),
        box_shift(min(params.p.page_shift, kBlockShift)),
        lane(threadIdx.x % 32) {}

  __device__ __forceinline__ void LoadKeys(uint32_t tile, uint32_t full, int key0) const {
    const int used = PiecesWithKeys(key0);
    const int page = PageOfLanePiece(key0, used);
    if (lane == 0) tma::ArriveExpectBytes(full, used * PieceBytes());
    CopyPieces(&params.k_map, tile, full, key0, page, used);
  }

  __device__ __forceinline__ void LoadValues(uint32_t tile, uint32_t full, int key0) const {
    const int used = PiecesWithKeys(key0);
    const int page = PageOfLanePiece(key0, used);
    const int whole = min(kBlockN >> box_shift, (seqlen_k - key0) >> box_shift);
    if (whole == kBlockN >> box_shift) {
      if (lane == 0) tma::ArriveExpectBytes(full, whole * PieceBytes());
      CopyPieces(&params.v_map, tile, full, key0, page, whole);
      return;
    }
    // The sequence ends in this tile: whole pieces by TMA, the rest by the warp.
    if (lane == 0 && whole > 0) tma::ExpectBytes(full, whole * PieceBytes());
    CopyPieces(&params.v_map, tile, full, key0, page, whole);
    // The page of piece `whole`, which holds the last keys unless the sequence ends on a
    // piece's edge (then every row from there is past the end and the page is not read).
    const int last_page = __shfl_sync(0xffffffffu, page, whole);
    CopyTailRows(tile, key0, whole << box_shift, last_page);
    ptx::CommitAsyncGroup();
    ptx::WaitAsyncGroups<0>();
    wgmma::FenceSharedForAsyncProxy();  // cp.async wrote rows that wgmma reads
    __syncwarp();
    if (lane == 0) tma::Arrive(full);
  }

 private:
  __device__ __forceinline__ uint32_t PieceBytes() const {
    return static_cast<uint32_t>(Traits::kColumnBlocks * kBoxBytes) << box_shift;
  }

  // Pieces of the tile at key0 whose first key is inside the sequence (key0 < seqlen_k always:
  // the tiles a CTA walks hold visible keys).
  __device__ __forceinline__ int PiecesWithKeys(int key0) const {
    const int rows = (1 << box_shift) - 1;
    return min(kBlockN >> box_shift, (seqlen_k - key0 + rows) >> box_shift);
  }

  // Lane i's share of the lookups: the page of piece i, for the first `used` pieces.
  __device__ __forceinline__ int PageOfLanePiece(int key0, int used) const {
    if (lane >= used) return 0;
    return __ldg(table + ((key0 + (lane << box_shift)) >> params.p.page_shift));
  }

  // Pieces [0, count) of the tile, lane 0 issuing; every lane takes part in the shuffles.
  __device__ __forceinline__ void CopyPieces(const CUtensorMap* map, uint32_t tile, uint32_t full,
                                             int key0, int page, int count) const {
    const int row_mask = (1 << params.p.page_shift) - 1;
    for (int i = 0; i < count; ++i) {
      const int piece_page = __shfl_sync(0xffffffffu, page, i);
      if (lane == 0) {
        const int row = (key0 + (i << box_shift)) & row_mask;
        const uint32_t at = tile + static_cast<uint32_t>((i << box_shift) * kBoxBytes);
#pragma unroll
        for (int cb = 0; cb < Traits::kColumnBlocks; ++cb) {
          tma::Load4d(at + cb * kBlockN * kBoxBytes, map, full, cb * 64, row, kv_head, piece_page);
        }
      }
    }
  }

  // V rows [row0, kBlockN) of the tile at key0 into the swizzled stage with 16-byte cp.async:
  // the rows of keys inside the sequence (all in page `page`) from the pool, columns past
  // head_dim and rows past the sequence as zeros (nothing read).
  __device__ __forceinline__ void CopyTailRows(uint32_t tile, int key0, int row0, int page) const {
    const PagedForwardParams& p = params.p;
    const Element* pool = static_cast<const Element*>(p.v);
    const Element* rows = pool + p.v_offset + static_cast<int64_t>(page) * p.page_stride +
                          static_cast<int64_t>(kv_head) * p.k_head_stride;
    const int row_mask = (1 << p.page_shift) - 1;
    const int chunks = (kBlockN - row0) * kChunksPerRow;
#pragma unroll 1
    for (int c = lane; c < chunks; c += 32) {
      const int row = row0 + c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      const bool valid = key0 + row < seqlen_k && col < Traits::kHeadDim;
      const Element* from =
          valid ? rows + static_cast<int64_t>((key0 + row) & row_mask) * p.k_token_stride + col
                : pool;
      ptx::CopyAsync16(tile + wgmma::SwizzledByteOffset(row, col, kBlockN), from, valid);
    }
  }
};

}  // namespace sm90_tma
}  // namespace attn::cuda
