#include "layers/cpu_gemm.h"

#include <algorithm>
#include <cstring>

namespace attn::layers {
namespace {

constexpr int kRows = 4;            // C rows per block: each B element feeds four FMAs
constexpr int64_t kPanelRows = 64;  // C rows per work item, their accumulators kept together
constexpr int64_t kDepth = 256;     // K slice: 256 rows of B (N <= 512: at most 512 KiB)
constexpr int64_t kMinFlopsPerThread = int64_t{1} << 20;  // below, threads cost more than they save

void ToFloat(const void* src, DType dtype, int64_t offset, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
      return;
    case DType::kF16:
      HalfToFloatRow(static_cast<const uint16_t*>(src) + offset, dst, n);
      return;
    case DType::kBF16: {
      const uint16_t* in = static_cast<const uint16_t*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = BF16ToFloat(in[i]);
      return;
    }
  }
}

// Rows [r0, r0 + rows) of C += A B over the K slice [k0, k1): acc holds the block's rows.
void BlockProduct(const float* __restrict a, const float* __restrict b, int64_t k_total, int64_t n,
                  int rows, int64_t k0, int64_t k1, float* __restrict acc) {
  float* __restrict c0 = acc;
  float* __restrict c1 = acc + n;
  float* __restrict c2 = acc + 2 * n;
  float* __restrict c3 = acc + 3 * n;
  if (rows == kRows) {
    for (int64_t k = k0; k < k1; ++k) {
      const float* __restrict bk = b + k * n;
      const float a0 = a[k], a1 = a[k_total + k], a2 = a[2 * k_total + k], a3 = a[3 * k_total + k];
      for (int64_t j = 0; j < n; ++j) {
        const float bj = bk[j];
        c0[j] += a0 * bj;
        c1[j] += a1 * bj;
        c2[j] += a2 * bj;
        c3[j] += a3 * bj;
      }
    }
    return;
  }
  for (int r = 0; r < rows; ++r) {
    float* __restrict c = acc + r * n;
    const float* __restrict ar = a + r * k_total;
    for (int64_t k = k0; k < k1; ++k) {
      const float* __restrict bk = b + k * n;
      const float x = ar[k];
      for (int64_t j = 0; j < n; ++j) c[j] += x * bk[j];
    }
  }
}

}  // namespace

void PackAsFloat(const void* src, DType dtype, bool transpose, int64_t rows, int64_t cols,
                 float* dst) {
  if (!transpose) {
    ToFloat(src, dtype, 0, rows * cols, dst);
    return;
  }
  // src is [cols, rows]: convert one source row (a column of dst) at a time.
  std::vector<float> line(rows);
  for (int64_t c = 0; c < cols; ++c) {
    ToFloat(src, dtype, c * rows, rows, line.data());
    for (int64_t r = 0; r < rows; ++r) dst[r * cols + c] = line[r];
  }
}

void CpuGemm::Run(bool transpose_a, bool transpose_b, float alpha, ConstMatrix a, ConstMatrix b,
                  float beta, Matrix c) {
  const int64_t m = c.rows, n = c.cols, k = transpose_a ? a.rows : a.cols;
  a_.resize(m * k);
  b_.resize(k * n);
  PackAsFloat(a.data, a.dtype, transpose_a, m, k, a_.data());
  PackAsFloat(b.data, b.dtype, transpose_b, k, n, b_.data());

  const int64_t panels = (m + kPanelRows - 1) / kPanelRows;
  const bool threaded = 2 * m * n * k >= 2 * kMinFlopsPerThread && panels > 1;
  if (static_cast<int>(acc_.size()) < pool_->num_workers()) acc_.resize(pool_->num_workers());
  auto run_panel = [&](int worker, int64_t panel) {
    const int64_t p0 = panel * kPanelRows;
    const int64_t panel_rows = std::min<int64_t>(kPanelRows, m - p0);
    std::vector<float>& acc = acc_[worker];
    acc.assign(panel_rows * n, 0.f);
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
      const int64_t k1 = std::min(k, k0 + kDepth);
      for (int64_t r = 0; r < panel_rows; r += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, panel_rows - r));
        BlockProduct(a_.data() + (p0 + r) * k, b_.data(), k, n, rows, k0, k1, acc.data() + r * n);
      }
    }
    for (int64_t r = 0; r < panel_rows; ++r) {
      const float* row = acc.data() + r * n;
      const int64_t at = (p0 + r) * n;
      if (c.dtype == DType::kF32) {
        float* out = static_cast<float*>(c.data) + at;
        if (beta == 0.f) {
          for (int64_t j = 0; j < n; ++j) out[j] = alpha * row[j];
        } else {
          for (int64_t j = 0; j < n; ++j) out[j] = alpha * row[j] + beta * out[j];
        }
      } else {
        for (int64_t j = 0; j < n; ++j) StoreFromFloat(c.data, c.dtype, at + j, alpha * row[j]);
      }
    }
  };
  if (threaded) {
    pool_->ParallelFor(panels, run_panel);
  } else {
    for (int64_t panel = 0; panel < panels; ++panel) run_panel(0, panel);
  }
}

}  // namespace attn::layers
