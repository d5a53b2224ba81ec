// Backward pass of the CPU tiled engine: recomputes P from the forward LSE, tile by tile.
//
// Parallel decomposition. Work items are (key block of kBackwardKeys keys, KV head) pairs, so each
// item owns its rows of dK and dV outright: it accumulates them in float scratch over every query
// head of its GQA group and every query block that can see the key block, then stores them once. dQ
// rows, on the other hand, receive a contribution from every key block; each item sums its
// contribution for one query block in a block-sized float buffer and adds it into one shared float
// dQ accumulator ([total_q, num_heads, head_dim]) under a striped mutex. That keeps the pass at
// five block products per tile (S, dP, dV, dK, dQ) instead of the seven a separate
// query-partitioned dQ pass would cost, with O(N d) extra memory; the price is that the float
// summation order of dQ, and so its last bits, can vary from run to run. BackwardArgs::
// deterministic fixes the order instead: one item per (sequence, KV head) walks the sequence's
// key blocks in order, at the cost of parallelism (batch x KV heads items).
//
// Per tile, for query row i and the keys j it sees:
//   P_ij = exp(scale * q_i.k_j - LSE_i),  dP_ij = dO_i.v_j,  dS_ij = P_ij (dP_ij - D_i),
//   dV_j += P_ij dO_i,  dK_j += dS_ij q_i,  dQ_i += dS_ij k_j   (dK, dQ times scale at the end)
// with D_i = rowsum(dO_i * O_i) computed once beforehand.
#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "cpu/float_rows.h"
#include "cpu/micro_kernels.h"
#include "cpu/tile_config.h"
#include "cpu/tiled_kernels.h"
#include "cpu/vec_math.h"

namespace attn::cpu {
namespace {

struct BackwardScratch {
  explicit BackwardScratch(int d)
      : k(kBackwardKeys * d),
        kt(d * kBackwardKeys),
        vt(d * kBackwardKeys),
        dk(kBackwardKeys * d),
        dv(kBackwardKeys * d),
        q(kBlockQ * d),
        d_o(kBlockQ * d),
        dq(kBlockQ * d),
        lse(kBlockQ),
        dsum(kBlockQ),
        s(kBlockQ * kBlockK),
        dp(kBlockQ * kBlockK),
        row(d),
        key_begin(kBlockQ),
        key_end(kBlockQ),
        col_begin(kBlockQ),
        col_end(kBlockQ) {}
  std::vector<float> k;       // [kBackwardKeys][d]
  std::vector<float> kt, vt;  // K and V transposed tile by tile, [tile][d][kBlockK]
  std::vector<float> dk, dv;  // this key block's accumulators, [kBackwardKeys][d]
  std::vector<float> q, d_o;  // the current query block, [kBlockQ][d]
  std::vector<float> dq;      // its dQ contribution from this key block, [kBlockQ][d]
  std::vector<float> lse, dsum;
  // S then P, and dP then dS: [kBlockQ][kBlockK] (the masked path uses one row of each)
  std::vector<float> s, dp;
  std::vector<float> row;
  std::vector<int64_t> key_begin, key_end;  // each query row's visible keys, block-relative
  std::vector<int> col_begin, col_end;      // the same, relative to the current tile
};

// The tile when every query row of the block sees every key of it (no mask inside): the five
// products run as register-blocked block products over [rows][kBlockK] buffers of P and dS.
ATTN_CPU_CLONES void BackwardFullTile(int rows, int d, int cols, float scale,
                                      const float* __restrict q, const float* __restrict d_o,
                                      const float* __restrict k, const float* __restrict kt,
                                      const float* __restrict vt, const float* lse,
                                      const float* dsum, float* __restrict s, float* __restrict dp,
                                      float* __restrict dk, float* __restrict dv,
                                      float* __restrict dq) {
  int i = 0;
  for (; i + 4 <= rows; i += 4) {
    RowsTimesPanel<4>(q + i * d, d, kt, d, s + i * kBlockK);
    RowsTimesPanel<4>(d_o + i * d, d, vt, d, dp + i * kBlockK);
  }
  for (; i < rows; ++i) {
    RowsTimesPanel<1>(q + i * d, d, kt, d, s + i * kBlockK);
    RowsTimesPanel<1>(d_o + i * d, d, vt, d, dp + i * kBlockK);
  }
  for (i = 0; i < rows; ++i) {
    float* si = s + i * kBlockK;
    float* dpi = dp + i * kBlockK;
    const float lse_i = lse[i], d_i = dsum[i];
    for (int j = 0; j < kBlockK; ++j) si[j] = j < cols ? ExpFloat(si[j] * scale - lse_i) : 0.f;
    for (int j = 0; j < kBlockK; ++j) dpi[j] = j < cols ? si[j] * (dpi[j] - d_i) : 0.f;
  }
  // dV += P^T dO and dK += dS^T Q: rows of the products are keys, read P and dS transposed.
  int j = 0;
  for (; j + 4 <= cols; j += 4) {
    AccumulateRows<4>(s + j, 1, kBlockK, rows, d_o, d, dv + j * d, d, d);
    AccumulateRows<4>(dp + j, 1, kBlockK, rows, q, d, dk + j * d, d, d);
  }
  for (; j < cols; ++j) {
    AccumulateRows<1>(s + j, 1, kBlockK, rows, d_o, d, dv + j * d, d, d);
    AccumulateRows<1>(dp + j, 1, kBlockK, rows, q, d, dk + j * d, d, d);
  }
  // dQ += dS K.
  for (i = 0; i + 4 <= rows; i += 4) {
    AccumulateRows<4>(dp + i * kBlockK, kBlockK, 1, cols, k, d, dq + i * d, d, d);
  }
  for (; i < rows; ++i)
    AccumulateRows<1>(dp + i * kBlockK, kBlockK, 1, cols, k, d, dq + i * d, d, d);
}

// The tile when the mask cuts it: row i only touches keys [col_begin[i], col_end[i]).
ATTN_CPU_CLONES void BackwardTile(int rows, int d, float scale, const float* __restrict q,
                                  const float* __restrict d_o, const float* __restrict k,
                                  const float* __restrict kt, const float* __restrict vt,
                                  const float* lse, const float* dsum, const int* col_begin,
                                  const int* col_end, float* __restrict s, float* __restrict dp,
                                  float* __restrict dk, float* __restrict dv,
                                  float* __restrict dq) {
  for (int i = 0; i < rows; ++i) {
    const int jb = col_begin[i], je = col_end[i];
    if (jb >= je) continue;
    const float* qi = q + static_cast<int64_t>(i) * d;
    const float* doi = d_o + static_cast<int64_t>(i) * d;
    float* dqi = dq + static_cast<int64_t>(i) * d;
    for (int j = jb; j < je; ++j) {
      s[j] = 0.f;
      dp[j] = 0.f;
    }
    for (int c = 0; c < d; ++c) {
      const float qc = qi[c], doc = doi[c];
      const float* ktc = kt + static_cast<int64_t>(c) * kBlockK;
      const float* vtc = vt + static_cast<int64_t>(c) * kBlockK;
      for (int j = jb; j < je; ++j) {
        s[j] += qc * ktc[j];
        dp[j] += doc * vtc[j];
      }
    }
    const float lse_i = lse[i], d_i = dsum[i];
    for (int j = jb; j < je; ++j) s[j] = ExpFloat(s[j] * scale - lse_i);  // P
    for (int j = jb; j < je; ++j) dp[j] = s[j] * (dp[j] - d_i);           // dS
    for (int j = jb; j < je; ++j) {
      const float pj = s[j], dsj = dp[j];
      float* dkj = dk + static_cast<int64_t>(j) * d;
      float* dvj = dv + static_cast<int64_t>(j) * d;
      const float* kj = k + static_cast<int64_t>(j) * d;
      for (int c = 0; c < d; ++c) {
        dvj[c] += pj * doi[c];
        dkj[c] += dsj * qi[c];
        dqi[c] += dsj * kj[c];
      }
    }
  }
}

// Everything the items of one backward call share.
struct BackwardPass {
  const AttentionProblem& p;
  const BackwardArgs& a;
  std::vector<float> dsum;    // D, [num_heads, total_q]
  std::vector<float> dq_acc;  // unscaled dQ, [total_q, num_heads, head_dim]
  std::unique_ptr<absl::Mutex[]> dq_locks;
};

void ComputeDsum(BackwardPass& pass, int64_t t0, int64_t t1, std::vector<float>& o_row,
                 std::vector<float>& do_row) {
  const AttentionProblem& p = pass.p;
  const int d = p.head_dim;
  for (int64_t t = t0; t < t1; ++t) {
    for (int h = 0; h < p.num_heads; ++h) {
      LoadRow(pass.a.o.data, p.dtype, pass.a.o.offset(t, h), d, o_row.data());
      LoadRow(pass.a.d_o.data, p.dtype, pass.a.d_o.offset(t, h), d, do_row.data());
      float sum = 0.f;
      for (int c = 0; c < d; ++c) sum += do_row[c] * o_row[c];
      pass.dsum[h * p.total_q() + t] = sum;
    }
  }
}

void BackwardKeyBlock(BackwardPass& pass, const RowBlock& kb, int kvh, BackwardScratch& sc) {
  const AttentionProblem& p = pass.p;
  const BackwardArgs& a = pass.a;
  const int d = p.head_dim, group = p.group_size();
  const int64_t q_start = p.cu_seqlens_q[kb.b];
  const int64_t k_start = p.cu_seqlens_k[kb.b] + kb.row0;
  const int64_t lq = p.seqlen_q(kb.b), total_q = p.total_q();
  const int tiles = (kb.rows + kBlockK - 1) / kBlockK;
  const float scale = p.scale();

  // K row-major, K and V transposed per tile ([tile][d][kBlockK]).
  for (int j = 0; j < kb.rows; ++j) {
    const int64_t panel = static_cast<int64_t>(j / kBlockK) * d * kBlockK + j % kBlockK;
    LoadRow(a.k.data, p.dtype, a.k.offset(k_start + j, kvh), d, &sc.k[j * d]);
    for (int c = 0; c < d; ++c) sc.kt[panel + c * kBlockK] = sc.k[j * d + c];
    LoadRow(a.v.data, p.dtype, a.v.offset(k_start + j, kvh), d, sc.row.data());
    for (int c = 0; c < d; ++c) sc.vt[panel + c * kBlockK] = sc.row[c];
  }
  std::fill(sc.dk.begin(), sc.dk.end(), 0.f);
  std::fill(sc.dv.begin(), sc.dv.end(), 0.f);

  for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
    for (int64_t row0 = 0; row0 < lq; row0 += kBlockQ) {
      const int rows = static_cast<int>(std::min<int64_t>(kBlockQ, lq - row0));
      bool any = false;
      for (int i = 0; i < rows; ++i) {
        const KeyRange r = p.visible_keys(kb.b, row0 + i);
        sc.key_begin[i] = r.begin - kb.row0;  // relative to the key block
        sc.key_end[i] = r.end - kb.row0;
        any = any || (std::max<int64_t>(r.begin, kb.row0) < std::min(r.end, kb.row0 + kb.rows));
      }
      if (!any) continue;
      for (int i = 0; i < rows; ++i) {
        const int64_t t = q_start + row0 + i;
        LoadRow(a.q.data, p.dtype, a.q.offset(t, h), d, &sc.q[i * d]);
        LoadRow(a.d_o.data, p.dtype, a.d_o.offset(t, h), d, &sc.d_o[i * d]);
        sc.lse[i] = a.lse[h * total_q + t];
        sc.dsum[i] = pass.dsum[h * total_q + t];
      }
      std::fill(sc.dq.begin(), sc.dq.begin() + rows * d, 0.f);
      for (int tile = 0; tile < tiles; ++tile) {
        const int64_t j0 = static_cast<int64_t>(tile) * kBlockK;
        const int cols = static_cast<int>(std::min<int64_t>(kBlockK, kb.rows - j0));
        bool tile_any = false, full = true;
        for (int i = 0; i < rows; ++i) {
          sc.col_begin[i] = static_cast<int>(std::clamp<int64_t>(sc.key_begin[i] - j0, 0, cols));
          sc.col_end[i] = static_cast<int>(std::clamp<int64_t>(sc.key_end[i] - j0, 0, cols));
          tile_any = tile_any || sc.col_begin[i] < sc.col_end[i];
          full = full && sc.col_begin[i] == 0 && sc.col_end[i] == cols;
        }
        if (!tile_any) continue;
        const float* k = &sc.k[j0 * d];
        const float* kt = &sc.kt[tile * d * kBlockK];
        const float* vt = &sc.vt[tile * d * kBlockK];
        float* dk = &sc.dk[j0 * d];
        float* dv = &sc.dv[j0 * d];
        if (full) {
          BackwardFullTile(rows, d, cols, scale, sc.q.data(), sc.d_o.data(), k, kt, vt,
                           sc.lse.data(), sc.dsum.data(), sc.s.data(), sc.dp.data(), dk, dv,
                           sc.dq.data());
        } else {
          BackwardTile(rows, d, scale, sc.q.data(), sc.d_o.data(), k, kt, vt, sc.lse.data(),
                       sc.dsum.data(), sc.col_begin.data(), sc.col_end.data(), sc.s.data(),
                       sc.dp.data(), dk, dv, sc.dq.data());
        }
      }
      const int64_t first = q_start + row0;
      absl::MutexLock lock(&pass.dq_locks[(first / kBlockQ * p.num_heads + h) % kDqLockStripes]);
      for (int i = 0; i < rows; ++i) {
        float* dst = &pass.dq_acc[((first + i) * p.num_heads + h) * d];
        const float* src = &sc.dq[i * d];
        for (int c = 0; c < d; ++c) dst[c] += src[c];
      }
    }
  }
  for (int j = 0; j < kb.rows; ++j) {
    StoreRow(a.dk.data, p.dtype, a.dk.offset(k_start + j, kvh), d, &sc.dk[j * d], scale);
    StoreRow(a.dv.data, p.dtype, a.dv.offset(k_start + j, kvh), d, &sc.dv[j * d]);
  }
}

}  // namespace

void TiledBackward(const AttentionProblem& p, const BackwardArgs& a, ThreadPool& pool) {
  const int d = p.head_dim, heads = p.num_heads;
  const int64_t total_q = p.total_q();
  BackwardPass pass{p, a, std::vector<float>(heads * total_q),
                    std::vector<float>(total_q * heads * d, 0.f),
                    std::make_unique<absl::Mutex[]>(kDqLockStripes)};
  const int64_t row_items = (total_q + kRowsPerItem - 1) / kRowsPerItem;

  std::vector<std::vector<float>> rows_a(pool.num_workers(), std::vector<float>(d));
  std::vector<std::vector<float>> rows_b(pool.num_workers(), std::vector<float>(d));
  pool.ParallelFor(row_items, [&](int worker, int64_t item) {
    const int64_t t0 = item * kRowsPerItem;
    ComputeDsum(pass, t0, std::min(total_q, t0 + kRowsPerItem), rows_a[worker], rows_b[worker]);
  });

  const std::vector<RowBlock> key_blocks = SplitRows(p.cu_seqlens_k, kBackwardKeys);
  std::vector<BackwardScratch> scratch(pool.num_workers(), BackwardScratch(d));
  const int kv_heads = p.num_kv_heads;
  if (a.deterministic) {
    // Only the item of (sequence, KV head) touches those dQ rows, so each row sums its key
    // blocks' contributions in key-block order whatever the schedule.
    const int batch = p.batch();
    std::vector<size_t> first_block(batch + 1);
    size_t i = 0;
    for (int b = 0; b <= batch; ++b) {
      while (i < key_blocks.size() && key_blocks[i].b < b) ++i;
      first_block[b] = i;
    }
    pool.ParallelFor(int64_t{batch} * kv_heads, [&](int worker, int64_t item) {
      const int b = static_cast<int>(item / kv_heads), kvh = static_cast<int>(item % kv_heads);
      for (size_t k = first_block[b]; k < first_block[b + 1]; ++k) {
        BackwardKeyBlock(pass, key_blocks[k], kvh, scratch[worker]);
      }
    });
  } else {
    pool.ParallelFor(static_cast<int64_t>(key_blocks.size()) * kv_heads,
                     [&](int worker, int64_t item) {
                       BackwardKeyBlock(pass, key_blocks[item / kv_heads],
                                        static_cast<int>(item % kv_heads), scratch[worker]);
                     });
  }

  pool.ParallelFor(row_items, [&](int, int64_t item) {
    const int64_t t0 = item * kRowsPerItem, t1 = std::min(total_q, t0 + kRowsPerItem);
    for (int64_t t = t0; t < t1; ++t) {
      for (int h = 0; h < heads; ++h) {
        StoreRow(a.dq.data, p.dtype, a.dq.offset(t, h), d, &pass.dq_acc[(t * heads + h) * d],
                 p.scale());
      }
    }
  });
}

}  // namespace attn::cpu
