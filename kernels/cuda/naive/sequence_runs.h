// Workspace layout helpers shared by the naive forward and backward: alignment, and the runs
// of consecutive sequences with equal lengths that one batched cuBLAS call can cover.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/problem.h"
#include "cuda/naive/naive_kernels.h"

namespace attn::cuda::naive {

inline constexpr int64_t kAlign = 256;             // bytes; every workspace region starts aligned
inline constexpr int64_t kMatrixAlignFloats = 64;  // score matrices start 256-byte aligned
// Device memory left to cuBLAS and everything else when sizing the workspace from free memory.
inline constexpr int64_t kDeviceHeadroom = int64_t{256} << 20;

inline int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Consecutive sequences with the same query and key lengths.
struct SequenceRun {
  int first_sequence;
  int sequences;
  int64_t lq, lk;
};

inline std::vector<SequenceRun> SplitRuns(const AttentionProblem& p) {
  std::vector<SequenceRun> runs;
  for (int b = 0; b < p.batch(); ++b) {
    const int64_t lq = p.seqlen_q(b), lk = p.seqlen_k(b);
    if (!runs.empty() && runs.back().lq == lq && runs.back().lk == lk) {
      ++runs.back().sequences;
    } else {
      runs.push_back({b, 1, lq, lk});
    }
  }
  return runs;
}

// Floats of one (sequence, head) score matrix, padded to keep the next one aligned.
inline int64_t MatrixFloats(const SequenceRun& r) {
  return RoundUp(r.lq * r.lk, kMatrixAlignFloats);
}

// The chunk geometry of a run, with its score matrices at `scores`; each chunk then sets m0 and
// count.
inline ChunkGeometry RunGeometry(const AttentionProblem& p, const SequenceRun& run, float* scores) {
  ChunkGeometry g;
  g.lq = run.lq;
  g.lk = run.lk;
  g.num_heads = p.num_heads;
  g.group_size = p.group_size();
  g.q_begin = p.cu_seqlens_q[run.first_sequence];
  g.k_begin = p.cu_seqlens_k[run.first_sequence];
  g.s = scores;
  g.s_matrix_stride = MatrixFloats(run);
  return g;
}

}  // namespace attn::cuda::naive
