// The CPU ops' GEMM: C = alpha * op(A) op(B) + beta * C in float32 over matrices of any storage
// dtype. Both operands are first packed into float32 row-major [M, K] and [K, N] (converting and
// transposing once, O(MK + KN)). Work items are panels of 64 C rows with float32 accumulators;
// within a panel the K loop runs in slices of B small enough for L2, and each slice passes over
// the panel four rows at a time, every B element loaded once and used by four multiply-adds.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/thread_pool.h"
#include "layers/layer_ops.h"

namespace attn::layers {

class CpuGemm {
 public:
  explicit CpuGemm(cpu::ThreadPool* pool) : pool_(pool) {}

  // Shapes must already agree (CpuLayerOps checks them).
  void Run(bool transpose_a, bool transpose_b, float alpha, ConstMatrix a, ConstMatrix b,
           float beta, Matrix c);

 private:
  cpu::ThreadPool* const pool_;
  std::vector<float> a_, b_;             // packed operands, reused across calls
  std::vector<std::vector<float>> acc_;  // per worker: one panel's accumulators
};

// dst [rows, cols] = op(src) as float32: src is [rows, cols] row-major, or [cols, rows] when
// `transpose`.
void PackAsFloat(const void* src, DType dtype, bool transpose, int64_t rows, int64_t cols,
                 float* dst);

}  // namespace attn::layers
