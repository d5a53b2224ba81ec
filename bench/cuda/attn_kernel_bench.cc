// attn_kernel_bench: forward (or backward) TFLOP/s of the CUDA fused and naive engines over the
// anchor grid of shared/anchors/README.md (16k tokens per batch: batch = 16384 / N, heads = 2048 /
// d), with the device memory each engine held. Timing: CUDA events around each call, warm-up first,
// the median of many repeats, inputs rotated among sets that together exceed the L2 many times.
//
// Output: a table, or JSON lines with --json (what bench/sdpa_anchor.py reads).
// Flags (comma lists): --dtype=bf16,fp16 --d=64,128 --n=512,...,16384 --causal=0,1
//   --engine=fused,naive --min_ms=100 --warmup_ms=25 --max_repeats=200 --tokens=16384
//   --head_width=2048 --workspace_limit_gb=8 --pass=fwd|bwd
//   --kernel=auto,portable,sm90_lockstep,sm90_tma --block_n=0,... --consumers=0,... --ctas=0,...
// --kernel pins the fused forward's kernel (each listed one is timed; default auto), --block_n
// and --consumers the TMA kernel's tile width and consumer warpgroups (0: the heuristic's; at
// head_dim 64 both shapes have 128 keys and differ in their consumers); a pinned row's engine
// is named fused_<kernel>[_n<block_n>][_w<consumers>][_c<ctas>], so that bench/sdpa_anchor.py's
// `fused` column stays kAuto; --ctas the TMA kernel's persistent CTAs (0: one an SM; more than
// the query blocks: one CTA a block, as a non-persistent grid).
// --pass=bwd times Engine::Backward (dQ, dK, dV from Q, K, V, O, dO and the LSE of a fused
// forward on the same inputs) and counts 2.5x the forward's FLOPs (five products instead of two);
// with --deterministic=1 it asks for deterministic mode (BackwardArgs::deterministic) and names
// the engine <engine>_det.
// --fp8=1 also times the FP8 forward (cuda/fused/fp8_forward.h; head_dim 128 and 256, forward):
// `fused_fp8` on inputs quantized beforehand, `fused_fp8_quantizing` with PrepareFp8Forward's
// quantization of the 16-bit inputs in each call, and both report O's error against the fused
// engine's 16-bit output on the same inputs (rms_error: RMS of the difference over RMS of O;
// max_error: the largest difference).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "attn/status_macros.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_buffer.h"
#include "cuda/cuda_engines.h"
#include "cuda/fused/fp8_forward.h"
#include "cuda/fused/fused_forward.h"
#include "fill_random.h"

namespace attn::bench {
namespace {

struct Flags {
  std::vector<DType> dtypes{DType::kBF16, DType::kF16};
  std::vector<int> dims{64, 128};
  std::vector<int> lengths{512, 1024, 2048, 4096, 8192, 16384};
  std::vector<int> causal{0, 1};
  std::vector<EngineKind> engines{EngineKind::kCudaFused, EngineKind::kCudaNaive};
  std::vector<cuda::FusedKernel> kernels{cuda::FusedKernel::kAuto};
  std::vector<int> block_ns{0};
  std::vector<int> consumers{0};
  std::vector<int> ctas{0};
  double min_ms = 100, warmup_ms = 25;
  int max_repeats = 200;
  int64_t tokens = 16384;
  int head_width = 2048;
  double workspace_limit_gb = 8;
  bool backward = false;
  bool deterministic = false;
  bool fp8 = false;
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

template <typename T, typename Parse>
absl::Status ParseList(const std::string& value, std::vector<T>& out, Parse parse) {
  out.clear();
  for (const std::string& item : SplitCommas(value)) {
    ATTN_ASSIGN_OR_RETURN(T v, parse(item));
    out.push_back(v);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ParseInt(const std::string& s) {
  int v = 0;
  const auto [end, error] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (error != std::errc() || end != s.data() + s.size()) {
    return absl::InvalidArgumentError(absl::StrCat("not an integer: ", s));
  }
  return v;
}

struct KernelName {
  const char* name;
  cuda::FusedKernel kernel;
};
constexpr KernelName kKernelNames[] = {{"auto", cuda::FusedKernel::kAuto},
                                       {"portable", cuda::FusedKernel::kPortable},
                                       {"sm90_lockstep", cuda::FusedKernel::kSm90Lockstep},
                                       {"sm90_tma", cuda::FusedKernel::kSm90Tma}};

absl::StatusOr<cuda::FusedKernel> ParseKernel(const std::string& s) {
  for (const KernelName& k : kKernelNames) {
    if (s == k.name) return k.kernel;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--kernel: not one of auto, portable, sm90_lockstep, sm90_tma: ", s));
}

const char* KernelNameOf(cuda::FusedKernel kernel) {
  for (const KernelName& k : kKernelNames) {
    if (k.kernel == kernel) return k.name;
  }
  return "?";
}

absl::StatusOr<double> ParseDouble(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) {
    return absl::InvalidArgumentError(absl::StrCat("not a number: ", s));
  }
  return v;
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
    if (name == "dtype") {
      ATTN_RETURN_IF_ERROR(
          ParseList(value, f.dtypes, [](const std::string& s) { return ParseDType(s); }));
    } else if (name == "d") {
      ATTN_RETURN_IF_ERROR(ParseList(value, f.dims, ParseInt));
    } else if (name == "n") {
      ATTN_RETURN_IF_ERROR(ParseList(value, f.lengths, ParseInt));
    } else if (name == "causal") {
      ATTN_RETURN_IF_ERROR(ParseList(value, f.causal, ParseInt));
    } else if (name == "engine") {
      ATTN_RETURN_IF_ERROR(ParseList(value, f.engines, [](const std::string& s) {
        return ParseEngineKind(absl::StrCat("cuda_", s));
      }));
    } else if (name == "kernel") {
      ATTN_RETURN_IF_ERROR(ParseList(value, f.kernels, ParseKernel));
    } else if (name == "block_n") {
      ATTN_RETURN_IF_ERROR(ParseList(value, f.block_ns, ParseInt));
    } else if (name == "consumers") {
      ATTN_RETURN_IF_ERROR(ParseList(value, f.consumers, ParseInt));
    } else if (name == "ctas") {
      ATTN_RETURN_IF_ERROR(ParseList(value, f.ctas, ParseInt));
    } else if (name == "min_ms") {
      ATTN_ASSIGN_OR_RETURN(f.min_ms, ParseDouble(value));
    } else if (name == "warmup_ms") {
      ATTN_ASSIGN_OR_RETURN(f.warmup_ms, ParseDouble(value));
    } else if (name == "max_repeats") {
      ATTN_ASSIGN_OR_RETURN(f.max_repeats, ParseInt(value));
    } else if (name == "tokens") {
      ATTN_ASSIGN_OR_RETURN(const int t, ParseInt(value));
      f.tokens = t;
    } else if (name == "head_width") {
      ATTN_ASSIGN_OR_RETURN(f.head_width, ParseInt(value));
    } else if (name == "pass") {
      if (value != "fwd" && value != "bwd") {
        return absl::InvalidArgumentError("--pass must be fwd or bwd");
      }
      f.backward = value == "bwd";
    } else if (name == "deterministic") {
      if (value != "0" && value != "1") {
        return absl::InvalidArgumentError("--deterministic must be 0 or 1");
      }
      f.deterministic = value == "1";
    } else if (name == "fp8") {
      if (value != "0" && value != "1") return absl::InvalidArgumentError("--fp8 must be 0 or 1");
      f.fp8 = value == "1";
    } else if (name == "workspace_limit_gb") {
      ATTN_ASSIGN_OR_RETURN(f.workspace_limit_gb, ParseDouble(value));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag: --", name));
    }
  }
  if (f.dtypes.empty() || f.dims.empty() || f.lengths.empty() || f.causal.empty() ||
      f.engines.empty() || f.kernels.empty() || f.block_ns.empty() || f.consumers.empty() ||
      f.ctas.empty()) {
    return absl::InvalidArgumentError("every list flag needs at least one value");
  }
  return f;
}

const char* ShortDType(DType t) {
  return t == DType::kBF16 ? "bf16" : t == DType::kF16 ? "fp16" : "fp32";
}

// Device memory in use now (all processes), bytes.
int64_t DeviceUsedBytes() {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return -1;
  return static_cast<int64_t>(total_bytes - free_bytes);
}

// Input sets of Q, K, V (each [tokens, heads, d], packed) plus one O and LSE, all device-side.
struct Buffers {
  std::vector<cuda::DeviceBuffer> q, k, v;
  cuda::DeviceBuffer o, lse;
  cuda::DeviceBuffer d_o, dq, dk, dv;  // --pass=bwd only
  int64_t tensor_bytes = 0;
};

struct Row {
  std::string engine;
  DType dtype;
  int d;
  bool causal;
  int n, batch, heads;
  double ms = 0, tflops = 0;
  int64_t workspace_bytes = -1;  // device memory the engine added (pool, cuBLAS), after the run
  int repeats = 0;
  // Wall clock (Unix seconds) of the timed repeats: from their first enqueue to the stream's
  // drain, so that a clock and power log (nvidia-smi) can be read over the same window.
  double timed_from = 0, timed_to = 0;
  double rms_error = -1, max_error = -1;  // --fp8 rows: against the 16-bit output
  std::string status = "ok";
};

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The fused engine with `kernel` pinned (and the TMA kernel's block_n, consumers and persistent
// CTAs), any other as created.
struct EngineChoice {
  EngineKind kind;
  cuda::FusedKernel kernel = cuda::FusedKernel::kAuto;
  int block_n = 0;
  int ctas = 0;
  int consumers = 0;

  std::string Name() const {
    std::string name = std::string(EngineKindName(kind)).substr(5);
    if (kind != EngineKind::kCudaFused || (kernel == cuda::FusedKernel::kAuto && block_n == 0)) {
      return name;
    }
    absl::StrAppend(&name, "_", KernelNameOf(kernel));
    if (block_n != 0) absl::StrAppend(&name, "_n", block_n);
    if (consumers != 0) absl::StrAppend(&name, "_w", consumers);
    if (ctas != 0) absl::StrAppend(&name, "_c", ctas);
    return name;
  }
};

// The median ms of call(i) over repeats (CUDA events around each on `stream`): one call, then
// after_first(), a second call to size the rest, warm-up for warmup_ms (2 calls at least), then
// enough repeats for min_ms within [10, max_repeats], their count in *repeats_out and their
// wall-clock window in window's timed_from / timed_to. A failing call's status is returned.
template <typename Call, typename AfterFirst>
absl::StatusOr<double> MedianMs(const Flags& f, cudaStream_t stream, Call call, int* repeats_out,
                                AfterFirst after_first, Row* window = nullptr) {
  ATTN_ASSIGN_OR_RETURN(cuda::CudaEvent start, cuda::CudaEvent::Create(true));
  ATTN_ASSIGN_OR_RETURN(cuda::CudaEvent stop, cuda::CudaEvent::Create(true));
  const auto time_call_0 = [&]() -> absl::StatusOr<float> {
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), stream));
    ATTN_RETURN_IF_ERROR(call(0));
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.get(), stream));
    ATTN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    float ms = 0;
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    return ms;
  };
  ATTN_ASSIGN_OR_RETURN(const float first_ms, time_call_0());
  after_first();
  // The first call also loads modules and sizes workspaces: the counts below come from a second.
  ATTN_ASSIGN_OR_RETURN(const float second_ms, time_call_0());
  const float call_ms = std::max(std::min(first_ms, second_ms), 0.01f);
  const int warmups = std::max(2, static_cast<int>(f.warmup_ms / call_ms));
  for (int i = 0; i < warmups; ++i) ATTN_RETURN_IF_ERROR(call(i));
  const int repeats = std::clamp(static_cast<int>(f.min_ms / call_ms), 10, f.max_repeats);
  std::vector<cuda::CudaEvent> events;
  for (int i = 0; i < 2 * repeats; ++i) {
    ATTN_ASSIGN_OR_RETURN(cuda::CudaEvent e, cuda::CudaEvent::Create(true));
    events.push_back(std::move(e));
  }
  const double timed_from = WallSeconds();
  for (int i = 0; i < repeats; ++i) {
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(events[2 * i].get(), stream));
    ATTN_RETURN_IF_ERROR(call(i + 1));
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(events[2 * i + 1].get(), stream));
  }
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (window != nullptr) {
    window->timed_from = timed_from;
    window->timed_to = WallSeconds();
  }
  std::vector<float> times(repeats);
  for (int i = 0; i < repeats; ++i) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaEventElapsedTime(&times[i], events[2 * i].get(), events[2 * i + 1].get()));
  }
  *repeats_out = repeats;
  return Median(times);
}

absl::Status TimeOne(const Flags& f, Buffers& buf, const EngineChoice& choice, DType dtype, int d,
                     bool causal, int n, Row& row) {
  const EngineKind kind = choice.kind;
  const int heads = f.head_width / d;
  const int batch = static_cast<int>(f.tokens / n);
  row = Row{choice.Name(), dtype, d, causal, n, batch, heads};
  if (f.backward && f.deterministic) row.engine += "_det";
  const AttentionProblem p = DenseProblem(dtype, batch, n, n, heads, heads, d, causal);
  const double flops =
      4.0 * batch * heads * double(n) * n * d * (causal ? 0.5 : 1.0) * (f.backward ? 2.5 : 1.0);

  const int64_t used_before = DeviceUsedBytes();
  EngineOptions options;
  options.workspace_limit_bytes = static_cast<int64_t>(f.workspace_limit_gb * (1ll << 30));
  std::unique_ptr<Engine> engine;
  if (kind == EngineKind::kCudaFused) {
    ATTN_ASSIGN_OR_RETURN(engine, MakeCudaFusedEngine(options, choice.kernel, {}, choice.block_n,
                                                      choice.ctas, choice.consumers));
  } else {
    ATTN_ASSIGN_OR_RETURN(engine, CreateEngine(kind, options));
  }
  if (const Support s = f.backward ? engine->SupportsBackward(p) : engine->SupportsForward(p);
      !s.ok()) {
    row.status = s.status().ToString();
    return absl::OkStatus();
  }
  cudaStream_t stream = nullptr;
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto args = [&](size_t set) {
    ForwardArgs a;
    a.q = Packed<const void*>(buf.q[set].get(), heads, d);
    a.k = Packed<const void*>(buf.k[set].get(), heads, d);
    a.v = Packed<const void*>(buf.v[set].get(), heads, d);
    a.o = Packed<void*>(buf.o.get(), heads, d);
    a.lse = buf.lse.as<float>();
    a.stream = stream;
    return a;
  };
  // The backward reads set 0 with O and the LSE of its forward (its five tensors exceed the L2
  // many times at every size of the grid).
  BackwardArgs backward;
  if (f.backward) {
    ATTN_ASSIGN_OR_RETURN(std::unique_ptr<Engine> forward,
                          CreateEngine(EngineKind::kCudaFused, options));
    ATTN_RETURN_IF_ERROR(forward->Forward(p, args(0)));
    backward.q = args(0).q;
    backward.k = args(0).k;
    backward.v = args(0).v;
    backward.o = Packed<const void*>(buf.o.get(), heads, d);
    backward.d_o = Packed<const void*>(buf.d_o.get(), heads, d);
    backward.lse = buf.lse.as<float>();
    backward.dq = Packed<void*>(buf.dq.get(), heads, d);
    backward.dk = Packed<void*>(buf.dk.get(), heads, d);
    backward.dv = Packed<void*>(buf.dv.get(), heads, d);
    backward.stream = stream;
    backward.deterministic = f.deterministic;
  }
  const auto call = [&](size_t set) {
    return f.backward ? engine->Backward(p, backward) : engine->Forward(p, args(set));
  };
  const size_t sets = buf.q.size();
  // The first call sizes the engine's workspace.
  const absl::StatusOr<double> ms = MedianMs(
      f, stream, [&](int i) { return call(i % sets); }, &row.repeats,
      [&] { row.workspace_bytes = DeviceUsedBytes() - used_before; }, &row);
  cudaStreamDestroy(stream);
  if (!ms.ok()) {
    row.status = ms.status().ToString();
    return absl::OkStatus();
  }
  row.ms = *ms;
  row.tflops = flops / (row.ms * 1e-3) / 1e12;
  return absl::OkStatus();
}

// O of `elements` in `dtype` (bf16 or fp16) on the device, as floats.
absl::StatusOr<std::vector<float>> DownloadOutput(const void* o, int64_t elements, DType dtype) {
  std::vector<uint16_t> bits(elements);
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemcpy(bits.data(), o, elements * 2, cudaMemcpyDeviceToHost));
  std::vector<float> values(elements);
  for (int64_t i = 0; i < elements; ++i) {
    values[i] = dtype == DType::kBF16 ? BF16ToFloat(bits[i]) : HalfToFloat(bits[i]);
  }
  return values;
}

// The --fp8 rows of one grid point: the FP8 forward on quantized copies of every input set
// (fused_fp8) and with the quantization in each call (fused_fp8_quantizing), and their error
// against the fused engine's output on set 0.
absl::Status TimeFp8(const Flags& f, Buffers& buf, DType dtype, int d, bool causal, int n,
                     std::vector<Row>& rows) {
  const int heads = f.head_width / d;
  const int batch = static_cast<int>(f.tokens / n);
  const double flops = 4.0 * batch * heads * double(n) * n * d * (causal ? 0.5 : 1.0);
  Row kernel_row{"fused_fp8", dtype, d, causal, n, batch, heads};
  Row quantizing_row{"fused_fp8_quantizing", dtype, d, causal, n, batch, heads};
  const auto fail = [&](const absl::Status& s) {
    kernel_row.status = quantizing_row.status = s.ToString();
    rows = {kernel_row, quantizing_row};
    return absl::OkStatus();
  };
  if (d != 128 && d != 256) {
    return fail(absl::UnimplementedError("the FP8 forward covers head_dim 128 and 256"));
  }
  cudaStream_t stream = nullptr;
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer counters, cuda::DeviceBuffer::Allocate(2 * sizeof(int)));
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemset(counters.get(), 0, 2 * sizeof(int)));
  const auto params = [&](size_t set) {
    cuda::FusedForwardParams p;
    p.q = buf.q[set].get();
    p.k = buf.k[set].get();
    p.v = buf.v[set].get();
    p.o = buf.o.get();
    p.lse = buf.lse.as<float>();
    p.q_token_stride = p.k_token_stride = p.v_token_stride = p.o_token_stride = int64_t{heads} * d;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = d;
    p.total_q = p.total_k = int64_t{batch} * n;
    p.seqlen_q = p.seqlen_k = p.max_seqlen_q = n;
    p.batch = batch;
    p.num_heads = p.num_kv_heads = heads;
    p.head_dim = d;
    p.scale = 1.f / std::sqrt(static_cast<float>(d));
    p.window_right = causal ? 0 : -1;
    p.dtype = dtype;
    p.tile_counters = counters.as<int>();
    return p;
  };
  const size_t sets = buf.q.size();
  const int64_t workspace_bytes = cuda::Fp8ForwardWorkspaceBytes(params(0));
  std::vector<cuda::DeviceBuffer> workspaces;
  std::vector<cuda::Fp8ForwardParams> prepared(sets);
  for (size_t set = 0; set < sets; ++set) {
    ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer w, cuda::DeviceBuffer::Allocate(workspace_bytes));
    ATTN_RETURN_IF_ERROR(
        cuda::PrepareFp8Forward(params(set), w.get(), workspace_bytes, &prepared[set], stream));
    workspaces.push_back(std::move(w));
  }
  // The error on set 0: the fused engine's 16-bit O, then the FP8 forward's.
  const int64_t elements = int64_t{batch} * n * heads * d;
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                        CreateEngine(EngineKind::kCudaFused, EngineOptions{}));
  ForwardArgs a;
  a.q = Packed<const void*>(buf.q[0].get(), heads, d);
  a.k = Packed<const void*>(buf.k[0].get(), heads, d);
  a.v = Packed<const void*>(buf.v[0].get(), heads, d);
  a.o = Packed<void*>(buf.o.get(), heads, d);
  a.lse = buf.lse.as<float>();
  a.stream = stream;
  ATTN_RETURN_IF_ERROR(
      engine->Forward(DenseProblem(dtype, batch, n, n, heads, heads, d, causal), a));
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  ATTN_ASSIGN_OR_RETURN(std::vector<float> o16, DownloadOutput(buf.o.get(), elements, dtype));
  if (const absl::Status s = cuda::LaunchFp8Forward(prepared[0], stream); !s.ok()) {
    cudaStreamDestroy(stream);
    return fail(s);
  }
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  ATTN_ASSIGN_OR_RETURN(std::vector<float> o8, DownloadOutput(buf.o.get(), elements, DType::kBF16));
  double diff2 = 0, ref2 = 0, max_diff = 0;
  for (int64_t i = 0; i < elements; ++i) {
    const double diff = double(o8[i]) - o16[i];
    diff2 += diff * diff;
    ref2 += double(o16[i]) * o16[i];
    max_diff = std::max(max_diff, std::abs(diff));
  }
  kernel_row.rms_error = quantizing_row.rms_error = std::sqrt(diff2 / std::max(ref2, 1e-30));
  kernel_row.max_error = quantizing_row.max_error = max_diff;

  std::vector<cuda::Fp8ForwardParams> scratch(sets);
  const auto run_prepared = [&](int i) {
    return cuda::LaunchFp8Forward(prepared[i % sets], stream);
  };
  const auto run_quantizing = [&](int i) {
    const size_t set = i % sets;
    ATTN_RETURN_IF_ERROR(cuda::PrepareFp8Forward(params(set), workspaces[set].get(),
                                                 workspace_bytes, &scratch[set], stream));
    return cuda::LaunchFp8Forward(scratch[set], stream);
  };
  const auto time = [&](Row& row, const auto& call) {
    const absl::StatusOr<double> ms = MedianMs(
        f, stream, call, &row.repeats, [] {}, &row);
    if (!ms.ok()) {
      row.status = ms.status().ToString();
      return;
    }
    row.ms = *ms;
    row.tflops = flops / (row.ms * 1e-3) / 1e12;
    row.workspace_bytes = workspace_bytes;
  };
  time(kernel_row, run_prepared);
  time(quantizing_row, run_quantizing);
  cudaStreamDestroy(stream);
  rows = {kernel_row, quantizing_row};
  return absl::OkStatus();
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += (c == '\n' ? ' ' : c);
  }
  return out;
}

void Print(const Flags& f, const Row& r) {
  if (f.json) {
    std::printf(
        "{\"bench\":\"attn_kernel_bench\",\"pass\":\"%s\",\"engine\":\"%s\",\"dtype\":\"%s\","
        "\"d\":%d,\"causal\":%s,\"N\":%d,\"batch\":%d,\"heads\":%d,\"ms\":%.5f,\"tflops\":%.3f,"
        "\"repeats\":%d,\"timed_from\":%.3f,\"timed_to\":%.3f,\"workspace_bytes\":%lld,%s"
        "\"status\":\"%s\"}\n",
        f.backward ? "bwd" : "fwd", r.engine.c_str(), ShortDType(r.dtype), r.d,
        r.causal ? "true" : "false", r.n, r.batch, r.heads, r.ms, r.tflops, r.repeats, r.timed_from,
        r.timed_to, static_cast<long long>(r.workspace_bytes),
        r.rms_error < 0
            ? ""
            : absl::StrCat("\"rms_error\":", r.rms_error, ",\"max_error\":", r.max_error, ",")
                  .c_str(),
        JsonEscape(r.status).c_str());
  } else if (r.status == "ok") {
    std::printf("%-22s %-5s %4d %-6s %6d %6d %6d %10.4f %9.1f %12.1f", r.engine.c_str(),
                ShortDType(r.dtype), r.d, r.causal ? "yes" : "no", r.n, r.batch, r.heads, r.ms,
                r.tflops, r.workspace_bytes / 1048576.0);
    if (r.rms_error >= 0) std::printf("  rms error %.2e, max %.2e", r.rms_error, r.max_error);
    std::printf("\n");
  } else {
    std::printf("%-22s %-5s %4d %-6s %6d %6d %6d   %s\n", r.engine.c_str(), ShortDType(r.dtype),
                r.d, r.causal ? "yes" : "no", r.n, r.batch, r.heads, r.status.c_str());
  }
  std::fflush(stdout);
}

absl::Status Run(const Flags& f) {
  cudaDeviceProp prop{};
  ATTN_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0));
  // Every configuration has tokens x head_width elements per tensor.
  const int64_t elements = f.tokens * f.head_width;
  int64_t max_bytes = 0;
  for (DType t : f.dtypes) max_bytes = std::max(max_bytes, elements * DTypeSize(t));
  // Sets of Q, K, V: together at least 8 times the L2 and 200 MB, and at least two.
  const int64_t set_bytes = 3 * max_bytes;
  const int64_t want = std::max<int64_t>(int64_t{8} * prop.l2CacheSize, int64_t{200} << 20);
  const int sets = static_cast<int>(std::max<int64_t>(2, (want + set_bytes - 1) / set_bytes));
  Buffers buf;
  buf.tensor_bytes = max_bytes;
  for (int s = 0; s < sets; ++s) {
    for (auto* list : {&buf.q, &buf.k, &buf.v}) {
      ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer b, cuda::DeviceBuffer::Allocate(max_bytes));
      list->push_back(std::move(b));
    }
  }
  ATTN_ASSIGN_OR_RETURN(buf.o, cuda::DeviceBuffer::Allocate(max_bytes));
  if (f.backward) {
    for (auto* b : {&buf.d_o, &buf.dq, &buf.dk, &buf.dv}) {
      ATTN_ASSIGN_OR_RETURN(*b, cuda::DeviceBuffer::Allocate(max_bytes));
    }
  }
  const int min_dim = *std::min_element(f.dims.begin(), f.dims.end());
  ATTN_ASSIGN_OR_RETURN(
      buf.lse, cuda::DeviceBuffer::Allocate(f.tokens * (f.head_width / min_dim) * sizeof(float)));
  if (!f.json) {
    std::printf("# %s, %d SMs, L2 %d MB; %d input sets of %.0f MB; median of CUDA-event times\n",
                prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, sets,
                set_bytes / 1048576.0);
    std::printf("%-22s %-5s %4s %-6s %6s %6s %6s %10s %9s %12s\n", "engine", "dtype", "d", "causal",
                "N", "batch", "heads", "ms", "TFLOP/s", "workspaceMB");
  }
  uint64_t seed = 1;
  for (DType dtype : f.dtypes) {
    for (size_t s = 0; s < buf.q.size(); ++s) {
      for (auto* list : {&buf.q, &buf.k, &buf.v}) {
        ATTN_RETURN_IF_ERROR(FillRandomNormal((*list)[s].get(), elements, dtype, seed++, nullptr));
      }
    }
    if (f.backward) {
      ATTN_RETURN_IF_ERROR(FillRandomNormal(buf.d_o.get(), elements, dtype, seed++, nullptr));
    }
    ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    for (int d : f.dims) {
      for (int causal : f.causal) {
        for (int n : f.lengths) {
          if (n <= 0 || f.tokens % n != 0 || f.head_width % d != 0) {
            return absl::InvalidArgumentError(
                absl::StrCat("N=", n, " must divide --tokens and d=", d, " --head_width"));
          }
          for (EngineKind kind : f.engines) {
            std::vector<EngineChoice> choices{{kind}};
            if (kind == EngineKind::kCudaFused) {
              choices.clear();
              for (cuda::FusedKernel kernel : f.kernels) {
                // A tile width pins the TMA kernel's shape only.
                if (kernel != cuda::FusedKernel::kSm90Tma) {
                  choices.push_back({kind, kernel, 0});
                  continue;
                }
                for (int block_n : f.block_ns) {
                  for (int consumers : f.consumers) {
                    for (int ctas : f.ctas) {
                      choices.push_back({kind, kernel, block_n, ctas, consumers});
                    }
                  }
                }
              }
            }
            for (const EngineChoice& choice : choices) {
              Row row;
              ATTN_RETURN_IF_ERROR(TimeOne(f, buf, choice, dtype, d, causal != 0, n, row));
              Print(f, row);
            }
          }
          if (f.fp8 && !f.backward) {
            std::vector<Row> rows;
            ATTN_RETURN_IF_ERROR(TimeFp8(f, buf, dtype, d, causal != 0, n, rows));
            for (const Row& row : rows) Print(f, row);
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace attn::bench

int main(int argc, char** argv) {
  auto flags = attn::bench::ParseFlags(argc, argv);
  if (!flags.ok()) {
    std::fprintf(stderr, "attn_kernel_bench: %s\n", flags.status().ToString().c_str());
    return 2;
  }
  const absl::Status s = attn::bench::Run(*flags);
  if (!s.ok()) {
    std::fprintf(stderr, "attn_kernel_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
