// The fused engine's forward over paged K/V (attn/paged_kv.h) on the device: the decode kernel
// (packed GQA rows, split-KV, the combine) and the prefill kernel, against the float64
// reference of the same problem with dense K/V under the accuracy rule. Every sequence's blocks
// land in shuffled pages between poisoned spare pages, each page padded; O (with padded
// strides) and the LSE are poisoned before each call and checked fully written, O's padding
// untouched. Split counts and kernels are forced through the engine's test overrides so that
// the combine runs at 1 to more splits than pages, and both kernels see every kind of problem.
// GPU tests skip without a device; the support and plan tests answer without one.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "attn/paged_kv.h"
#include "common/accuracy.h"
#include "common/host_tensor.h"
#include "common/naive_attention.h"
#include "common/reference.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_buffer.h"
#include "cuda/cuda_engines.h"
#include "cuda/fused/capabilities.h"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/paged_forward.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"

namespace attn::testing {
namespace {

using cuda::PagedKernel;

// A problem's K and V in a device page pool: blocks in shuffled pages, `spare` poisoned pages
// mixed in, every page `pad` elements longer than its two blocks, the table's unused entries -1
// (or with `unused_to_spare` the index of a poisoned spare page, so that a kernel reading a slot
// past a sequence's blocks finds NaNs instead of faulting).
class DevicePages {
 public:
  static absl::StatusOr<DevicePages> Make(const AttentionProblem& p, const HostTensor& k,
                                          const HostTensor& v, int page_tokens, uint64_t seed,
                                          int spare = 3, int pad = 8,
                                          bool unused_to_spare = false) {
    DevicePages d;
    const int64_t es = DTypeSize(p.dtype);
    const int64_t row = PagedKV::TokenStride(p);
    d.kv_.page_tokens = page_tokens;
    d.kv_.page_stride = 2 * page_tokens * row + pad;
    int64_t total_blocks = 0;
    int most = 0;
    for (int b = 0; b < p.batch(); ++b) {
      const int blocks = static_cast<int>((p.seqlen_k(b) + page_tokens - 1) / page_tokens);
      total_blocks += blocks;
      most = std::max(most, blocks);
    }
    d.kv_.max_blocks = most + 1;  // a column never read
    d.kv_.num_pages = total_blocks + spare;
    std::vector<int32_t> order(static_cast<size_t>(d.kv_.num_pages));
    std::iota(order.begin(), order.end(), 0);
    std::mt19937_64 random(seed);
    std::shuffle(order.begin(), order.end(), random);

    HostTensor poison(p.dtype, 1, 1, 1);
    poison.Poison();
    std::vector<uint8_t> pool(static_cast<size_t>(d.kv_.num_pages * d.kv_.page_stride * es));
    for (size_t i = 0; i < pool.size(); i += es) std::memcpy(&pool[i], poison.data(), es);
    const int32_t unused =
        unused_to_spare && spare > 0 ? order[static_cast<size_t>(total_blocks)] : -1;
    std::vector<int32_t> table(static_cast<size_t>(p.batch()) * d.kv_.max_blocks, unused);
    const int64_t v_offset = d.kv_.v_offset(p);
    const size_t row_bytes = static_cast<size_t>(row * es);
    int64_t next = 0;
    for (int b = 0; b < p.batch(); ++b) {
      for (int64_t t = 0; t < p.seqlen_k(b); ++t) {
        if (t % page_tokens == 0) {
          table[b * d.kv_.max_blocks + t / page_tokens] = order[static_cast<size_t>(next++)];
        }
        const int64_t page = table[b * d.kv_.max_blocks + t / page_tokens];
        const int64_t at = page * d.kv_.page_stride + (t % page_tokens) * row;
        const int64_t src = p.cu_seqlens_k[b] + t;  // packed [token, kv_head, d]
        std::memcpy(&pool[at * es], static_cast<const uint8_t*>(k.data()) + src * row_bytes,
                    row_bytes);
        std::memcpy(&pool[(at + v_offset) * es],
                    static_cast<const uint8_t*>(v.data()) + src * row_bytes, row_bytes);
      }
    }
    ATTN_ASSIGN_OR_RETURN(d.pool_, cuda::DeviceBuffer::Allocate(pool.size()));
    ATTN_ASSIGN_OR_RETURN(d.table_, cuda::DeviceBuffer::Allocate(table.size() * 4));
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(d.pool_.get(), pool.data(), pool.size(), cudaMemcpyHostToDevice));
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(d.table_.get(), table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    d.kv_.pages = d.pool_.get();
    d.kv_.block_table = d.table_.as<int32_t>();
    return d;
  }

  const PagedKV& kv() const { return kv_; }

 private:
  cuda::DeviceBuffer pool_, table_;
  PagedKV kv_;
};

struct PagedCase {
  std::string name;
  AttentionProblem problem;
  int page_tokens = 16;
  PagedKernel kernel = PagedKernel::kAuto;  // forced kernel, or the plan's
  int splits = 0;                           // forced decode splits, or the heuristic's
  bool with_lse = true;
  // The prefill kernel pinned (kPortable: the mma.sync one on Hopper too; kSm90Lockstep,
  // kSm90Tma: the Hopper ones, whose cases skip off Hopper), or the launch's choice.
  cuda::FusedKernel prefill = cuda::FusedKernel::kAuto;
  int persistent_ctas = 0;       // the TMA prefill's CTAs, or one an SM
  bool unused_to_spare = false;  // DevicePages::Make
};

void PrintTo(const PagedCase& c, std::ostream* os) {
  *os << c.name << " (" << c.problem.DebugString() << " page_tokens=" << c.page_tokens << ")";
}

AttentionProblem Varlen(DType t, std::vector<int64_t> q, std::vector<int64_t> k, int heads,
                        int kv_heads, int d, bool causal) {
  return VarlenProblem(t, q, k, heads, kv_heads, d, causal);
}

// Key lengths of `n` sessions between 0 and `most`, every few of them empty.
std::vector<int64_t> SessionLengths(int n, int64_t most) {
  std::vector<int64_t> lengths(n);
  for (int i = 0; i < n; ++i) lengths[i] = i % 11 == 5 ? 0 : (int64_t{i} * 7919 + 13) % (most + 1);
  return lengths;
}

// The warp-specialised prefill pinned (FusedForwardParams::kernel = kSm90Tma) and forced as
// the plan's kernel, over every page size it takes (8 tokens, a box of one swizzle atom, to 256:
// smaller than, equal to and larger than its 128- and 64-key tiles) and every head dim: ragged
// batches whose key lengths end inside pages, on page and tile edges, with sequences without
// queries or without keys; uniform batches (the Q map's other coordinates); GQA 1, 4, 8 and MQA;
// windows; rings wrapped many times; q longer than k; without the LSE; table slots past the
// sequences naming a poisoned page; a decode-sized call.
void AddTmaPrefillCases(std::vector<PagedCase>& cases) {
  const auto add = [&](std::string name, AttentionProblem problem, int page) {
    PagedCase c{absl::StrCat("tma_", name), std::move(problem), page};
    c.kernel = PagedKernel::kPrefill;
    c.prefill = cuda::FusedKernel::kSm90Tma;
    cases.push_back(std::move(c));
    return &cases.back();
  };
  const int pages[] = {8, 16, 32, 64, 128, 256};
  const int dims[] = {64, 96, 128, 256};
  for (int pi = 0; pi < 6; ++pi) {
    for (int di = 0; di < 4; ++di) {
      const bool causal = (pi + di) % 2 == 0;
      const DType t = (pi + di / 2) % 2 == 0 ? DType::kBF16 : DType::kF16;
      add(absl::StrCat("ragged_p", pages[pi], "_d", dims[di], causal ? "_causal" : "",
                       t == DType::kBF16 ? "_bf16" : "_f16"),
          Varlen(t, {160, 1, 33, 129, 0, 7, 200}, {1013, 177, 33, 256, 40, 0, 129}, 8, 2, dims[di],
                 causal),
          pages[pi]);
    }
  }
  // Key lengths from 1 to 257 on and beside the edges of 8-row boxes, pages and 64- and 128-key
  // tiles, 1 to 17 query rows each.
  for (int page : {8, 16, 128, 256}) {
    for (int d : {64, 256}) {
      add(absl::StrCat("edges_p", page, "_d", d),
          Varlen(DType::kBF16, {17, 1, 9, 16, 17, 5, 3, 2, 1}, {1, 7, 8, 9, 63, 64, 65, 128, 257},
                 4, 2, d, false),
          page);
    }
  }
  for (int page : {16, 128}) {
    for (bool causal : {false, true}) {
      add(absl::StrCat("uniform_p", page, causal ? "_causal" : "", "_d128"),
          DenseProblem(DType::kBF16, 3, 200, 777, 8, 8, 128, causal), page);
      add(absl::StrCat("uniform_p", page, causal ? "_causal" : "", "_d64_f16"),
          DenseProblem(DType::kF16, 2, 256, 256, 4, 1, 64, causal), page);
    }
  }
  add("mqa16_p64_d128", Varlen(DType::kF16, {177, 64}, {1013, 300}, 16, 1, 128, true), 64);
  add("gqa4_32x8_p16_d64", Varlen(DType::kBF16, {130, 5}, {500, 4099}, 32, 8, 64, true), 16);
  add("gqa8_p8_d96", Varlen(DType::kBF16, {129}, {1000}, 16, 2, 96, false), 8);
  for (int page : {16, 256}) {
    for (int d : {64, 128}) {
      add(absl::StrCat("long_p", page, "_d", d),
          Varlen(DType::kBF16, {256, 129}, {4099, 2048}, 2, 1, d, page == 16), page);
    }
  }
  add("long_p32_d256", Varlen(DType::kF16, {200}, {3001}, 4, 4, 256, true), 32);
  // Three persistent CTAs, each walking many query blocks of different sequences and heads:
  // the rings, Q's buffer and the consumers' turns carried from block to block.
  for (int page : {16, 128}) {
    for (int d : {64, 128}) {
      add(absl::StrCat("ctas3_ragged_p", page, "_d", d),
          Varlen(DType::kBF16, {160, 1, 33, 129, 0, 7, 200}, {1013, 177, 33, 256, 40, 0, 129}, 8, 2,
                 d, page == 16),
          page)
          ->persistent_ctas = 3;
    }
  }
  AttentionProblem window = Varlen(DType::kBF16, {300, 40}, {1013, 1013}, 8, 2, 128, true);
  window.window_left = 100;
  add("window100_p16", window, 16);
  AttentionProblem two_sided = Varlen(DType::kF16, {177, 64}, {1013, 100}, 4, 4, 64, false);
  two_sided.window_left = 64;
  two_sided.window_right = 16;
  add("window64_16_p128", two_sided, 128);
  add("window64_16_p8", two_sided, 8);
  add("q_longer_than_k_p16", Varlen(DType::kF16, {300, 40}, {100, 3}, 8, 2, 128, true), 16);
  add("no_lse_p64", Varlen(DType::kBF16, {300}, {777}, 8, 2, 128, true), 64)->with_lse = false;
  for (int page : {8, 64, 256}) {
    add(absl::StrCat("spare_in_unused_slots_p", page),
        Varlen(DType::kBF16, {100, 33, 64}, {77, 33, 1}, 8, 2, 128, false), page)
        ->unused_to_spare = true;
  }
  add("decode_sized_p16", Varlen(DType::kBF16, {1, 1, 2}, {1013, 9, 300}, 8, 2, 128, true), 16);
  add("all_empty_p16", Varlen(DType::kBF16, {3, 2}, {0, 0}, 8, 2, 64, true), 16);
}

std::vector<PagedCase> Cases() {
  std::vector<PagedCase> cases;
  const auto add = [&](PagedCase c) { cases.push_back(std::move(c)); };

  // The CPU suite's cases (tests/cpu/paged_test.cc), in the dtypes and head dims the fused
  // kernels cover.
  const AttentionProblem cpu_decode =
      Varlen(DType::kBF16, {1, 1, 1, 1}, {1, 17, 100, 257}, 8, 2, 64, true);
  add({"cpu_decode_bf16_gqa4_p16", cpu_decode, 16});
  add({"cpu_decode_bf16_gqa4_p1", cpu_decode, 1});
  add({"cpu_prefill_f16_causal_p16", Varlen(DType::kF16, {7, 33}, {40, 177}, 4, 4, 32, true), 16});
  AttentionProblem cpu_window = Varlen(DType::kBF16, {5, 1}, {64, 1013}, 6, 3, 96, true);
  cpu_window.window_left = 50;
  add({"cpu_window_bf16_p64", cpu_window, 64});
  add({"cpu_empty_sequence_f16_p4", Varlen(DType::kF16, {3, 2}, {0, 9}, 2, 1, 32, false), 4});
  add({"cpu_mqa_bf16_p32_d128", Varlen(DType::kBF16, {2}, {300}, 16, 1, 128, false), 32});

  // Decode steps: odd context lengths at every page size, GQA 1, 4, 8 and MQA.
  const int groups[] = {1, 4, 8};
  int round = 0;
  for (int64_t len : {1, 17, 177, 1013, 4099}) {
    for (int page : {1, 16, 64, 256}) {
      const int g = groups[round++ % 3];
      const DType t = round % 2 ? DType::kBF16 : DType::kF16;
      const int d = round % 3 == 2 ? 64 : 128;
      add({absl::StrCat("decode_len", len, "_g", g, "_p", page, "_d", d,
                        t == DType::kBF16 ? "_bf16" : "_f16"),
           Varlen(t, {1, 1, 1}, {len, std::max<int64_t>(1, len - 5), len / 3}, 2 * g, 2, d, true),
           page});
    }
  }
  add({"decode_mqa_len1013_p16", Varlen(DType::kBF16, {1, 1}, {1013, 4099}, 8, 1, 128, true), 16});
  add({"decode_mqa32_len177_p64", Varlen(DType::kF16, {1}, {177}, 32, 1, 64, true), 64});
  // Every head dim of the table, decode and prefill.
  for (int d : {32, 64, 96, 128, 256}) {
    add({absl::StrCat("decode_d", d, "_len1013_p16"),
         Varlen(DType::kBF16, {1, 1}, {1013, 177}, 8, 2, d, true), 16});
    add({absl::StrCat("prefill_d", d, "_causal_p64"),
         Varlen(DType::kF16, {177, 33}, {1013, 33}, 4, 2, d, true), 64});
  }

  // Batches of 1 to 256 sessions of different lengths (some empty), 32/8 heads, d = 128.
  for (int n : {1, 7, 64, 256}) {
    const int64_t most = n >= 64 ? 300 : 2000;
    add({absl::StrCat("batch", n, "_p16"),
         Varlen(DType::kBF16, std::vector<int64_t>(n, 1), SessionLengths(n, most), 32, 8, 128,
                true),
         n == 256 ? 64 : 16});
  }

  // Forced split counts: the combine at 1, 2, 3, 7, 64 splits, and more splits than pages (the
  // 4099-key session holds 17 pages of 256, 257 of 16); empty sessions in the batch.
  const AttentionProblem split_problem =
      Varlen(DType::kBF16, {1, 1, 1, 1}, {1013, 77, 0, 4099}, 32, 8, 128, true);
  for (int splits : {1, 2, 3, 7, 64, 300}) {
    for (int page : {16, 256}) {
      PagedCase c{absl::StrCat("splits", splits, "_p", page), split_problem, page};
      c.kernel = PagedKernel::kDecode;
      c.splits = splits;
      add(c);
    }
  }
  PagedCase no_lse{"splits7_without_lse", split_problem, 64};
  no_lse.splits = 7;
  no_lse.with_lse = false;
  add(no_lse);

  // Causal decode with several query tokens (packed rows 8, 12, 20 and 64: 1 to 4 row tiles),
  // windows, a step longer than its cache.
  for (int64_t q : {2, 3, 5, 16}) {
    add({absl::StrCat("decode_q", q, "_causal_p16"),
         Varlen(DType::kBF16, {q, q}, {40, 1013}, 8, 2, 128, true), 16});
  }
  AttentionProblem window = Varlen(DType::kBF16, {3, 1, 4}, {1013, 4099, 177}, 32, 8, 128, true);
  window.window_left = 100;
  add({"decode_window100_p16", window, 16});
  PagedCase window_split{"decode_window100_splits5_p64", window, 64};
  window_split.splits = 5;
  add(window_split);
  AttentionProblem two_sided = Varlen(DType::kF16, {4, 4}, {300, 64}, 16, 4, 64, false);
  two_sided.window_left = 20;
  two_sided.window_right = 3;
  add({"decode_window20_3_p1", two_sided, 1});
  add({"decode_q_longer_than_k_p16", Varlen(DType::kF16, {6}, {3}, 8, 2, 64, true), 16});
  add({"decode_all_empty_p16", Varlen(DType::kBF16, {1, 2}, {0, 0}, 8, 2, 128, true), 16});
  add({"decode_no_queries_p16", Varlen(DType::kBF16, {0, 1, 0}, {5, 9, 0}, 8, 2, 128, true), 16});

  // Prefill chunks over longer caches at every page size (one page per tile, several).
  for (int page : {1, 16, 64, 128, 256}) {
    add({absl::StrCat("prefill_causal_p", page),
         Varlen(DType::kBF16, {300, 1, 33}, {1013, 177, 33}, 8, 2, 128, true), page});
  }
  // The portable (mma.sync) prefill, which Hopper runs only for head dims without wgmma, and
  // the lockstep wgmma one, which it runs where the warp-specialised one cannot.
  for (int page : {16, 128}) {
    for (int d : {64, 128}) {
      PagedCase c{absl::StrCat("prefill_portable_d", d, "_p", page),
                  Varlen(DType::kBF16, {300, 1, 33}, {1013, 177, 33}, 8, 2, d, true), page};
      c.prefill = cuda::FusedKernel::kPortable;
      add(c);
    }
  }
  for (int page : {1, 16, 128, 256}) {
    for (int d : {64, 128}) {
      PagedCase c{absl::StrCat("prefill_lockstep_d", d, "_p", page),
                  Varlen(DType::kF16, {300, 1, 33}, {1013, 177, 33}, 8, 2, d, page % 2 == 0), page};
      c.prefill = cuda::FusedKernel::kSm90Lockstep;
      add(c);
    }
  }
  AddTmaPrefillCases(cases);
  AttentionProblem prefill_window = Varlen(DType::kF16, {177}, {1013}, 4, 4, 64, false);
  prefill_window.window_left = 64;
  prefill_window.window_right = 16;
  add({"prefill_window_p16", prefill_window, 16});
  // Pages the warp-specialised prefill refuses (fewer than 8 tokens) run on the next kernel
  // without a word: the lockstep one at 64 and 128, the portable one at 96.
  for (int page : {1, 2, 4}) {
    for (int d : {64, 96, 128}) {
      PagedCase c{absl::StrCat("prefill_refused_by_tma_p", page, "_d", d),
                  Varlen(DType::kBF16, {300, 17}, {1013, 40}, 8, 2, d, page != 2), page};
      c.kernel = PagedKernel::kPrefill;
      add(c);
    }
  }

  // Each kernel on the other's problems.
  PagedCase decode_on_prefill{"decode_kernel_on_prefill",
                              Varlen(DType::kF16, {177, 33}, {1013, 33}, 4, 2, 64, true), 16};
  decode_on_prefill.kernel = PagedKernel::kDecode;
  add(decode_on_prefill);
  PagedCase decode_tiles{"decode_kernel_q33_g2_splits3",
                         Varlen(DType::kBF16, {33, 2}, {1013, 40}, 8, 4, 128, true), 16};
  decode_tiles.kernel = PagedKernel::kDecode;
  decode_tiles.splits = 3;
  add(decode_tiles);
  PagedCase prefill_on_decode{"prefill_kernel_on_decode", split_problem, 16};
  prefill_on_decode.kernel = PagedKernel::kPrefill;
  add(prefill_on_decode);
  return cases;
}

class CudaPagedTest : public ::testing::TestWithParam<PagedCase> {
 protected:
  void SetUp() override { ATTN_SKIP_WITHOUT_CUDA(); }
};

// Runs `engine` on the case with fresh inputs and checks O and the LSE.
void RunAndCheck(Engine& engine, const PagedCase& c, uint64_t seed) {
  const AttentionProblem& p = c.problem;
  SCOPED_TRACE(absl::StrCat("seed=", seed, " (replay with ATTN_TEST_SEED) ", p.DebugString(),
                            " page_tokens=", c.page_tokens));
  AttentionTensors t;
  t.q = HostTensor(p.dtype, p.total_q(), p.num_heads, p.head_dim, 8, 8);
  t.k = HostTensor(p.dtype, p.total_k(), p.num_kv_heads, p.head_dim);
  t.v = HostTensor(p.dtype, p.total_k(), p.num_kv_heads, p.head_dim);
  t.o = HostTensor(p.dtype, p.total_q(), p.num_heads, p.head_dim, 8, 8);
  t.lse.assign(static_cast<size_t>(p.total_q() * p.num_heads), 0.f);
  t.q.FillRandom(seed);
  t.k.FillRandom(seed + 1);
  t.v.FillRandom(seed + 2);
  auto ref = RunReference(p, t, /*backward=*/false);
  ASSERT_TRUE(ref.ok()) << ref.status();

  auto pages = DevicePages::Make(p, t.k, t.v, c.page_tokens, seed + 3, /*spare=*/3, /*pad=*/8,
                                 c.unused_to_spare);
  ASSERT_TRUE(pages.ok()) << pages.status();
  t.o.Poison();
  PoisonFloats(t.lse);
  auto device = DeviceForward::Upload(t);
  ASSERT_TRUE(device.ok()) << device.status();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const ForwardArgs dense = device->args(stream, c.with_lse);
  PagedForwardArgs args;
  args.q = dense.q;
  args.kv = pages->kv();
  args.o = dense.o;
  args.lse = dense.lse;
  args.stream = stream;
  ASSERT_TRUE(engine.SupportsPagedForward(p).ok()) << engine.SupportsPagedForward(p);
  const absl::Status run = engine.ForwardPaged(p, args);
  const absl::Status download = device->Download(t);
  cudaStreamDestroy(stream);
  ASSERT_TRUE(run.ok()) << run;
  ASSERT_TRUE(download.ok()) << download;

  EXPECT_EQ(t.o.CountPoisoned(), 0) << "O elements never written";
  EXPECT_EQ(t.o.CountPaddingWritten(), 0) << "O padding overwritten";
  const NaiveForwardResult naive = NaiveForward(p, t.q, t.k, t.v);
  const absl::Status o_ok = CheckAccuracy("O", p.dtype, t.o.ToDouble(), ref->o, &naive.o);
  EXPECT_TRUE(o_ok.ok()) << o_ok.message();
  if (c.with_lse) {
    EXPECT_EQ(CountPoisonedFloats(t.lse), 0) << "LSE elements never written";
    const absl::Status lse_ok = CheckLse(t.lse, ref->lse);
    EXPECT_TRUE(lse_ok.ok()) << lse_ok.message();
  } else {
    EXPECT_EQ(CountPoisonedFloats(t.lse), static_cast<int64_t>(t.lse.size()))
        << "the LSE was written though not asked for";
  }
}

std::unique_ptr<Engine> PagedEngine(const PagedCase& c) {
  cuda::PagedOverrides overrides;
  overrides.kernel = c.kernel;
  overrides.decode_splits = c.splits;
  auto engine = MakeCudaFusedEngine(EngineOptions{}, c.prefill, overrides, /*forward_block_n=*/0,
                                    c.persistent_ctas);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

// Whether the current device is a Hopper GPU (compute capability 9.x), where the Hopper prefill
// kernels must run when pinned (the build holds sm_90a code: CMAKE_CUDA_ARCHITECTURES 90a).
bool OnHopper() {
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         major == 9;
}

bool PinsHopperPrefill(const PagedCase& c) {
  return c.prefill == cuda::FusedKernel::kSm90Lockstep || c.prefill == cuda::FusedKernel::kSm90Tma;
}

TEST_P(CudaPagedTest, MatchesReference) {
  const PagedCase& c = GetParam();
  if (PinsHopperPrefill(c) && !OnHopper()) GTEST_SKIP() << "a Hopper prefill kernel pinned";
  std::unique_ptr<Engine> engine = PagedEngine(c);
  ASSERT_NE(engine, nullptr);
  const uint64_t seed = FreshSeed();
  RunAndCheck(*engine, c, seed);
  // Again on the warmed engine (its workspace is reused) with fresh inputs.
  RunAndCheck(*engine, c, seed + 10);
}

INSTANTIATE_TEST_SUITE_P(Paged, CudaPagedTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<PagedCase>& info) {
                           return info.param.name;
                         });

// One engine, problems of growing and shrinking workspace in turn.
TEST(CudaPaged, WorkspaceRegrowsBetweenProblems) {
  ATTN_SKIP_WITHOUT_CUDA();
  auto engine = MakeCudaFusedEngine(EngineOptions{});
  ASSERT_TRUE(engine.ok()) << engine.status();
  const uint64_t seed = FreshSeed();
  for (int64_t len : {177, 4099, 17, 4099}) {
    PagedCase c{"regrow", Varlen(DType::kBF16, {1, 1}, {len, len / 2}, 32, 8, 128, true), 16};
    RunAndCheck(**engine, c, seed + len);
  }
}

// Misaligned pages are refused by name, not read.
TEST(CudaPaged, RefusesMisalignedPages) {
  ATTN_SKIP_WITHOUT_CUDA();
  const PagedCase c{"misaligned", Varlen(DType::kBF16, {1}, {40}, 4, 2, 64, true), 16};
  const AttentionProblem& p = c.problem;
  AttentionTensors t;
  t.q = HostTensor(p.dtype, p.total_q(), p.num_heads, p.head_dim);
  t.k = HostTensor(p.dtype, p.total_k(), p.num_kv_heads, p.head_dim);
  t.v = HostTensor(p.dtype, p.total_k(), p.num_kv_heads, p.head_dim);
  t.o = HostTensor(p.dtype, p.total_q(), p.num_heads, p.head_dim);
  t.lse.assign(static_cast<size_t>(p.total_q() * p.num_heads), 0.f);
  auto pages = DevicePages::Make(p, t.k, t.v, c.page_tokens, 1, 3, /*pad=*/3);
  ASSERT_TRUE(pages.ok()) << pages.status();
  auto device = DeviceForward::Upload(t);
  ASSERT_TRUE(device.ok()) << device.status();
  auto engine = MakeCudaFusedEngine(EngineOptions{});
  ASSERT_TRUE(engine.ok()) << engine.status();
  PagedForwardArgs args;
  args.q = device->args().q;
  args.o = device->args().o;
  args.kv = pages->kv();
  const absl::Status s = (*engine)->ForwardPaged(p, args);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "kv.pages")) << s;
}

// A pinned Hopper prefill kernel that cannot run answers UNIMPLEMENTED and writes nothing:
// the warp-specialised one on pages of fewer than 8 tokens and at head_dim 32 (no such row),
// the lockstep one at 96 (no such row).
TEST(CudaPaged, PinnedPrefillRefusesWhatItCannotRun) {
  ATTN_SKIP_WITHOUT_CUDA();
  if (!OnHopper()) GTEST_SKIP() << "the Hopper prefill kernels";
  struct Refused {
    cuda::FusedKernel kernel;
    int head_dim, page_tokens;
  };
  for (const Refused& r :
       {Refused{cuda::FusedKernel::kSm90Tma, 128, 4}, Refused{cuda::FusedKernel::kSm90Tma, 64, 1},
        Refused{cuda::FusedKernel::kSm90Tma, 32, 16},
        Refused{cuda::FusedKernel::kSm90Lockstep, 96, 16}}) {
    const AttentionProblem p = Varlen(DType::kBF16, {200}, {300}, 4, 2, r.head_dim, true);
    SCOPED_TRACE(absl::StrCat(p.DebugString(), " page_tokens=", r.page_tokens));
    AttentionTensors t;
    t.q = HostTensor(p.dtype, p.total_q(), p.num_heads, p.head_dim);
    t.k = HostTensor(p.dtype, p.total_k(), p.num_kv_heads, p.head_dim);
    t.v = HostTensor(p.dtype, p.total_k(), p.num_kv_heads, p.head_dim);
    t.o = HostTensor(p.dtype, p.total_q(), p.num_heads, p.head_dim);
    t.lse.assign(static_cast<size_t>(p.total_q() * p.num_heads), 0.f);
    t.q.FillRandom(1);
    t.k.FillRandom(2);
    t.v.FillRandom(3);
    t.o.Poison();
    auto pages = DevicePages::Make(p, t.k, t.v, r.page_tokens, 4);
    ASSERT_TRUE(pages.ok()) << pages.status();
    auto device = DeviceForward::Upload(t);
    ASSERT_TRUE(device.ok()) << device.status();
    cuda::PagedOverrides overrides;
    overrides.kernel = PagedKernel::kPrefill;
    auto engine = MakeCudaFusedEngine(EngineOptions{}, r.kernel, overrides);
    ASSERT_TRUE(engine.ok()) << engine.status();
    PagedForwardArgs args;
    args.q = device->args().q;
    args.o = device->args().o;
    args.kv = pages->kv();
    const absl::Status s = (*engine)->ForwardPaged(p, args);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    ASSERT_TRUE(device->Download(t).ok());
    EXPECT_EQ(t.o.CountPoisoned(), p.total_q() * p.num_heads * p.head_dim) << "O was written";
  }
}

// ---- Without a device: what the engines answer, and the plan.

Support Paged(EngineKind kind, const AttentionProblem& p) {
  return EngineSupports(kind, Pass::kPagedForward, p);
}

TEST(PagedSupport, FusedCoversTheTablesRows) {
  for (const FusedCapability& row : FusedCapabilities()) {
    if (row.pass != Pass::kPagedForward) continue;
    const AttentionProblem p = Varlen(row.dtype, {1}, {9}, 4, 2, row.head_dim, true);
    EXPECT_TRUE(Paged(EngineKind::kCudaFused, p).ok()) << p.DebugString();
  }
  for (DType t : {DType::kF16, DType::kBF16}) {
    for (int d : {32, 64, 96, 128, 256}) {
      EXPECT_TRUE(cuda::HasFusedKernel(Pass::kPagedForward, t, d)) << DTypeName(t) << " " << d;
      // The Hopper prefill kernels: lockstep at 64 and 128, warp-specialised from 64 up.
      EXPECT_EQ(cuda::HasFusedKernel(Pass::kPagedForward, t, d, cuda::kSm90a), d == 64 || d == 128)
          << DTypeName(t) << " " << d;
      EXPECT_EQ(cuda::HasFusedKernel(Pass::kPagedForward, t, d, cuda::kSm90aTma), d >= 64)
          << DTypeName(t) << " " << d;
    }
  }
}

TEST(PagedSupport, RefusalsNameWhatIsMissing) {
  AttentionProblem p = Varlen(DType::kF32, {1}, {9}, 4, 2, 64, true);
  Support s = Paged(EngineKind::kCudaFused, p);
  EXPECT_EQ(s.reason(), Refusal::kUnsupportedDtype) << s;
  EXPECT_TRUE(absl::StrContains(s.status().message(), "paged dtype float32")) << s;
  p.dtype = DType::kBF16;
  p.head_dim = 80;
  s = Paged(EngineKind::kCudaFused, p);
  EXPECT_EQ(s.reason(), Refusal::kUnsupportedHeadDim) << s;
  EXPECT_TRUE(absl::StrContains(s.status().message(), "paged head_dim 80")) << s;
  EXPECT_EQ(Paged(EngineKind::kCudaNaive, Varlen(DType::kBF16, {1}, {9}, 4, 2, 64, true)).reason(),
            Refusal::kOther);
  const AttentionProblem big = DenseProblem(DType::kBF16, 65536, 1, 1, 1, 1, 64);
  EXPECT_EQ(Paged(EngineKind::kCudaFused, big).reason(), Refusal::kTooLarge);
  p.num_heads = 3;
  EXPECT_EQ(Paged(EngineKind::kCudaFused, p).reason(), Refusal::kInvalidProblem);
}

TEST(PagedSupport, RealEngineAnswersAsTheRegistry) {
  ATTN_SKIP_WITHOUT_CUDA();
  auto fused = MustCreate(EngineKind::kCudaFused);
  auto naive = MustCreate(EngineKind::kCudaNaive);
  ASSERT_NE(fused, nullptr);
  ASSERT_NE(naive, nullptr);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int d : {64, 80, 128}) {
      const AttentionProblem p = Varlen(t, {1}, {9}, 4, 2, d, true);
      EXPECT_EQ(fused->SupportsPagedForward(p).reason(), Paged(EngineKind::kCudaFused, p).reason());
      EXPECT_EQ(naive->SupportsPagedForward(p).reason(), Refusal::kOther);
    }
  }
}

cuda::PagedForwardPlan Plan(const AttentionProblem& p, const cuda::PagedOverrides& o = {}) {
  return cuda::PlanPagedForward(p, cuda::PagedDevice{132, 228 << 10}, o);
}

TEST(PagedPlan, DecodeForFewRowsPrefillForMany) {
  // 32/8 heads: 4 rows per query token.
  EXPECT_EQ(Plan(DenseProblem(DType::kBF16, 8, 1, 4096, 32, 8, 128)).kernel, PagedKernel::kDecode);
  EXPECT_EQ(Plan(DenseProblem(DType::kBF16, 8, 16, 4096, 32, 8, 128)).kernel, PagedKernel::kDecode);
  EXPECT_EQ(Plan(DenseProblem(DType::kBF16, 8, 17, 4096, 32, 8, 128)).kernel,
            PagedKernel::kPrefill);
  EXPECT_EQ(Plan(DenseProblem(DType::kBF16, 8, 5, 4096, 32, 8, 128)).m_blocks, 2);
  cuda::PagedOverrides prefill;
  prefill.kernel = PagedKernel::kPrefill;
  EXPECT_EQ(Plan(DenseProblem(DType::kBF16, 8, 1, 4096, 32, 8, 128), prefill).kernel,
            PagedKernel::kPrefill);
}

TEST(PagedPlan, SplitsFillTheDeviceAndCoverEveryStage) {
  // One session of 32k keys: 8 CTAs before splitting, on 132 SMs.
  const AttentionProblem one = DenseProblem(DType::kBF16, 1, 1, 32768, 32, 8, 128);
  const cuda::PagedForwardPlan plan = Plan(one);
  EXPECT_GT(plan.num_splits, 8);
  EXPECT_GE(int64_t{plan.num_splits} * plan.tiles_per_split,
            (32768 + cuda::PagedDecodeTileShape(128).block_n - 1) /
                cuda::PagedDecodeTileShape(128).block_n);
  EXPECT_EQ(plan.workspace_bytes, int64_t{plan.num_splits} * 32 * (128 + 1) * 4);
  EXPECT_EQ(plan.split_counters, 8);
  // 64 sessions x 8 KV heads = 512 CTAs already fill the device.
  EXPECT_EQ(Plan(DenseProblem(DType::kBF16, 64, 1, 4096, 32, 8, 128)).num_splits, 1);
  EXPECT_EQ(Plan(DenseProblem(DType::kBF16, 64, 1, 4096, 32, 8, 128)).workspace_bytes, 0);
  // Too short to split.
  EXPECT_EQ(Plan(DenseProblem(DType::kBF16, 1, 1, 256, 32, 8, 128)).num_splits, 1);
  // Forced.
  cuda::PagedOverrides forced;
  forced.decode_splits = 300;
  const cuda::PagedForwardPlan many = Plan(one, forced);
  EXPECT_EQ(many.num_splits, 300);
  EXPECT_EQ(many.tiles_per_split, 2);
}

TEST(PagedPlan, SplitHeuristicFillsOneWave) {
  EXPECT_EQ(cuda::PagedDecodeSplits(/*ctas=*/264, /*tiles=*/512, /*slots=*/264), 1);
  EXPECT_EQ(cuda::PagedDecodeSplits(512, 512, 264), 1);
  EXPECT_EQ(cuda::PagedDecodeSplits(8, 4, 264), 1);     // too few stages to split
  EXPECT_EQ(cuda::PagedDecodeSplits(8, 64, 264), 16);   // 4 stages a split at most
  EXPECT_EQ(cuda::PagedDecodeSplits(8, 512, 264), 33);  // one full wave
  EXPECT_EQ(cuda::PagedDecodeSplits(128, 512, 264), 2);
  EXPECT_EQ(cuda::PagedDecodeSplits(200, 512, 264), 1);  // a second wave would be partial
  EXPECT_EQ(cuda::PagedDecodeSplits(1, 1 << 20, 264), cuda::kPagedDecodeMaxSplits);
}

}  // namespace
}  // namespace attn::testing
