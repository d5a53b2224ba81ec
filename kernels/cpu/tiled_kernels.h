// The passes of the CPU tiled engine. Callers validate the problem and views first.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/paged_kv.h"
#include "attn/problem.h"
#include "attn/tensor.h"
#include "cpu/thread_pool.h"

namespace attn::cpu {

// A block of consecutive rows (query or key tokens) of one sequence.
struct RowBlock {
  int b;         // sequence
  int64_t row0;  // first row, relative to the sequence start
  int rows;      // 1 .. block size
};

// Splits every sequence's rows into blocks of `block` rows (the last one may be shorter).
std::vector<RowBlock> SplitRows(const std::vector<int32_t>& cu_seqlens, int block);

// O (and the LSE when a.lse is set) by IO-aware tiling with online softmax.
void TiledForward(const AttentionProblem& p, const ForwardArgs& a, ThreadPool& pool);
// The same with K and V read through a block table (attn/paged_kv.h).
void TiledForwardPaged(const AttentionProblem& p, const PagedForwardArgs& a, ThreadPool& pool);

// dQ, dK, dV by recomputing P tile by tile from the forward LSE.
void TiledBackward(const AttentionProblem& p, const BackwardArgs& a, ThreadPool& pool);

}  // namespace attn::cpu
