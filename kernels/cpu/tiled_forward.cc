// Forward pass of the CPU tiled engine: IO-aware tiling with online softmax.
//
// Work items are (query block, query head) pairs, handed out dynamically by the thread pool.
// Each item converts its kBlockQ rows of Q to float once, then streams the K/V tiles that any of
// its rows can see (tiles fully hidden by the causal/window mask are skipped). Row state lives in
// float scratch of block size only: the running max m, the running sum l and the unnormalised
// output acc. Per tile:
//   S = scale * Q K^T (visible columns only),  m_new = max(m, rowmax(S)),
//   alpha = exp(m - m_new),  P = exp(S - m_new),
//   acc = acc * alpha + P V,  l = l * alpha + rowsum(P),  m = m_new.
// At the end O = acc / l and LSE = m + log(l). No query-length x key-length buffer exists.
// Keys and values come from dense [total_k, kv_heads, d] tensors or, for KV sessions, from pages
// through a block table (attn/paged_kv.h); only where a key row is found differs. A TileTrace
// (tile_trace.h), null except under TracedForwardBlock, observes each step of the update.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"
#include "cpu/float_rows.h"
#include "cpu/micro_kernels.h"
#include "cpu/tile_config.h"
#include "cpu/tile_trace.h"
#include "cpu/tiled_kernels.h"
#include "cpu/vec_math.h"

namespace attn::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One worker's float32 scratch; sizes depend only on the block sizes and head_dim.
struct ForwardScratch {
  explicit ForwardScratch(int d)
      : q(kBlockQ * d),
        kt(d * kBlockK),
        v(kBlockK * d),
        acc(kBlockQ * d),
        s(kBlockQ * kBlockK),
        m(kBlockQ),
        l(kBlockQ),
        row(d),
        key_begin(kBlockQ),
        key_end(kBlockQ),
        col_begin(kBlockQ),
        col_end(kBlockQ) {}
  std::vector<float> q;    // [kBlockQ][d]
  std::vector<float> kt;   // K tile transposed, [d][kBlockK]
  std::vector<float> v;    // [kBlockK][d]
  std::vector<float> acc;  // [kBlockQ][d]
  std::vector<float> s;    // S, then P: [kBlockQ][kBlockK] (the masked path uses one row)
  std::vector<float> m, l;
  std::vector<float> row;                   // staging for one converted K row
  std::vector<int64_t> key_begin, key_end;  // each row's visible keys in the sequence
  std::vector<int> col_begin, col_end;      // the same, relative to the current tile
};

// One K/V tile against the Q block, for tiles cut by the mask: the online-softmax update of m, l
// and acc for every row whose visible keys meet this tile ([col_begin[i], col_end[i]) of the tile's
// columns).
ATTN_CPU_CLONES void ForwardTile(int rows, int d, float scale, const float* __restrict q,
                                 const float* __restrict kt, const float* __restrict v,
                                 const int* col_begin, const int* col_end, float* __restrict m,
                                 float* __restrict l, float* __restrict acc, float* __restrict s,
                                 TileTrace* trace) {
  for (int i = 0; i < rows; ++i) {
    const int jb = col_begin[i], je = col_end[i];
    if (jb >= je) continue;
    const float* qi = q + static_cast<int64_t>(i) * d;
    for (int j = jb; j < je; ++j) s[j] = 0.f;
    for (int c = 0; c < d; ++c) {
      const float qc = qi[c];
      const float* ktc = kt + static_cast<int64_t>(c) * kBlockK;
      for (int j = jb; j < je; ++j) s[j] += qc * ktc[j];
    }
    float row_max = kNegInf;
    for (int j = jb; j < je; ++j) {
      s[j] *= scale;
      row_max = s[j] > row_max ? s[j] : row_max;  // NaN scores skip the max but poison P
    }
    const float m_new = m[i] > row_max ? m[i] : row_max;
    // Only infinite scores make m_new = -inf; subtracting 0 then keeps exp() away from -inf+inf.
    const float base = m_new == kNegInf ? 0.f : m_new;
    const float alpha = ExpFloat(m[i] - base);
    if (trace != nullptr) trace->Scores(i, s, jb, je, row_max, m[i], m_new, alpha);
    for (int j = jb; j < je; ++j) s[j] = ExpFloat(s[j] - base);  // P
    if (trace != nullptr) trace->Probabilities(i, s, jb, je);
    float row_sum = 0.f;
    for (int j = jb; j < je; ++j) row_sum += s[j];
    float* acc_i = acc + static_cast<int64_t>(i) * d;
    for (int c = 0; c < d; ++c) acc_i[c] *= alpha;
    for (int j = jb; j < je; ++j) {
      const float pj = s[j];
      const float* vj = v + static_cast<int64_t>(j) * d;
      for (int c = 0; c < d; ++c) acc_i[c] += pj * vj[c];
    }
    l[i] = l[i] * alpha + row_sum;
    m[i] = m_new;
  }
}

// The same update when every row of the block sees every column of the tile (no mask inside it),
// the common case: S = Q K^T and acc += P V run as register-blocked block products.
ATTN_CPU_CLONES void ForwardFullTile(int rows, int d, int cols, float scale,
                                     const float* __restrict q, const float* __restrict kt,
                                     const float* __restrict v, float* __restrict m,
                                     float* __restrict l, float* __restrict acc,
                                     float* __restrict s, TileTrace* trace) {
  int i = 0;
  for (; i + 4 <= rows; i += 4) RowsTimesPanel<4>(q + i * d, d, kt, d, s + i * kBlockK);
  for (; i < rows; ++i) RowsTimesPanel<1>(q + i * d, d, kt, d, s + i * kBlockK);
  for (i = 0; i < rows; ++i) {
    // Whole-panel vector loops; columns past `cols` (a short last tile) become -inf, so P = 0.
    float* si = s + i * kBlockK;
    for (int j = 0; j < kBlockK; ++j) si[j] = j < cols ? si[j] * scale : kNegInf;
    V16 max16 = Load16(si);
    for (int j = 16; j < kBlockK; j += 16) {
      const V16 x = Load16(si + j);
      max16 = x > max16 ? x : max16;  // NaN scores skip the max but poison P
    }
    float row_max = kNegInf;
    for (int w = 0; w < 16; ++w) row_max = max16[w] > row_max ? max16[w] : row_max;
    const float m_new = m[i] > row_max ? m[i] : row_max;
    const float base = m_new == kNegInf ? 0.f : m_new;
    const float alpha = ExpFloat(m[i] - base);
    if (trace != nullptr) trace->Scores(i, si, 0, cols, row_max, m[i], m_new, alpha);
    for (int j = 0; j < kBlockK; ++j) si[j] = ExpFloat(si[j] - base);  // P
    if (trace != nullptr) trace->Probabilities(i, si, 0, cols);
    V16 sum16 = Load16(si);
    for (int j = 16; j < kBlockK; j += 16) sum16 += Load16(si + j);
    float row_sum = 0.f;
    for (int w = 0; w < 16; ++w) row_sum += sum16[w];
    float* acc_i = acc + static_cast<int64_t>(i) * d;
    for (int c = 0; c < d; ++c) acc_i[c] *= alpha;
    l[i] = l[i] * alpha + row_sum;
    m[i] = m_new;
  }
  for (i = 0; i + 4 <= rows; i += 4) {
    AccumulateRows<4>(s + i * kBlockK, kBlockK, 1, cols, v, d, acc + i * d, d, d);
  }
  for (; i < rows; ++i)
    AccumulateRows<1>(s + i * kBlockK, kBlockK, 1, cols, v, d, acc + i * d, d, d);
}

// Where sequence b's key token t of KV head h is: element offsets of its K and V rows.
struct DenseKeys {
  const void* k;
  const void* v;
  TensorRef k_ref, v_ref;
  const std::vector<int32_t>& cu_seqlens_k;
  int64_t KOffset(int b, int64_t t, int h) const { return k_ref.offset(cu_seqlens_k[b] + t, h); }
  int64_t VOffset(int b, int64_t t, int h) const { return v_ref.offset(cu_seqlens_k[b] + t, h); }
};

struct PagedKeys {
  const void* k;  // the pool; V rows are v_offset elements after their K rows
  const void* v;
  const PagedKV& kv;
  int64_t token_stride, v_offset;
  int head_dim;
  int shift;  // log2(page_tokens)
  int64_t KOffset(int b, int64_t t, int h) const {
    const int64_t page = kv.block_table[static_cast<int64_t>(b) * kv.max_blocks + (t >> shift)];
    return page * kv.page_stride + (t & (kv.page_tokens - 1)) * token_stride +
           static_cast<int64_t>(h) * head_dim;
  }
  int64_t VOffset(int b, int64_t t, int h) const { return KOffset(b, t, h) + v_offset; }
};

// `tile_keys` (at most kBlockK) and `trace` differ from kBlockK and null only under
// TracedForwardBlock.
template <typename Keys>
void ForwardBlock(const AttentionProblem& p, const ForwardArgs& a, const Keys& keys,
                  const RowBlock& blk, int h, ForwardScratch& sc, int tile_keys = kBlockK,
                  TileTrace* trace = nullptr) {
  const int d = p.head_dim;
  const int kvh = h / p.group_size();
  const int64_t q_start = p.cu_seqlens_q[blk.b] + blk.row0;
  const int64_t lk = p.seqlen_k(blk.b);
  const float scale = p.scale();

  int64_t first_key = lk, last_key = 0;  // union of the rows' visible keys
  for (int i = 0; i < blk.rows; ++i) {
    const KeyRange r = p.visible_keys(blk.b, blk.row0 + i);
    sc.key_begin[i] = r.begin;
    sc.key_end[i] = std::max(r.begin, r.end);
    if (r.end > r.begin) {
      first_key = std::min(first_key, r.begin);
      last_key = std::max(last_key, r.end);
    }
    LoadRow(a.q.data, p.dtype, a.q.offset(q_start + i, h), d, &sc.q[i * d]);
    sc.m[i] = kNegInf;
    sc.l[i] = 0.f;
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + blk.rows * d, 0.f);

  for (int64_t k0 = first_key / tile_keys * tile_keys; k0 < last_key; k0 += tile_keys) {
    const int cols = static_cast<int>(std::min<int64_t>(tile_keys, lk - k0));
    for (int j = 0; j < cols; ++j) {
      LoadRow(keys.k, p.dtype, keys.KOffset(blk.b, k0 + j, kvh), d, sc.row.data());
      for (int c = 0; c < d; ++c) sc.kt[c * kBlockK + j] = sc.row[c];
      LoadRow(keys.v, p.dtype, keys.VOffset(blk.b, k0 + j, kvh), d, &sc.v[j * d]);
    }
    bool full = true;
    for (int i = 0; i < blk.rows; ++i) {
      sc.col_begin[i] = static_cast<int>(std::clamp<int64_t>(sc.key_begin[i] - k0, 0, cols));
      sc.col_end[i] = static_cast<int>(std::clamp<int64_t>(sc.key_end[i] - k0, 0, cols));
      full = full && sc.col_begin[i] == 0 && sc.col_end[i] == cols;
    }
    if (trace != nullptr) trace->BeginTile(k0, cols, !full);
    if (full) {
      ForwardFullTile(blk.rows, d, cols, scale, sc.q.data(), sc.kt.data(), sc.v.data(), sc.m.data(),
                      sc.l.data(), sc.acc.data(), sc.s.data(), trace);
    } else {
      ForwardTile(blk.rows, d, scale, sc.q.data(), sc.kt.data(), sc.v.data(), sc.col_begin.data(),
                  sc.col_end.data(), sc.m.data(), sc.l.data(), sc.acc.data(), sc.s.data(), trace);
    }
    if (trace != nullptr) trace->EndTile(blk.rows, d, sc.m.data(), sc.l.data(), sc.acc.data());
  }

  const int64_t total_q = p.total_q();
  for (int i = 0; i < blk.rows; ++i) {
    const int64_t out = a.o.offset(q_start + i, h);
    float lse = kNegInf;
    if (sc.key_end[i] > sc.key_begin[i]) {
      float* acc_i = &sc.acc[i * d];
      for (int c = 0; c < d; ++c) acc_i[c] = acc_i[c] / sc.l[i];  // O = acc / l
      StoreRow(a.o.data, p.dtype, out, d, acc_i);
      lse = sc.m[i] + std::log(sc.l[i]);
    } else {
      StoreZeroRow(a.o.data, p.dtype, out, d);
    }
    if (a.lse != nullptr) a.lse[h * total_q + q_start + i] = lse;
  }
}

template <typename Keys>
void RunForward(const AttentionProblem& p, const ForwardArgs& a, const Keys& keys,
                ThreadPool& pool) {
  const std::vector<RowBlock> blocks = SplitRows(p.cu_seqlens_q, kBlockQ);
  std::vector<ForwardScratch> scratch(pool.num_workers(), ForwardScratch(p.head_dim));
  // Head-major item order: a worker's consecutive items stream the same head's K/V, which then
  // stays in cache.
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  pool.ParallelFor(num_blocks * p.num_heads, [&](int worker, int64_t item) {
    ForwardBlock(p, a, keys, blocks[item % num_blocks], static_cast<int>(item / num_blocks),
                 scratch[worker]);
  });
}

}  // namespace

void TiledForward(const AttentionProblem& p, const ForwardArgs& a, ThreadPool& pool) {
  RunForward(p, a, DenseKeys{a.k.data, a.v.data, a.k, a.v, p.cu_seqlens_k}, pool);
}

void TiledForwardPaged(const AttentionProblem& p, const PagedForwardArgs& a, ThreadPool& pool) {
  ForwardArgs rows;  // Q, O and the LSE as the dense pass takes them
  rows.q = a.q;
  rows.o = a.o;
  rows.lse = a.lse;
  int shift = 0;
  while ((1 << shift) < a.kv.page_tokens) ++shift;
  RunForward(p, rows,
             PagedKeys{a.kv.pages, a.kv.pages, a.kv, PagedKV::TokenStride(p), a.kv.v_offset(p),
                       p.head_dim, shift},
             pool);
}

absl::Status TracedForwardBlock(const AttentionProblem& p, const ForwardArgs& a, int b,
                                int64_t row0, int rows, int head, int kv_tile, TileTrace& trace) {
  ATTN_RETURN_IF_ERROR(ValidateForward(p, a));
  if (b < 0 || b >= p.batch()) {
    return absl::InvalidArgumentError(absl::StrCat("b: no sequence ", b, " in ", p.batch()));
  }
  if (rows < 1 || rows > kBlockQ || row0 < 0 || row0 + rows > p.seqlen_q(b)) {
    return absl::InvalidArgumentError(absl::StrCat("rows: [", row0, ", ", row0 + rows,
                                                   ") is not a block of at most ", kBlockQ,
                                                   " of the sequence's ", p.seqlen_q(b), " rows"));
  }
  if (head < 0 || head >= p.num_heads) {
    return absl::InvalidArgumentError(absl::StrCat("head: ", head, " of ", p.num_heads));
  }
  if (kv_tile < 1 || kv_tile > kBlockK) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_tile: ", kv_tile, " keys, the engine's tiles hold 1 to ", kBlockK));
  }
  ForwardScratch scratch(p.head_dim);
  ForwardBlock(p, a, DenseKeys{a.k.data, a.v.data, a.k, a.v, p.cu_seqlens_k},
               RowBlock{b, row0, rows}, head, scratch, kv_tile, &trace);
  return absl::OkStatus();
}

}  // namespace attn::cpu
