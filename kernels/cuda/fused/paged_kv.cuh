// Where a sequence's key rows live in the page pool (attn/paged_kv.h), for the paged kernels:
// key t of KV head h is row t % page_tokens of the page block_table[t / page_tokens], in that
// page's K block, and v_offset elements further in its V block.
#pragma once

#include <cstdint>

#include "cuda/fused/paged_forward.h"
#include "cuda/fused/ptx.cuh"

namespace attn::cuda {

// The shift of a power of two (a page's tokens, a tile's keys): page_shift's unit.
__host__ __device__ constexpr int Log2(int power_of_two) {
  int shift = 0;
  while ((1 << shift) < power_of_two) ++shift;
  return shift;
}

template <typename Element>
struct PageWalk {
  const Element* pages;  // the pool, advanced to this KV head's columns
  const int32_t* table;  // this sequence's block table row
  int64_t page_stride;
  int64_t token_stride;
  int shift;
  int mask;

  __device__ __forceinline__ PageWalk(const PagedForwardParams& p, int b, int kv_head)
      : pages(static_cast<const Element*>(p.k) + kv_head * p.k_head_stride),
        table(p.block_table + static_cast<int64_t>(b) * p.max_blocks),
        page_stride(p.page_stride),
        token_stride(p.k_token_stride),
        shift(p.page_shift),
        mask((1 << p.page_shift) - 1) {}

  // Key `key`'s row in the K block of its page (the V row is v_offset elements on).
  __device__ __forceinline__ const Element* KeyRow(int key) const {
    return pages + static_cast<int64_t>(__ldg(table + (key >> shift))) * page_stride +
           static_cast<int64_t>(key & mask) * token_stride;
  }
};

// Copies key rows [key0, key0 + kTileRows) of one block of the pages (K: block_offset 0, V:
// v_offset) into a padded shared tile with 16-byte asynchronous copies, rows past `rows`
// zero-filled (their pages are never read). kOnePage: the tile lies in one page (page_tokens >=
// kTileRows), found with one block-table read; otherwise each row finds its own page.
template <bool kOnePage, int kTileRows, int kHeadDim, int kRowPitch, int kThreads, typename Element>
__device__ __forceinline__ void LoadPagedTileAsync(Element* tile, const PageWalk<Element>& walk,
                                                   int64_t block_offset, int key0, int rows) {
  constexpr int kChunksPerRow = kHeadDim * static_cast<int>(sizeof(Element)) / 16;
  constexpr int kElemsPerChunk = 16 / sizeof(Element);
  constexpr int kChunks = kTileRows * kChunksPerRow;
  const Element* base = walk.pages;
  if (kOnePage && rows > 0) base = walk.KeyRow(key0) + block_offset;
#pragma unroll
  for (int c = threadIdx.x; c < kChunks; c += kThreads) {
    const int row = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * kElemsPerChunk;
    const bool valid = row < rows;
    const Element* from = walk.pages;
    if (valid) {
      from = (kOnePage ? base + row * walk.token_stride : walk.KeyRow(key0 + row) + block_offset) +
             col;
    }
    ptx::CopyAsync16(ptx::SharedAddress(tile + row * kRowPitch + col), from, valid);
  }
}

}  // namespace attn::cuda
