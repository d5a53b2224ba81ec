// Launch API of the fused forward over K/V in pages (attn/paged_kv.h): KV sessions' prefill and
// decode steps. Host-only header.
//
// Two kernels read K/V through the block table:
//   - decode (paged_decode_kernel.cuh), for calls with few query rows per sequence: one CTA per
//     (16 packed query rows, KV head, split, sequence), the rows being the query heads of a GQA
//     group times the query tokens, so a page is read once per group; long contexts split
//     across CTAs (split-KV), each writing a float32 partial O and its LSE, which the last of a
//     tile's splits to finish merges by the online-softmax rule (paged_combine.cuh);
//   - prefill, one CTA per (128 query rows, head, sequence) as the dense forward: on Hopper the
//     warp-specialised kernel (fused_forward_sm90_tma_kernel.cuh) with the paged K/V source of
//     paged_tma_source.cuh, where it applies (pages of at least 8 tokens, tensors the copy engine
//     can address); else the lockstep wgmma kernel (paged_prefill_sm90_kernel.cuh) at head_dim
//     64 and 128, and the portable one (paged_prefill_kernel.cuh), both gathering their K/V
//     tiles from pages with cp.async. FusedForwardParams::kernel pins one of them.
// PlanPagedForward picks the kernel and the split count (heuristics.h); the caller leases the
// workspace the plan asks for and launches.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "attn/paged_kv.h"
#include "attn/problem.h"
#include "cuda/fused/fused_forward.h"

namespace attn::cuda {

enum class PagedKernel : uint8_t { kAuto, kDecode, kPrefill };

// What tests and benchmarks may force instead of the heuristics.
struct PagedOverrides {
  PagedKernel kernel = PagedKernel::kAuto;
  int decode_splits = 0;  // > 0: this many splits for the decode kernel
};

// The device facts the plan reads (cudaDeviceGetAttribute).
struct PagedDevice {
  int multiprocessors = 132;
  int shared_memory_per_sm = 228 << 10;  // bytes
};

struct PagedForwardPlan {
  PagedKernel kernel = PagedKernel::kDecode;  // never kAuto
  int m_blocks = 1;         // decode: 16-row tiles of packed query rows per (sequence, KV head)
  int num_splits = 1;       // decode: CTAs per (row tile, KV head, sequence)
  int tiles_per_split = 0;  // decode: key stages each split walks
  // Device workspace: the partial O [num_splits, total_q * num_heads, head_dim] and LSE
  // [num_splits, total_q * num_heads], float32; none with one split.
  int64_t workspace_bytes = 0;
  // With several splits: int32 counters, one per (sequence, KV head, row tile), zero before the
  // launch; the kernel leaves them zero.
  int64_t split_counters = 0;
};

// The kernel, its grid and its workspace for a (valid, covered) problem.
PagedForwardPlan PlanPagedForward(const AttentionProblem& p, const PagedDevice& device,
                                  const PagedOverrides& overrides = {});

// The forward's params (Q, O, the LSE, the sequences, heads, scale and mask) and the pages.
// k and v are the pool (v = k), k/v_token_stride = num_kv_heads * head_dim and k/v_head_stride =
// head_dim (the layout inside a page's block).
struct PagedForwardParams : FusedForwardParams {
  const int32_t* block_table = nullptr;  // [batch, max_blocks]
  int max_blocks = 0;
  int64_t page_stride = 0;  // elements
  int64_t num_pages = 0;    // pages in the pool: the TMA prefill's bounds (0: it does not run)
  int page_shift = 0;       // log2(page_tokens)
  int64_t v_offset = 0;     // elements from a page's K block to its V block
  PagedForwardPlan plan;
  float* o_partial = nullptr;  // the plan's workspace, when it has one
  float* lse_partial = nullptr;
  int* split_counters = nullptr;  // plan.split_counters of them
};

// Checks alignment (16-byte rows and pages) and launches the plan's kernels on `stream`;
// UNIMPLEMENTED where a pinned prefill kernel (FusedForwardParams::kernel) cannot run.
absl::Status LaunchPagedForward(const PagedForwardParams& params, void* stream);

}  // namespace attn::cuda
