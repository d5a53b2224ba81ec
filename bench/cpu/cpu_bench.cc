// attn_cpu_bench: throughput and peak scratch memory of the CPU tiled engine (forward and
// backward) against a naive CPU attention that materialises S and P, over sequence lengths.
//
// Naive: float32, S = Q K^T and P = softmax(S) held as a full N x N matrix per head, then O = P V;
// heads are spread over the same number of threads as the engine; its loops are written in the
// same vectorisable style as the tiled engine's, so the comparison isolates the algorithm (the N^2
// round trip through memory), not loop quality. It stops at --naive_max_n.
//
// Memory: every operator new in this program is counted; "peak MiB" is the highest number of
// heap bytes live during one call above what was live before it (inputs and outputs excluded,
// the engine's scratch and the naive's S/P and float copies included).
//
// FLOPs: forward 4 N^2 d heads (two matrix products), backward 2.5x that; non-causal.
// Rates are given per wall-clock second and per CPU-second of the process (all threads): on a
// shared machine the second says what the code does with the core time it actually received.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "attn/dtype.h"
#include "attn/engine.h"

namespace {

// ---- Heap accounting: a 16-byte header before each block records its size.
std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};

void* CountedAlloc(size_t n) {
  void* raw = std::malloc(n + 16);
  if (raw == nullptr) throw std::bad_alloc();
  std::memcpy(raw, &n, sizeof(n));
  const int64_t live = g_live.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
  int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return static_cast<char*>(raw) + 16;
}

void CountedFree(void* p) {
  if (p == nullptr) return;
  char* raw = static_cast<char*>(p) - 16;
  size_t n;
  std::memcpy(&n, raw, sizeof(n));
  g_live.fetch_sub(static_cast<int64_t>(n));
  std::free(raw);
}

}  // namespace

void* operator new(size_t n) { return CountedAlloc(n); }
void* operator new[](size_t n) { return CountedAlloc(n); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return CountedAlloc(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p) noexcept { CountedFree(p); }
void operator delete[](void* p) noexcept { CountedFree(p); }
void operator delete(void* p, size_t) noexcept { CountedFree(p); }
void operator delete[](void* p, size_t) noexcept { CountedFree(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { CountedFree(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { CountedFree(p); }

namespace {

using attn::DType;

struct Flags {
  std::vector<int64_t> lengths = {512, 1024, 2048, 4096, 8192};
  int64_t naive_max_n = 4096;
  int heads = 8;
  int head_dim = 64;
  int threads = 0;
  int repeats = 5;
  std::vector<DType> dtypes = {DType::kF32, DType::kBF16};
  bool deterministic = false;  // the backward in BackwardArgs::deterministic mode
};

double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Measurement {
  double wall_s;      // median wall-clock seconds per call
  double cpu_s;       // median process CPU seconds per call (all threads)
  double peak_bytes;  // largest extra heap bytes live during a call
};

// One warm-up call, then `repeats` measured calls.
template <typename Fn>
Measurement Measure(int repeats, Fn&& fn) {
  fn();
  std::vector<double> wall, cpu;
  int64_t peak_extra = 0;
  for (int r = 0; r < repeats; ++r) {
    const int64_t base = g_live.load();
    g_peak.store(base);
    const double c0 = ProcessCpuSeconds();
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    cpu.push_back(ProcessCpuSeconds() - c0);
    peak_extra = std::max(peak_extra, g_peak.load() - base);
    wall.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return {wall[wall.size() / 2], cpu[cpu.size() / 2], static_cast<double>(peak_extra)};
}

// The four table cells of one measurement: GFLOP/s (wall), GFLOP per CPU-second, ms, peak MiB.
std::string Cells(double flops, const Measurement& m) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "%.1f | %.1f | %.1f | %.1f", flops / m.wall_s * 1e-9,
                flops / m.cpu_s * 1e-9, m.wall_s * 1e3, m.peak_bytes / (1024.0 * 1024.0));
  return buf;
}

// The naive forward described at the top of the file. q, k, v and o are packed
// [N, heads, d] tensors of the dtype.
void NaiveForward(DType t, int64_t n, int heads, int d, int threads, const void* q, const void* k,
                  const void* v, void* o) {
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  auto head_worker = [&](int first_head) {
    std::vector<float> qf(n * d), kt(d * n), vf(n * d), s(n * n), acc(d);
    for (int h = first_head; h < heads; h += threads) {
      for (int64_t i = 0; i < n; ++i) {
        for (int c = 0; c < d; ++c) {
          const int64_t e = (i * heads + h) * d + c;
          qf[i * d + c] = attn::LoadAsFloat(q, t, e);
          kt[c * n + i] = attn::LoadAsFloat(k, t, e);
          vf[i * d + c] = attn::LoadAsFloat(v, t, e);
        }
      }
      for (int64_t i = 0; i < n; ++i) {  // S = scale Q K^T
        float* si = &s[i * n];
        std::fill(si, si + n, 0.f);
        for (int c = 0; c < d; ++c) {
          const float qc = qf[i * d + c] * scale;
          const float* ktc = &kt[c * n];
          for (int64_t j = 0; j < n; ++j) si[j] += qc * ktc[j];
        }
      }
      for (int64_t i = 0; i < n; ++i) {  // P = softmax(S) in place
        float* si = &s[i * n];
        float m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) m = std::max(m, si[j]);
        float l = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          si[j] = std::exp(si[j] - m);
          l += si[j];
        }
        for (int64_t j = 0; j < n; ++j) si[j] /= l;
      }
      for (int64_t i = 0; i < n; ++i) {  // O = P V
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < n; ++j) {
          const float pij = s[i * n + j];
          for (int c = 0; c < d; ++c) acc[c] += pij * vf[j * d + c];
        }
        for (int c = 0; c < d; ++c) attn::StoreFromFloat(o, t, (i * heads + h) * d + c, acc[c]);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < threads; ++w) pool.emplace_back(head_worker, w);
  head_worker(0);
  for (std::thread& th : pool) th.join();
}

std::vector<uint8_t> RandomTensor(DType t, int64_t elements, uint64_t seed) {
  std::vector<uint8_t> buf(elements * attn::DTypeSize(t));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < elements; ++i) attn::StoreFromFloat(buf.data(), t, i, normal(rng));
  return buf;
}

bool ParseFlags(int argc, char** argv, Flags& f) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string key = arg.substr(0, eq),
                      value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    bool ok = true;
    if (key == "--lengths") {
      f.lengths.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        int64_t n = 0;
        ok = ok && absl::SimpleAtoi(s, &n);
        f.lengths.push_back(n);
      }
    } else if (key == "--naive_max_n") {
      ok = absl::SimpleAtoi(value, &f.naive_max_n);
    } else if (key == "--heads") {
      ok = absl::SimpleAtoi(value, &f.heads);
    } else if (key == "--head_dim") {
      ok = absl::SimpleAtoi(value, &f.head_dim);
    } else if (key == "--threads") {
      ok = absl::SimpleAtoi(value, &f.threads);
    } else if (key == "--repeats") {
      ok = absl::SimpleAtoi(value, &f.repeats) && f.repeats > 0;
    } else if (key == "--deterministic") {
      f.deterministic = value.empty() || value == "true";
      ok = value.empty() || value == "true" || value == "false";
    } else if (key == "--dtypes") {
      f.dtypes.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        auto t = attn::ParseDType(std::string(s));
        ok = ok && t.ok();
        if (t.ok()) f.dtypes.push_back(*t);
      }
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "usage: attn_cpu_bench [--lengths=512,1024,...] [--naive_max_n=4096] "
                   "[--heads=8] [--head_dim=64] [--threads=0] [--repeats=5] "
                   "[--dtypes=float32,bfloat16] [--deterministic]\n(bad argument: %s)\n",
                   arg.c_str());
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  if (!ParseFlags(argc, argv, f)) return 2;
  attn::EngineOptions options;
  options.num_threads = f.threads;
  auto engine_or = attn::CreateEngine(attn::EngineKind::kCpuTiled, options);
  if (!engine_or.ok()) {
    std::fprintf(stderr, "%s\n", engine_or.status().ToString().c_str());
    return 1;
  }
  attn::Engine& engine = **engine_or;
  const int threads =
      f.threads > 0 ? f.threads : static_cast<int>(std::thread::hardware_concurrency());
  std::printf(
      "attn_cpu_bench: batch 1, %d heads, d = %d, non-causal, %d threads, median of %d "
      "after 1 warm-up%s\n",
      f.heads, f.head_dim, threads, f.repeats, f.deterministic ? ", deterministic backward" : "");
  std::printf(
      "Per engine: GFLOP/s (wall clock) | GFLOP per CPU-second (process CPU time, all threads: "
      "what the engine does per core it actually got) | ms per call | peak scratch MiB\n\n");
  std::printf(
      "| dtype | N | naive fwd GFLOP/s | naive fwd GFLOP/cpu-s | naive fwd ms | naive MiB | tiled "
      "fwd GFLOP/s | tiled fwd GFLOP/cpu-s | tiled fwd ms | tiled fwd MiB | tiled bwd GFLOP/s | "
      "tiled bwd GFLOP/cpu-s | tiled bwd ms | tiled bwd MiB |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (DType t : f.dtypes) {
    for (int64_t n : f.lengths) {
      const int h = f.heads, d = f.head_dim;
      const attn::AttentionProblem p = attn::DenseProblem(t, 1, n, n, h, h, d);
      const int64_t elements = n * h * d;
      auto q = RandomTensor(t, elements, 1), k = RandomTensor(t, elements, 2),
           v = RandomTensor(t, elements, 3), d_o = RandomTensor(t, elements, 4);
      std::vector<uint8_t> o(q.size()), dq(q.size()), dk(q.size()), dv(q.size());
      std::vector<float> lse(n * h);
      attn::ForwardArgs fa;
      fa.q = attn::Packed<const void*>(q.data(), h, d);
      fa.k = attn::Packed<const void*>(k.data(), h, d);
      fa.v = attn::Packed<const void*>(v.data(), h, d);
      fa.o = attn::Packed<void*>(o.data(), h, d);
      fa.lse = lse.data();
      attn::BackwardArgs ba;
      ba.q = fa.q;
      ba.k = fa.k;
      ba.v = fa.v;
      ba.o = attn::Packed<const void*>(o.data(), h, d);
      ba.d_o = attn::Packed<const void*>(d_o.data(), h, d);
      ba.lse = lse.data();
      ba.dq = attn::Packed<void*>(dq.data(), h, d);
      ba.dk = attn::Packed<void*>(dk.data(), h, d);
      ba.dv = attn::Packed<void*>(dv.data(), h, d);
      ba.deterministic = f.deterministic;

      const double fwd_flops = 4.0 * static_cast<double>(n) * n * d * h;
      const int repeats = n >= 4096 ? std::min(f.repeats, 3) : f.repeats;
      std::string naive_cells = "— | — | — | —";
      if (n <= f.naive_max_n) {
        std::vector<uint8_t> o_naive(o.size());
        naive_cells =
            Cells(fwd_flops, Measure(repeats, [&] {
                    NaiveForward(t, n, h, d, threads, q.data(), k.data(), v.data(), o_naive.data());
                  }));
      }
      bool failed = false;
      const Measurement fwd = Measure(repeats, [&] { failed |= !engine.Forward(p, fa).ok(); });
      const Measurement bwd = Measure(repeats, [&] { failed |= !engine.Backward(p, ba).ok(); });
      if (failed) {
        std::fprintf(stderr, "engine call failed at N = %lld\n", static_cast<long long>(n));
        return 1;
      }
      std::printf("| %s | %lld | %s | %s | %s |\n", std::string(attn::DTypeName(t)).c_str(),
                  static_cast<long long>(n), naive_cells.c_str(), Cells(fwd_flops, fwd).c_str(),
                  Cells(2.5 * fwd_flops, bwd).c_str());
      std::fflush(stdout);
    }
  }
  std::printf(
      "\nAnchor (shared/anchors/README.md, same machine, float32): naive numpy + OpenBLAS "
      "58 / 56 / 68 / 73 GFLOP/s at N = 512 / 1024 / 2048 / 4096.\n");
  return 0;
}
