// An observer of the CPU tiled forward's online-softmax update, step by step: what
// `attnserve_client explain` prints. The update functions of tiled_forward.cc take a TileTrace
// pointer that is null in every normal run (a branch per row and tile, never taken, is all it
// costs there); TracedForwardBlock runs one query block through the same functions with a trace
// attached, so what a trace sees is the engine's own arithmetic, not a copy of it.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "attn/problem.h"
#include "attn/tensor.h"

namespace attn::cpu {

// Callbacks in the order the update makes them. For each K/V tile the block visits: BeginTile;
// then, for each row that sees some key of the tile, Scores and Probabilities; then EndTile.
// Rows are relative to the block, columns to the tile. Pointers are valid during the call only.
class TileTrace {
 public:
  virtual ~TileTrace() = default;

  // Keys [key0, key0 + cols) of the sequence are loaded. `masked`: some row of the block does
  // not see all of them, and the masked update (ForwardTile) runs instead of the full-tile one.
  virtual void BeginTile(int64_t key0, int cols, bool masked) = 0;

  // Row `row`'s scores S = scale * q K^T over the columns [begin, end) it sees (s[begin..end);
  // the other columns are masked), their maximum, and the update's scalars: the running max m
  // before this tile, m_new = max(m, row_max) and alpha = exp(m - m_new). Called before P
  // overwrites S.
  virtual void Scores(int row, const float* s, int begin, int end, float row_max, float m,
                      float m_new, float alpha) = 0;

  // The same row's P = exp(S - m_new) over the same columns (p[begin..end)).
  virtual void Probabilities(int row, const float* p, int begin, int end) = 0;

  // The block's row state after the tile: m[rows], l[rows] and acc[rows][d] (unnormalised O).
  virtual void EndTile(int rows, int d, const float* m, const float* l, const float* acc) = 0;
};

// Runs the tiled forward for the query rows [row0, row0 + rows) of sequence `b` at query head
// `head` as one block (rows in [1, kBlockQ]), over K/V tiles of `kv_tile` keys (in [1, kBlockK];
// the engine's own runs use kBlockK), telling `trace` every step. Writes O and, when a.lse is
// set, the LSE of those rows only. Validates the problem, the views and the block.
absl::Status TracedForwardBlock(const AttentionProblem& p, const ForwardArgs& a, int b,
                                int64_t row0, int rows, int head, int kv_tile, TileTrace& trace);

}  // namespace attn::cpu
