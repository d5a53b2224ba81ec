// attn_decode_bench: the fused engine's decode over paged K/V (ForwardPaged), as KV bytes read
// per second against the device's copy bandwidth measured in the same program.
//
// Shapes: `batch` sessions of `context` cached keys each, `q_tokens` query tokens per session
// (causal, bottom-right), 32 query / 8 KV heads, d = 128, bf16 by default; pages of the size the
// heuristics give (PagedKvPageTokens) unless --page_tokens says otherwise, assigned to sessions
// in a shuffled order as a long-running pool leaves them. KV bytes = batch * context * kv_heads
// * d * 2 (K and V) * element size, each read once per call.
//
// Timing: CUDA events around each call, warm-up first, the median of many repeats, the page
// pool's sets rotated so that together they exceed the L2 many times (a set is one pool of
// pages with its own block table). A short spin kernel runs before each timed call, so that the
// host has issued the call before the GPU reaches it and the events time the GPU alone (as
// triton.testing.do_bench's cache flush does for bench/sdpa_anchor.py).
// Copy bandwidth: a device-to-device cudaMemcpyAsync of --copy_mb MiB, bytes read plus bytes
// written per second, median of 20.
//
// Output: a table, or JSON lines with --json (what bench/sdpa_anchor.py --pass decode reads).
// Flags (comma lists): --batch=1,4,16,64,256 --context=1024,...,32768 --dtype=bf16 --d=128
//   --heads=32 --kv_heads=8 --q_tokens=1 --page_tokens=0 (0: the heuristic's)
//   --splits=0 (0: the heuristic's; a list sweeps forced counts) --min_ms=50 --warmup_ms=10
//   --max_repeats=200 --spin_us=50 --copy_mb=2048 --l2_sets=8 (sets x L2 the rotation exceeds)
//   --prefill=N,... (also time the paged prefill of batch 16384/N x N tokens, causal and not, at
//   each --page_tokens, against the dense fused forward on the same problem, TFLOP/s: the
//   paged kernel of the launch's choice ("paged") and each prefill kernel pinned,
//   "paged_tma" (warp-specialised), "paged_lockstep", "paged_portable"; a pin that cannot run
//   prints its status) --decode=0 (skip the decode grid)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "attn/paged_kv.h"
#include "attn/status_macros.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_buffer.h"
#include "cuda/cuda_engines.h"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/paged_forward.h"
#include "fill_random.h"
#include "gpu_spin.h"

namespace attn::bench {
namespace {

struct Flags {
  DType dtype = DType::kBF16;
  int d = 128, heads = 32, kv_heads = 8, q_tokens = 1;
  std::vector<int> batches{1, 4, 16, 64, 256};
  std::vector<int> contexts{1024, 2048, 4096, 8192, 16384, 32768};
  std::vector<int> page_tokens{0};
  std::vector<int> splits{0};
  double min_ms = 50, warmup_ms = 10, spin_us = 50;
  int max_repeats = 200;
  int64_t copy_mb = 2048;
  int l2_sets = 8;
  std::vector<int> prefill;
  bool decode = true;
  bool json = false;
};

std::vector<std::string> SplitCommas(const std::string& value) {
  std::vector<std::string> items;
  size_t begin = 0;
  while (begin <= value.size()) {
    const size_t comma = std::min(value.find(',', begin), value.size());
    if (comma > begin) items.push_back(value.substr(begin, comma - begin));
    begin = comma + 1;
  }
  return items;
}

absl::StatusOr<int> ParseInt(const std::string& s) {
  int v = 0;
  const auto [end, error] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (error != std::errc() || end != s.data() + s.size()) {
    return absl::InvalidArgumentError(absl::StrCat("not an integer: ", s));
  }
  return v;
}

absl::StatusOr<double> ParseDouble(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) {
    return absl::InvalidArgumentError(absl::StrCat("not a number: ", s));
  }
  return v;
}

absl::Status ParseInts(const std::string& value, std::vector<int>& out) {
  out.clear();
  for (const std::string& item : SplitCommas(value)) {
    ATTN_ASSIGN_OR_RETURN(const int v, ParseInt(item));
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError("an empty list");
  return absl::OkStatus();
}

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json") {
      f.json = true;
      continue;
    }
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("unknown argument: ", arg));
    }
    const std::string name = arg.substr(2, eq - 2);
    const std::string value = arg.substr(eq + 1);
    absl::Status s;
    if (name == "dtype") {
      ATTN_ASSIGN_OR_RETURN(f.dtype, ParseDType(value));
    } else if (name == "d") {
      ATTN_ASSIGN_OR_RETURN(f.d, ParseInt(value));
    } else if (name == "heads") {
      ATTN_ASSIGN_OR_RETURN(f.heads, ParseInt(value));
    } else if (name == "kv_heads") {
      ATTN_ASSIGN_OR_RETURN(f.kv_heads, ParseInt(value));
    } else if (name == "q_tokens") {
      ATTN_ASSIGN_OR_RETURN(f.q_tokens, ParseInt(value));
    } else if (name == "batch") {
      s = ParseInts(value, f.batches);
    } else if (name == "context") {
      s = ParseInts(value, f.contexts);
    } else if (name == "page_tokens") {
      s = ParseInts(value, f.page_tokens);
    } else if (name == "splits") {
      s = ParseInts(value, f.splits);
    } else if (name == "min_ms") {
      ATTN_ASSIGN_OR_RETURN(f.min_ms, ParseDouble(value));
    } else if (name == "warmup_ms") {
      ATTN_ASSIGN_OR_RETURN(f.warmup_ms, ParseDouble(value));
    } else if (name == "spin_us") {
      ATTN_ASSIGN_OR_RETURN(f.spin_us, ParseDouble(value));
    } else if (name == "max_repeats") {
      ATTN_ASSIGN_OR_RETURN(f.max_repeats, ParseInt(value));
    } else if (name == "copy_mb") {
      ATTN_ASSIGN_OR_RETURN(const int mb, ParseInt(value));
      f.copy_mb = mb;
    } else if (name == "l2_sets") {
      ATTN_ASSIGN_OR_RETURN(f.l2_sets, ParseInt(value));
    } else if (name == "prefill") {
      s = ParseInts(value, f.prefill);
    } else if (name == "decode") {
      ATTN_ASSIGN_OR_RETURN(const int decode, ParseInt(value));
      f.decode = decode != 0;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag: --", name));
    }
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", s.message()));
  }
  for (int n : f.prefill) {
    if (n <= 0) return absl::InvalidArgumentError("--prefill: lengths must be positive");
  }
  return f;
}

const char* ShortDType(DType t) {
  return t == DType::kBF16 ? "bf16" : t == DType::kF16 ? "fp16" : "fp32";
}

double Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Times `call(i)` (the i-th call of a run): warm-up for warmup_ms, then repeats for min_ms
// (within [10, max_repeats]), each after a spin kernel; the median in milliseconds.
template <typename Call>
absl::StatusOr<std::pair<double, int>> TimeCalls(const Flags& f, cudaStream_t stream, Call call) {
  ATTN_ASSIGN_OR_RETURN(cuda::CudaEvent start, cuda::CudaEvent::Create(true));
  ATTN_ASSIGN_OR_RETURN(cuda::CudaEvent stop, cuda::CudaEvent::Create(true));
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), stream));
  ATTN_RETURN_IF_ERROR(call(0));
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.get(), stream));
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  float first_ms = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&first_ms, start.get(), stop.get()));
  const float per_call = std::max(first_ms, 0.005f);
  const int warmups = std::max(3, static_cast<int>(f.warmup_ms / per_call));
  for (int i = 0; i < warmups; ++i) ATTN_RETURN_IF_ERROR(call(i + 1));
  const int repeats = std::clamp(static_cast<int>(f.min_ms / per_call), 10, f.max_repeats);
  std::vector<cuda::CudaEvent> events;
  for (int i = 0; i < 2 * repeats; ++i) {
    ATTN_ASSIGN_OR_RETURN(cuda::CudaEvent e, cuda::CudaEvent::Create(true));
    events.push_back(std::move(e));
  }
  for (int i = 0; i < repeats; ++i) {
    if (f.spin_us > 0) ATTN_RETURN_IF_ERROR(SpinGpu(f.spin_us, stream));
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(events[2 * i].get(), stream));
    ATTN_RETURN_IF_ERROR(call(warmups + 1 + i));
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(events[2 * i + 1].get(), stream));
  }
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  std::vector<float> times(repeats);
  for (int i = 0; i < repeats; ++i) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaEventElapsedTime(&times[i], events[2 * i].get(), events[2 * i + 1].get()));
  }
  return std::pair<double, int>{Median(times), repeats};
}

// Device-to-device copy bandwidth, bytes read plus written per second.
absl::StatusOr<double> CopyBandwidth(const Flags& f, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(f.copy_mb) << 20;
  ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer a, cuda::DeviceBuffer::Allocate(bytes));
  ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer b, cuda::DeviceBuffer::Allocate(bytes));
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(a.get(), 1, bytes, stream));
  // The copies run first: their warm-up also brings the clocks up from idle for everything
  // measured after them (the first configuration of a fresh process ran up to 12% slow).
  Flags copy = f;
  copy.warmup_ms = 300;
  copy.max_repeats = 20;
  copy.min_ms = 0;
  ATTN_ASSIGN_OR_RETURN(const auto timed, TimeCalls(copy, stream, [&](int) {
                          return cuda::CudaStatus(cudaMemcpyAsync(b.get(), a.get(), bytes,
                                                                  cudaMemcpyDeviceToDevice, stream),
                                                  "cudaMemcpyAsync");
                        }));
  return 2.0 * bytes / (timed.first * 1e-3);
}

struct Row {
  int batch = 0, context = 0, page_tokens = 0, splits = 0;
  std::string kernel;
  double ms = 0, kv_bytes = 0, bytes_per_s = 0;
  int repeats = 0;
  std::string status = "ok";
};

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += (c == '\n' ? ' ' : c);
  }
  return out;
}

void Print(const Flags& f, const Row& r, double copy_bps) {
  const double tbps = r.bytes_per_s / 1e12;
  if (f.json) {
    std::printf(
        "{\"bench\":\"attn_decode_bench\",\"pass\":\"decode\",\"engine\":\"fused\","
        "\"kernel\":\"%s\",\"dtype\":\"%s\",\"d\":%d,\"heads\":%d,\"kv_heads\":%d,\"batch\":%d,"
        "\"context\":%d,\"q_tokens\":%d,\"page_tokens\":%d,\"splits\":%d,\"ms\":%.5f,"
        "\"kv_bytes\":%.0f,\"tbps\":%.4f,\"copy_tbps\":%.4f,\"fraction\":%.4f,\"repeats\":%d,"
        "\"status\":\"%s\"}\n",
        r.kernel.c_str(), ShortDType(f.dtype), f.d, f.heads, f.kv_heads, r.batch, r.context,
        f.q_tokens, r.page_tokens, r.splits, r.ms, r.kv_bytes, tbps, copy_bps / 1e12,
        r.bytes_per_s / copy_bps, r.repeats, JsonEscape(r.status).c_str());
  } else if (r.status == "ok") {
    std::printf("%6d %8d %6d %6d %10.4f %9.3f %8.3f\n", r.batch, r.context, r.page_tokens, r.splits,
                r.ms, tbps, r.bytes_per_s / copy_bps);
  } else {
    std::printf("%6d %8d %6d %6d   %s\n", r.batch, r.context, r.page_tokens, r.splits,
                r.status.c_str());
  }
  std::fflush(stdout);
}

absl::StatusOr<cuda::PagedDevice> QueryDevice() {
  cuda::PagedDevice d;
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&d.multiprocessors, cudaDevAttrMultiProcessorCount, 0));
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&d.shared_memory_per_sm,
                                                   cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
  return d;
}

// Pools of pages for one (batch, context, page_tokens): `sets` block tables over one pool whose
// pages are dealt out in a shuffled order.
struct PagePools {
  cuda::DeviceBuffer pool, tables;
  std::vector<PagedKV> views;  // one per set
};

absl::StatusOr<PagePools> MakePools(const AttentionProblem& p, int page_tokens, int sets,
                                    uint64_t seed) {
  PagePools pools;
  const int64_t row = PagedKV::TokenStride(p);
  const int blocks = static_cast<int>((p.seqlen_k(0) + page_tokens - 1) / page_tokens);
  const int64_t pages = int64_t{sets} * p.batch() * blocks;
  const int64_t page_stride = 2 * page_tokens * row;
  const int64_t elements = pages * page_stride;
  ATTN_ASSIGN_OR_RETURN(pools.pool, cuda::DeviceBuffer::Allocate(elements * DTypeSize(p.dtype)));
  ATTN_RETURN_IF_ERROR(FillRandomNormal(pools.pool.get(), elements, p.dtype, seed, nullptr));
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the fill ran on the legacy stream
  std::vector<int32_t> order(static_cast<size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 random(seed);
  std::shuffle(order.begin(), order.end(), random);
  ATTN_ASSIGN_OR_RETURN(pools.tables, cuda::DeviceBuffer::Allocate(order.size() * 4));
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(pools.tables.get(), order.data(), order.size() * 4, cudaMemcpyHostToDevice));
  for (int s = 0; s < sets; ++s) {
    PagedKV kv;
    kv.pages = pools.pool.get();
    kv.page_stride = page_stride;
    kv.page_tokens = page_tokens;
    kv.num_pages = pages;
    kv.block_table = pools.tables.as<int32_t>() + int64_t{s} * p.batch() * blocks;
    kv.max_blocks = blocks;
    pools.views.push_back(kv);
  }
  return pools;
}

absl::Status RunDecode(const Flags& f, const cuda::PagedDevice& device, double copy_bps,
                       cudaStream_t stream) {
  const int64_t l2 = [] {
    int bytes = 0;
    cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, 0);
    return int64_t{bytes};
  }();
  const int most_batch = *std::max_element(f.batches.begin(), f.batches.end());
  const int64_t q_elements = int64_t{most_batch} * f.q_tokens * f.heads * f.d;
  ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer q,
                        cuda::DeviceBuffer::Allocate(q_elements * DTypeSize(f.dtype)));
  ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer o,
                        cuda::DeviceBuffer::Allocate(q_elements * DTypeSize(f.dtype)));
  ATTN_RETURN_IF_ERROR(FillRandomNormal(q.get(), q_elements, f.dtype, 7, stream));
  uint64_t seed = 11;
  for (int batch : f.batches) {
    for (int context : f.contexts) {
      const AttentionProblem p =
          DenseProblem(f.dtype, batch, f.q_tokens, context, f.heads, f.kv_heads, f.d, true);
      const double kv_bytes = 2.0 * batch * context * f.kv_heads * f.d * DTypeSize(f.dtype);
      const int sets = static_cast<int>(
          std::clamp<double>(std::ceil(f.l2_sets * static_cast<double>(l2) / kv_bytes), 1, 64));
      for (int page_flag : f.page_tokens) {
        const int page_tokens = page_flag > 0 ? page_flag : cuda::PagedKvPageTokens(f.d);
        absl::StatusOr<PagePools> pools = MakePools(p, page_tokens, sets, seed++);
        for (int splits : f.splits) {
          Row row{batch, context, page_tokens, 0, "decode"};
          row.kv_bytes = kv_bytes;
          cuda::PagedOverrides overrides;
          overrides.decode_splits = splits;
          const cuda::PagedForwardPlan plan = cuda::PlanPagedForward(p, device, overrides);
          row.splits = plan.num_splits;
          row.kernel = plan.kernel == cuda::PagedKernel::kDecode ? "decode" : "prefill";
          if (!pools.ok()) {
            row.status = pools.status().ToString();
            Print(f, row, copy_bps);
            continue;
          }
          ATTN_ASSIGN_OR_RETURN(
              std::unique_ptr<Engine> engine,
              MakeCudaFusedEngine(EngineOptions{}, cuda::FusedKernel::kAuto, overrides));
          const auto call = [&](int i) {
            PagedForwardArgs a;
            a.q = Packed<const void*>(q.get(), f.heads, f.d);
            a.kv = pools->views[static_cast<size_t>(i) % pools->views.size()];
            a.o = Packed<void*>(o.get(), f.heads, f.d);
            a.stream = stream;
            return engine->ForwardPaged(p, a);
          };
          absl::StatusOr<std::pair<double, int>> timed = TimeCalls(f, stream, call);
          if (timed.ok()) {
            row.ms = timed->first;
            row.repeats = timed->second;
            row.bytes_per_s = kv_bytes / (row.ms * 1e-3);
          } else {
            row.status = timed.status().ToString();
          }
          Print(f, row, copy_bps);
        }
      }
    }
  }
  return absl::OkStatus();
}

// The paged prefill against the dense fused forward on one problem: batch 16384 / n sequences
// of n tokens, causal and not, the decode shapes' heads, pages of each --page_tokens; TFLOP/s.
absl::Status RunPrefill(const Flags& f, int n, cudaStream_t stream) {
  const int batch = std::max(1, 16384 / n);
  struct Variant {
    const char* name;
    cuda::FusedKernel kernel;
    bool paged;
  };
  const Variant dense[] = {{"dense_auto", cuda::FusedKernel::kAuto, false},
                           {"dense_portable", cuda::FusedKernel::kPortable, false}};
  const Variant paged[] = {{"paged", cuda::FusedKernel::kAuto, true},
                           {"paged_tma", cuda::FusedKernel::kSm90Tma, true},
                           {"paged_lockstep", cuda::FusedKernel::kSm90Lockstep, true},
                           {"paged_portable", cuda::FusedKernel::kPortable, true}};
  for (int causal : {0, 1}) {
    const AttentionProblem p =
        DenseProblem(f.dtype, batch, n, n, f.heads, f.kv_heads, f.d, causal != 0);
    const int64_t q_elements = p.total_q() * f.heads * f.d;
    const int64_t kv_elements = p.total_k() * f.kv_heads * f.d;
    ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer q,
                          cuda::DeviceBuffer::Allocate(q_elements * DTypeSize(f.dtype)));
    ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer k,
                          cuda::DeviceBuffer::Allocate(kv_elements * DTypeSize(f.dtype)));
    ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer v,
                          cuda::DeviceBuffer::Allocate(kv_elements * DTypeSize(f.dtype)));
    ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer o,
                          cuda::DeviceBuffer::Allocate(q_elements * DTypeSize(f.dtype)));
    ATTN_RETURN_IF_ERROR(FillRandomNormal(q.get(), q_elements, f.dtype, 1, stream));
    ATTN_RETURN_IF_ERROR(FillRandomNormal(k.get(), kv_elements, f.dtype, 2, stream));
    ATTN_RETURN_IF_ERROR(FillRandomNormal(v.get(), kv_elements, f.dtype, 3, stream));
    const double flops = p.forward_flops();
    const auto time = [&](const Variant& variant, const PagedKV* kv, int page_tokens) {
      absl::StatusOr<std::unique_ptr<Engine>> engine =
          MakeCudaFusedEngine(EngineOptions{}, variant.kernel);
      absl::StatusOr<std::pair<double, int>> timed = absl::InternalError("not run");
      if (!engine.ok()) {
        timed = engine.status();
      } else {
        timed = TimeCalls(f, stream, [&](int) {
          if (variant.paged) {
            PagedForwardArgs a;
            a.q = Packed<const void*>(q.get(), f.heads, f.d);
            a.kv = *kv;
            a.o = Packed<void*>(o.get(), f.heads, f.d);
            a.stream = stream;
            return (*engine)->ForwardPaged(p, a);
          }
          ForwardArgs a;
          a.q = Packed<const void*>(q.get(), f.heads, f.d);
          a.k = Packed<const void*>(k.get(), f.kv_heads, f.d);
          a.v = Packed<const void*>(v.get(), f.kv_heads, f.d);
          a.o = Packed<void*>(o.get(), f.heads, f.d);
          a.stream = stream;
          return (*engine)->Forward(p, a);
        });
      }
      const std::string status = timed.ok() ? "ok" : timed.status().ToString();
      const double ms = timed.ok() ? timed->first : 0;
      std::printf(
          "{\"bench\":\"attn_decode_bench\",\"pass\":\"prefill\",\"engine\":\"%s\","
          "\"dtype\":\"%s\",\"d\":%d,\"heads\":%d,\"kv_heads\":%d,\"batch\":%d,\"N\":%d,"
          "\"causal\":%s,\"page_tokens\":%d,\"ms\":%.5f,\"tflops\":%.2f,\"status\":\"%s\"}\n",
          variant.name, ShortDType(f.dtype), f.d, f.heads, f.kv_heads, batch, n,
          causal ? "true" : "false", page_tokens, ms, ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0,
          JsonEscape(status).c_str());
      std::fflush(stdout);
    };
    for (const Variant& variant : dense) time(variant, nullptr, 0);
    for (int page_flag : f.page_tokens) {
      const int page_tokens = page_flag > 0 ? page_flag : cuda::PagedKvPageTokens(f.d);
      ATTN_ASSIGN_OR_RETURN(PagePools pools, MakePools(p, page_tokens, 1, 5));
      for (const Variant& variant : paged) time(variant, &pools.views[0], page_tokens);
    }
  }
  return absl::OkStatus();
}

absl::Status Run(const Flags& f) {
  cudaDeviceProp prop{};
  ATTN_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0));
  ATTN_ASSIGN_OR_RETURN(const cuda::PagedDevice device, QueryDevice());
  cudaStream_t stream = nullptr;
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ATTN_ASSIGN_OR_RETURN(const double copy_bps, CopyBandwidth(f, stream));
  if (f.json) {
    std::printf(
        "{\"bench\":\"attn_decode_bench\",\"pass\":\"copy\",\"device\":\"%s\",\"sms\":%d,"
        "\"l2_bytes\":%d,\"copy_bytes\":%lld,\"copy_tbps\":%.4f}\n",
        JsonEscape(prop.name).c_str(), prop.multiProcessorCount, prop.l2CacheSize,
        static_cast<long long>(f.copy_mb << 20), copy_bps / 1e12);
  } else {
    std::printf(
        "# %s, %d SMs, L2 %d MB; copy %.3f TB/s (read + written); median of CUDA-event "
        "times\n%6s %8s %6s %6s %10s %9s %8s\n",
        prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, copy_bps / 1e12, "batch",
        "context", "page", "splits", "ms", "TB/s", "of copy");
  }
  absl::Status status = f.decode ? RunDecode(f, device, copy_bps, stream) : absl::OkStatus();
  for (int n : f.prefill) {
    if (status.ok()) status = RunPrefill(f, n, stream);
  }
  cudaStreamDestroy(stream);
  return status;
}

}  // namespace
}  // namespace attn::bench

int main(int argc, char** argv) {
  auto flags = attn::bench::ParseFlags(argc, argv);
  if (!flags.ok()) {
    std::fprintf(stderr, "attn_decode_bench: %s\n", flags.status().ToString().c_str());
    return 2;
  }
  const absl::Status s = attn::bench::Run(*flags);
  if (!s.ok()) {
    std::fprintf(stderr, "attn_decode_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
