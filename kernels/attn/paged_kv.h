// Keys and values kept in fixed-size pages of one pool, as KV sessions hold them: a sequence's
// key token t lives in the page its block table names for block t / page_tokens, at row
// t % page_tokens. A page holds a block of K rows and then the block of V rows:
//
//   page p:  K [page_tokens, num_kv_heads, head_dim]  then  V [page_tokens, num_kv_heads, head_dim]
//
// starting at pages + p * page_stride (elements of the problem's dtype). The problem's
// cu_seqlens_k give each sequence's key length; the block table has max_blocks entries per
// sequence, of which the first ceil(seqlen_k(b) / page_tokens) are used. Pointers are in the
// engine's memory space.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "attn/problem.h"
#include "attn/tensor.h"

namespace attn {

struct PagedKV {
  const void* pages = nullptr;
  int64_t page_stride = 0;  // elements from one page to the next: >= 2 * page_tokens * row
  int page_tokens = 0;      // a power of two
  int64_t num_pages = 0;
  const int32_t* block_table = nullptr;  // [batch, max_blocks] page indices
  int max_blocks = 0;

  // Elements between token t and t + 1 inside a block (num_kv_heads * head_dim).
  static int64_t TokenStride(const AttentionProblem& p) {
    return int64_t{p.num_kv_heads} * p.head_dim;
  }
  // Elements from a page's K block to its V block.
  int64_t v_offset(const AttentionProblem& p) const { return page_tokens * TokenStride(p); }
};

struct PagedForwardArgs {
  TensorRef q;             // [total_q, num_heads, head_dim]
  PagedKV kv;              // the keys and values of every sequence
  MutableTensorRef o;      // [total_q, num_heads, head_dim], problem dtype
  float* lse = nullptr;    // [num_heads, total_q]; may be null
  void* stream = nullptr;  // cudaStream_t for CUDA engines
};

// ValidateProblem, the q and o views, and the page geometry (page_tokens a power of two, pages
// large enough for both blocks, enough blocks per sequence for its keys). The block table's
// entries are the caller's to keep within [0, num_pages): device memory is not read here.
absl::Status ValidatePagedForward(const AttentionProblem& p, const PagedForwardArgs& a);

}  // namespace attn
