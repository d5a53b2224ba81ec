#include "clients/cli/explain_command.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "attn/problem.h"
#include "attn/tensor.h"
#include "cpu/tile_config.h"
#include "cpu/tile_trace.h"

// Shared with attend (attnserve_client.cc) and train submit (train_command.cc).
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(int, head_dim);
ABSL_DECLARE_FLAG(bool, causal);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(int, seqlen);

ABSL_FLAG(int, q_block, 4, "explain: query rows of the block (1 to 128, the engine's block)");
ABSL_FLAG(int, kv_tile, 16, "explain: keys per K/V tile (1 to 64, the engine's tile)");

namespace attnserve::client {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Text mode prints at most this many columns of a matrix row; --json prints all.
constexpr int kTextColumns = 16;

// One row's step through one tile, as the update reported it.
struct RowStep {
  bool sees_tile = false;   // false: no key of the tile is visible to the row; state unchanged
  std::vector<float> s, p;  // [cols]: S (-inf where masked) and P (0 where masked)
  float row_max = kNegInf;  // max of S over the row's visible columns
  float m = kNegInf;        // running max before the tile
  float m_new = kNegInf;    // max(m, row_max): the running max after it
  float alpha = 1.f;        // exp(m - m_new), the rescale of l and acc
  float l = 0.f;            // running sum after the tile
  std::vector<float> acc;   // [head_dim]: unnormalised output after the tile
};

struct TileStep {
  int64_t key0 = 0;
  int cols = 0;
  bool masked = false;  // the masked update (ForwardTile) ran, not the full-tile one
  std::vector<RowStep> rows;
};

// Keeps every step the engine's update reports.
class Recorder final : public attn::cpu::TileTrace {
 public:
  explicit Recorder(int rows) : rows_(rows) {}

  void BeginTile(int64_t key0, int cols, bool masked) override {
    tiles_.push_back({key0, cols, masked, std::vector<RowStep>(rows_)});
  }
  void Scores(int row, const float* s, int begin, int end, float row_max, float m, float m_new,
              float alpha) override {
    RowStep& r = tiles_.back().rows[row];
    r.sees_tile = true;
    r.s.assign(tiles_.back().cols, kNegInf);
    std::copy(s + begin, s + end, r.s.begin() + begin);
    r.row_max = row_max;
    r.m = m;
    r.m_new = m_new;
    r.alpha = alpha;
  }
  void Probabilities(int row, const float* p, int begin, int end) override {
    RowStep& r = tiles_.back().rows[row];
    r.p.assign(tiles_.back().cols, 0.f);
    std::copy(p + begin, p + end, r.p.begin() + begin);
  }
  void EndTile(int rows, int d, const float* m, const float* l, const float* acc) override {
    for (int i = 0; i < rows; ++i) {
      RowStep& r = tiles_.back().rows[i];
      if (!r.sees_tile) r.m = r.m_new = m[i];
      r.l = l[i];
      r.acc.assign(acc + static_cast<int64_t>(i) * d, acc + static_cast<int64_t>(i + 1) * d);
    }
  }

  const std::vector<TileStep>& tiles() const { return tiles_; }

 private:
  int rows_;
  std::vector<TileStep> tiles_;
};

struct Options {
  int q_block, kv_tile, head_dim;
  int64_t seqlen;
  bool causal;
  uint64_t seed;
};

// Everything one explain run shows.
struct Explanation {
  attn::AttentionProblem problem;
  uint64_t seed = 0;
  int64_t row0 = 0;  // first query row of the block
  int rows = 0;
  std::vector<float> q, k, v;  // [seqlen][head_dim] each (one head)
  std::vector<TileStep> tiles;
  std::vector<float> o, lse;               // the engine's, [rows][head_dim] and [rows]
  std::vector<double> naive_o, naive_lse;  // softmax(S) V the naive way
  double max_abs_diff = 0, max_lse_diff = 0, bound = 0;
};

// softmax(S) V for query row `r` the naive way: the whole row of scores at once, in float64.
void NaiveRow(const Explanation& e, int64_t r, double* o, double* lse) {
  const attn::AttentionProblem& p = e.problem;
  const int d = p.head_dim;
  const attn::KeyRange keys = p.visible_keys(0, r);
  std::vector<double> s;
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t j = keys.begin; j < keys.end; ++j) {
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += double{e.q[r * d + c]} * e.k[j * d + c];
    s.push_back(dot * p.scale());
    max = std::max(max, s.back());
  }
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - max));
  for (int c = 0; c < d; ++c) o[c] = 0;
  for (size_t j = 0; j < s.size(); ++j) {
    for (int c = 0; c < d; ++c) o[c] += s[j] / sum * e.v[(keys.begin + j) * d + c];
  }
  *lse = max + std::log(sum);
}

absl::StatusOr<Explanation> Explain(const Options& opt) {
  Explanation e;
  e.problem = attn::DenseProblem(attn::DType::kF32, 1, opt.seqlen, opt.seqlen, 1, 1, opt.head_dim,
                                 opt.causal);
  if (absl::Status s = attn::ValidateProblem(e.problem); !s.ok()) return s;  // before sizing
  e.seed = opt.seed;
  e.rows = opt.q_block;
  e.row0 = opt.seqlen - opt.q_block;
  const int d = opt.head_dim;
  std::mt19937_64 rng(opt.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (std::vector<float>* t : {&e.q, &e.k, &e.v}) {
    t->resize(opt.seqlen * d);
    for (float& x : *t) x = normal(rng);
  }
  std::vector<float> o(opt.seqlen * d, 0.f), lse(opt.seqlen, kNegInf);
  attn::ForwardArgs args;
  args.q = attn::Packed<const void*>(e.q.data(), 1, d);
  args.k = attn::Packed<const void*>(e.k.data(), 1, d);
  args.v = attn::Packed<const void*>(e.v.data(), 1, d);
  args.o = attn::Packed<void*>(o.data(), 1, d);
  args.lse = lse.data();
  Recorder recorder(e.rows);
  if (absl::Status s = attn::cpu::TracedForwardBlock(e.problem, args, 0, e.row0, e.rows,
                                                     /*head=*/0, opt.kv_tile, recorder);
      !s.ok()) {
    return s;
  }
  e.tiles = recorder.tiles();
  e.o.assign(o.begin() + e.row0 * d, o.end());
  e.lse.assign(lse.begin() + e.row0, lse.end());
  e.naive_o.resize(e.rows * d);
  e.naive_lse.resize(e.rows);
  double max_ref = 0;
  for (int i = 0; i < e.rows; ++i) {
    NaiveRow(e, e.row0 + i, &e.naive_o[i * d], &e.naive_lse[i]);
    for (int c = 0; c < d; ++c) {
      max_ref = std::max(max_ref, std::abs(e.naive_o[i * d + c]));
      e.max_abs_diff = std::max(e.max_abs_diff, std::abs(e.o[i * d + c] - e.naive_o[i * d + c]));
    }
    e.max_lse_diff = std::max(e.max_lse_diff, std::abs(e.lse[i] - e.naive_lse[i]));
  }
  e.bound = 1e-4 * std::max(1.0, max_ref);  // attn_local's float32 bound
  return e;
}

// ---- text -------------------------------------------------------------------------------------

std::string Cell(double x) {
  if (std::isinf(x)) return x < 0 ? "   -inf" : "    inf";
  return absl::StrFormat("%7.3f", x);
}

// Up to kTextColumns cells of x[0, n); "-" where `scores` (when given) is masked.
template <typename T>
std::string Cells(const T* x, int n, const float* scores = nullptr) {
  std::string out;
  for (int c = 0; c < std::min(n, kTextColumns); ++c) {
    const bool masked = scores != nullptr && scores[c] == kNegInf;
    absl::StrAppend(&out, " ", masked ? "      -" : Cell(x[c]));
  }
  if (n > kTextColumns) absl::StrAppend(&out, "  ... (", n - kTextColumns, " more)");
  return out;
}

std::string Scalar(float x) {
  return std::isinf(x) ? (x < 0 ? "-inf" : "inf") : absl::StrFormat("%.6g", x);
}

void PrintText(const Explanation& e) {
  const attn::AttentionProblem& p = e.problem;
  const int d = p.head_dim;
  const int64_t n = p.seqlen_k(0);
  auto label = [&](int i) { return absl::StrFormat("    q%-4d", e.row0 + i); };
  std::printf(
      "explain: one query block through the CPU tiled engine's online-softmax update\n"
      "         (kernels/cpu/tiled_forward.cc: ForwardBlock, ForwardFullTile, ForwardTile)\n");
  std::printf("problem: float32, 1 head, head_dim %d, %lld queries and %lld keys, %s, scale %g\n",
              d, static_cast<long long>(n), static_cast<long long>(n),
              p.causal ? "causal (bottom-right aligned)" : "no mask", p.scale());
  std::printf("block:   query rows %lld..%lld over K/V tiles of %d keys: %zu tiles\n",
              static_cast<long long>(e.row0), static_cast<long long>(e.row0 + e.rows - 1),
              e.tiles.empty() ? 0 : e.tiles.front().cols, e.tiles.size());
  std::printf("inputs:  Q, K, V drawn from N(0, 1) with --seed=%llu (--json prints them)\n",
              static_cast<unsigned long long>(e.seed));
  std::printf("start:   m = -inf, l = 0, acc = 0 in every row (so the first tile's alpha is 0)\n");
  for (size_t t = 0; t < e.tiles.size(); ++t) {
    const TileStep& tile = e.tiles[t];
    std::printf("\ntile %zu of %zu: keys %lld..%lld, %s\n", t + 1, e.tiles.size(),
                static_cast<long long>(tile.key0),
                static_cast<long long>(tile.key0 + tile.cols - 1),
                tile.masked ? "cut by the mask: the masked update (ForwardTile)"
                            : "every row sees every key: the full-tile update (ForwardFullTile)");
    std::printf("  S = scale * Q K^T (-inf: masked, never computed)\n");
    for (int i = 0; i < e.rows; ++i) {
      const RowStep& r = tile.rows[i];
      if (r.sees_tile) {
        std::printf("%s%s\n", label(i).c_str(), Cells(r.s.data(), tile.cols).c_str());
      } else {
        std::printf("%s sees no key of this tile: m, l and acc stay as they are\n",
                    label(i).c_str());
      }
    }
    std::printf(
        "  rowmax(S); m, the running max before the tile; m_new = max(m, rowmax);\n"
        "  alpha = exp(m - m_new), the factor that rescales l and acc\n");
    for (int i = 0; i < e.rows; ++i) {
      const RowStep& r = tile.rows[i];
      if (!r.sees_tile) continue;
      std::printf("%s rowmax %-11s m %-11s m_new %-11s alpha %s\n", label(i).c_str(),
                  Scalar(r.row_max).c_str(), Scalar(r.m).c_str(), Scalar(r.m_new).c_str(),
                  Scalar(r.alpha).c_str());
    }
    std::printf("  P = exp(S - m_new) (-: masked, never computed; exp(-inf) = 0)\n");
    for (int i = 0; i < e.rows; ++i) {
      const RowStep& r = tile.rows[i];
      if (r.sees_tile) {
        std::printf("%s%s\n", label(i).c_str(), Cells(r.p.data(), tile.cols, r.s.data()).c_str());
      }
    }
    std::printf("  l = l * alpha + rowsum(P);  acc = acc * alpha + P V\n");
    for (int i = 0; i < e.rows; ++i) {
      const RowStep& r = tile.rows[i];
      std::printf("%s l %-10s acc%s\n", label(i).c_str(), Scalar(r.l).c_str(),
                  Cells(r.acc.data(), d).c_str());
    }
  }
  std::printf(
      "\nresult: O = acc / l and LSE = m + log(l) as the engine wrote them, against softmax(S) V\n"
      "        computed the naive way (float64, the row's whole S at once)\n");
  for (int i = 0; i < e.rows; ++i) {
    std::printf("%s O    %s   LSE %s\n", label(i).c_str(), Cells(&e.o[i * d], d).c_str(),
                Scalar(e.lse[i]).c_str());
    std::printf("          naive%s   LSE %s\n", Cells(&e.naive_o[i * d], d).c_str(),
                absl::StrFormat("%.6g", e.naive_lse[i]).c_str());
  }
  std::printf("largest |O - naive|: %.3g (bound %.3g): %s;  largest |LSE - naive|: %.3g\n",
              e.max_abs_diff, e.bound, e.max_abs_diff <= e.bound ? "match" : "MISMATCH",
              e.max_lse_diff);
}

// ---- JSON -------------------------------------------------------------------------------------

// A float as JSON: enough digits to read back the same float; null for -inf, inf and NaN.
std::string Number(double x) { return std::isfinite(x) ? absl::StrFormat("%.9g", x) : "null"; }

template <typename T>
std::string Array(const T* x, int64_t n) {
  std::vector<std::string> items;
  for (int64_t i = 0; i < n; ++i) items.push_back(Number(x[i]));
  return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
}

template <typename T>
std::string Matrix(const std::vector<T>& x, int64_t rows, int cols) {
  std::vector<std::string> items;
  for (int64_t r = 0; r < rows; ++r) items.push_back(Array(&x[r * cols], cols));
  return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
}

void PrintJson(const Explanation& e) {
  const attn::AttentionProblem& p = e.problem;
  const int d = p.head_dim;
  const int64_t n = p.seqlen_k(0);
  std::vector<std::string> tiles;
  for (const TileStep& tile : e.tiles) {
    std::vector<std::string> rows;
    for (int i = 0; i < e.rows; ++i) {
      const RowStep& r = tile.rows[i];
      rows.push_back(absl::StrCat(
          "{\"row\": ", e.row0 + i, ", \"sees_tile\": ", r.sees_tile ? "true" : "false",
          ", \"s\": ", r.sees_tile ? Array(r.s.data(), tile.cols) : "null",
          ", \"row_max\": ", Number(r.row_max), ", \"m\": ", Number(r.m),
          ", \"m_new\": ", Number(r.m_new), ", \"alpha\": ", Number(r.alpha),
          ", \"p\": ", r.sees_tile ? Array(r.p.data(), tile.cols) : "null",
          ", \"l\": ", Number(r.l), ", \"acc\": ", Array(r.acc.data(), d), "}"));
    }
    tiles.push_back(absl::StrCat("{\"key0\": ", tile.key0, ", \"cols\": ", tile.cols,
                                 ", \"masked\": ", tile.masked ? "true" : "false", ", \"rows\": [",
                                 absl::StrJoin(rows, ", "), "]}"));
  }
  const std::string problem = absl::StrCat(
      "{\"dtype\": \"float32\", \"seqlen\": ", n, ", \"head_dim\": ", d,
      ", \"causal\": ", p.causal ? "true" : "false", ", \"scale\": ", Number(p.scale()),
      ", \"seed\": ", e.seed, ", \"q_block\": ", e.rows,
      ", \"kv_tile\": ", e.tiles.empty() ? 0 : e.tiles.front().cols, "}");
  std::printf(
      "%s\n",
      absl::StrCat("{\"problem\": ", problem, ", \"row0\": ", e.row0, ", \"rows\": ", e.rows,
                   ", \"q\": ", Matrix(e.q, n, d), ", \"k\": ", Matrix(e.k, n, d),
                   ", \"v\": ", Matrix(e.v, n, d), ", \"tiles\": [", absl::StrJoin(tiles, ", "),
                   "], \"o\": ", Matrix(e.o, e.rows, d), ", \"lse\": ", Array(e.lse.data(), e.rows),
                   ", \"naive_o\": ", Matrix(e.naive_o, e.rows, d),
                   ", \"naive_lse\": ", Array(e.naive_lse.data(), e.rows),
                   ", \"max_abs_diff\": ", Number(e.max_abs_diff),
                   ", \"max_lse_diff\": ", Number(e.max_lse_diff), ", \"bound\": ", Number(e.bound),
                   ", \"match\": ", e.max_abs_diff <= e.bound ? "true" : "false", "}")
          .c_str());
}

}  // namespace

int RunExplainCommand() {
  Options opt;
  opt.q_block = absl::GetFlag(FLAGS_q_block);
  opt.kv_tile = absl::GetFlag(FLAGS_kv_tile);
  opt.seqlen = absl::GetFlag(FLAGS_seqlen);
  opt.head_dim = absl::GetFlag(FLAGS_head_dim);
  opt.causal = absl::GetFlag(FLAGS_causal);
  opt.seed = absl::GetFlag(FLAGS_seed);
  std::string error;
  if (opt.seqlen < 1 || opt.seqlen > 4096) {
    error = absl::StrCat("--seqlen: ", opt.seqlen, " tokens; explain takes 1 to 4096");
  } else if (opt.q_block < 1 || opt.q_block > std::min<int64_t>(attn::cpu::kBlockQ, opt.seqlen)) {
    error = absl::StrCat("--q_block: ", opt.q_block, " rows; 1 to ", attn::cpu::kBlockQ,
                         " (the engine's block) and at most --seqlen (", opt.seqlen, ")");
  } else if (opt.kv_tile < 1 || opt.kv_tile > attn::cpu::kBlockK) {
    error = absl::StrCat("--kv_tile: ", opt.kv_tile, " keys; 1 to ", attn::cpu::kBlockK,
                         " (the engine's tile)");
  }
  if (error.empty()) {
    absl::StatusOr<Explanation> e = Explain(opt);
    if (!e.ok()) {
      error = std::string(e.status().message());
    } else {
      if (absl::GetFlag(FLAGS_json)) {
        PrintJson(*e);
      } else {
        PrintText(*e);
      }
      return e->max_abs_diff <= e->bound ? 0 : 1;
    }
  }
  std::fprintf(stderr, "explain: %s\nRun with --help for the flags.\n", error.c_str());
  return 2;
}

}  // namespace attnserve::client
