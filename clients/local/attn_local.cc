// attn_local: runs one attention problem through an engine in this process, with no server.
//
// It fills Q, K and V with fresh random values, times the chosen engine's forward pass, runs
// the float64 cpu_reference engine on the same input, and prints the problem, the time, the
// GFLOP/s, a few output values and the largest differences from the reference. It exits with
// 1 when the difference is beyond a bound suited to the dtype, and 2 when it cannot run.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attn/dtype.h"
#include "attn/engine.h"
#include "attn/problem.h"
#include "attn/status_macros.h"
#include "attn/tensor.h"
#if defined(ATTN_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

ABSL_FLAG(std::string, engine, "cpu_tiled",
          "Engine to run: cpu_tiled, cpu_reference, or (in a CUDA build, on a machine with a GPU) "
          "cuda_fused, cuda_naive");
ABSL_FLAG(std::string, dtype, "bf16", "Element type of Q, K, V and O: fp32, fp16 or bf16");
ABSL_FLAG(int, batch, 2, "Number of sequences");
ABSL_FLAG(int64_t, seqlen_q, 512, "Query tokens per sequence");
ABSL_FLAG(int64_t, seqlen_k, 0, "Key tokens per sequence; 0 = the same as --seqlen_q");
ABSL_FLAG(int, heads, 8, "Query heads");
ABSL_FLAG(int, kv_heads, 0, "Key/value heads (GQA when fewer than --heads); 0 = --heads");
ABSL_FLAG(int, head_dim, 64, "Dimension of each head");
ABSL_FLAG(bool, causal, false, "Causal mask, aligned to the bottom-right corner");
ABSL_FLAG(int, window_left, -1, "Sliding window: keys visible to the left; -1 = unbounded");
ABSL_FLAG(int, window_right, -1, "Sliding window: keys visible to the right; -1 = unbounded");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the random inputs");
ABSL_FLAG(int, repeats, 5, "Timed runs after one warm-up run; the median is reported");
ABSL_FLAG(int, threads, 0, "Worker threads of the CPU engines; 0 = hardware concurrency");
ABSL_FLAG(double, tolerance, 0,
          "Largest accepted |O - O_ref| / max(1, max|O_ref|); 0 = the dtype's default "
          "(fp32 1e-4, fp16 4e-3, bf16 3e-2)");

namespace {

using Clock = std::chrono::steady_clock;

// The packed [tokens, heads, head_dim] tensors of one forward pass, in host memory.
struct HostTensors {
  std::vector<uint8_t> q, k, v, o;
  std::vector<float> lse;
};

struct RunResult {
  std::vector<uint8_t> o;
  std::vector<float> lse;
  std::vector<double> times_ms;  // one per timed run
};

int64_t Bytes(int64_t tokens, int heads, const attn::AttentionProblem& p) {
  return tokens * heads * p.head_dim * attn::DTypeSize(p.dtype);
}

HostTensors MakeInputs(const attn::AttentionProblem& p, uint64_t seed) {
  HostTensors t;
  t.q.resize(Bytes(p.total_q(), p.num_heads, p));
  t.k.resize(Bytes(p.total_k(), p.num_kv_heads, p));
  t.v.resize(Bytes(p.total_k(), p.num_kv_heads, p));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (std::vector<uint8_t>* buf : {&t.q, &t.k, &t.v}) {
    const int64_t n = static_cast<int64_t>(buf->size()) / attn::DTypeSize(p.dtype);
    for (int64_t i = 0; i < n; ++i) attn::StoreFromFloat(buf->data(), p.dtype, i, normal(rng));
  }
  // Poison: all-ones bytes are NaN in fp32, fp16 and bf16, so unwritten outputs show up.
  t.o.assign(Bytes(p.total_q(), p.num_heads, p), 0xff);
  t.lse.assign(static_cast<size_t>(p.num_heads) * p.total_q(),
               std::numeric_limits<float>::quiet_NaN());
  return t;
}

attn::ForwardArgs Args(const attn::AttentionProblem& p, const void* q, const void* k, const void* v,
                       void* o, float* lse) {
  attn::ForwardArgs a;
  a.q = attn::Packed(q, p.num_heads, p.head_dim);
  a.k = attn::Packed(k, p.num_kv_heads, p.head_dim);
  a.v = attn::Packed(v, p.num_kv_heads, p.head_dim);
  a.o = attn::Packed(o, p.num_heads, p.head_dim);
  a.lse = lse;
  return a;
}

// Runs `warmups` untimed and `repeats` timed forward passes; `sync` waits for the work to end.
template <typename Sync>
absl::StatusOr<std::vector<double>> TimeForward(attn::Engine& engine,
                                                const attn::AttentionProblem& p,
                                                const attn::ForwardArgs& args, int warmups,
                                                int repeats, Sync sync) {
  std::vector<double> times_ms;
  for (int i = 0; i < warmups + repeats; ++i) {
    const Clock::time_point start = Clock::now();
    ATTN_RETURN_IF_ERROR(engine.Forward(p, args));
    ATTN_RETURN_IF_ERROR(sync());
    const std::chrono::duration<double, std::milli> elapsed = Clock::now() - start;
    if (i >= warmups) times_ms.push_back(elapsed.count());
  }
  return times_ms;
}

absl::StatusOr<RunResult> RunOnHost(attn::Engine& engine, const attn::AttentionProblem& p,
                                    HostTensors t, int warmups, int repeats) {
  RunResult r;
  ATTN_ASSIGN_OR_RETURN(
      r.times_ms,
      TimeForward(engine, p, Args(p, t.q.data(), t.k.data(), t.v.data(), t.o.data(), t.lse.data()),
                  warmups, repeats, [] { return absl::OkStatus(); }));
  r.o = std::move(t.o);
  r.lse = std::move(t.lse);
  return r;
}

#if defined(ATTN_HAVE_CUDA)
absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

// A device allocation freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::Status CopyFrom(const void* host, size_t bytes) {
    ATTN_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), "cudaMalloc"));
    return CudaStatus(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  absl::Status CopyTo(void* host, size_t bytes) const {
    return CudaStatus(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

absl::StatusOr<RunResult> RunOnDevice(attn::Engine& engine, const attn::AttentionProblem& p,
                                      HostTensors t, int warmups, int repeats, int device) {
  ATTN_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  DeviceBuffer q, k, v, o, lse;
  ATTN_RETURN_IF_ERROR(q.CopyFrom(t.q.data(), t.q.size()));
  ATTN_RETURN_IF_ERROR(k.CopyFrom(t.k.data(), t.k.size()));
  ATTN_RETURN_IF_ERROR(v.CopyFrom(t.v.data(), t.v.size()));
  ATTN_RETURN_IF_ERROR(o.CopyFrom(t.o.data(), t.o.size()));
  ATTN_RETURN_IF_ERROR(lse.CopyFrom(t.lse.data(), t.lse.size() * sizeof(float)));
  RunResult r;
  ATTN_ASSIGN_OR_RETURN(
      r.times_ms,
      TimeForward(engine, p,
                  Args(p, q.get(), k.get(), v.get(), o.get(), static_cast<float*>(lse.get())),
                  warmups, repeats, [] { return CudaStatus(cudaDeviceSynchronize(), "forward"); }));
  ATTN_RETURN_IF_ERROR(o.CopyTo(t.o.data(), t.o.size()));
  ATTN_RETURN_IF_ERROR(lse.CopyTo(t.lse.data(), t.lse.size() * sizeof(float)));
  r.o = std::move(t.o);
  r.lse = std::move(t.lse);
  return r;
}
#endif

absl::StatusOr<RunResult> Run(attn::Engine& engine, const attn::AttentionProblem& p,
                              const HostTensors& inputs, int warmups, int repeats, int device) {
  if (engine.memory_space() == attn::MemorySpace::kHost) {
    return RunOnHost(engine, p, inputs, warmups, repeats);
  }
#if defined(ATTN_HAVE_CUDA)
  return RunOnDevice(engine, p, inputs, warmups, repeats, device);
#else
  return absl::UnimplementedError(
      absl::StrCat(std::string(engine.name()), ": device-memory engine in a build without CUDA"));
#endif
}

absl::StatusOr<std::unique_ptr<attn::Engine>> MakeEngine(const std::string& name,
                                                         const attn::EngineOptions& options) {
  ATTN_ASSIGN_OR_RETURN(attn::EngineKind kind, attn::ParseEngineKind(name));
  return attn::CreateEngine(kind, options);
}

double DefaultTolerance(attn::DType t) {
  switch (t) {
    case attn::DType::kF32:
      return 1e-4;
    case attn::DType::kF16:
      return 4e-3;  // four fp16 ulps at 1
    case attn::DType::kBF16:
      return 3e-2;  // about four bf16 ulps at 1
  }
  return 0;
}

// Largest |a - b| over two float arrays, where equal infinities count as equal; NaN as soon as
// either holds a NaN (an unwritten, poisoned element among them).
double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (std::isnan(d)) return d;
    worst = std::max(worst, d);
  }
  return worst;
}

std::vector<float> ToFloat(const std::vector<uint8_t>& buf, attn::DType t) {
  std::vector<float> out(buf.size() / attn::DTypeSize(t));
  for (size_t i = 0; i < out.size(); ++i) out[i] = attn::LoadAsFloat(buf.data(), t, i);
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main() {
  attn::AttentionProblem p;
  {
    absl::StatusOr<attn::DType> dtype = attn::ParseDType(absl::GetFlag(FLAGS_dtype));
    if (!dtype.ok()) {
      absl::FPrintF(stderr, "attn_local: %s\n", dtype.status().ToString());
      return 2;
    }
    const int64_t seqlen_q = absl::GetFlag(FLAGS_seqlen_q);
    const int64_t seqlen_k =
        absl::GetFlag(FLAGS_seqlen_k) > 0 ? absl::GetFlag(FLAGS_seqlen_k) : seqlen_q;
    const int heads = absl::GetFlag(FLAGS_heads);
    const int kv_heads = absl::GetFlag(FLAGS_kv_heads) > 0 ? absl::GetFlag(FLAGS_kv_heads) : heads;
    p = attn::DenseProblem(*dtype, absl::GetFlag(FLAGS_batch), seqlen_q, seqlen_k, heads, kv_heads,
                           absl::GetFlag(FLAGS_head_dim), absl::GetFlag(FLAGS_causal));
    p.window_left = absl::GetFlag(FLAGS_window_left);
    p.window_right = absl::GetFlag(FLAGS_window_right);
  }
  if (absl::Status s = attn::ValidateProblem(p); !s.ok()) {
    absl::FPrintF(stderr, "attn_local: %s\n", s.ToString());
    return 2;
  }
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  attn::EngineOptions options;
  options.num_threads = absl::GetFlag(FLAGS_threads);

  absl::StatusOr<std::unique_ptr<attn::Engine>> engine =
      MakeEngine(absl::GetFlag(FLAGS_engine), options);
  absl::StatusOr<std::unique_ptr<attn::Engine>> reference =
      attn::CreateEngine(attn::EngineKind::kCpuReference, options);
  for (const auto* e : {&engine, &reference}) {
    if (!e->ok()) {
      absl::FPrintF(stderr, "attn_local: %s\n", e->status().ToString());
      return 2;
    }
  }
  if (const attn::Support s = (*engine)->SupportsForward(p); !s.ok()) {
    absl::FPrintF(stderr, "attn_local: %s: %s\n", (*engine)->name(), s.status().ToString());
    return 2;
  }

  const HostTensors inputs = MakeInputs(p, absl::GetFlag(FLAGS_seed));
  absl::StatusOr<RunResult> run = Run(**engine, p, inputs, 1, repeats, options.device);
  absl::StatusOr<RunResult> ref = Run(**reference, p, inputs, 0, 1, options.device);
  for (const auto* r : {&run, &ref}) {
    if (!r->ok()) {
      absl::FPrintF(stderr, "attn_local: forward failed: %s\n", r->status().ToString());
      return 2;
    }
  }

  const std::vector<float> o = ToFloat(run->o, p.dtype);
  const std::vector<float> o_ref = ToFloat(ref->o, p.dtype);
  double ref_scale = 1;
  for (float x : o_ref) ref_scale = std::max<double>(ref_scale, std::fabs(x));
  const double o_err = MaxAbsDiff(o, o_ref);
  const double lse_err = MaxAbsDiff(run->lse, ref->lse);
  const double tolerance = absl::GetFlag(FLAGS_tolerance) > 0 ? absl::GetFlag(FLAGS_tolerance)
                                                              : DefaultTolerance(p.dtype);
  const double o_bound = tolerance * ref_scale;
  // The LSE is float32 whatever the dtype: only accumulation order separates the engines.
  const double lse_bound = 1e-3;
  const double ms = Median(run->times_ms);

  absl::PrintF("problem:   %s\n", p.DebugString());
  absl::PrintF("engine:    %s (%s memory)\n", (*engine)->name(),
               (*engine)->memory_space() == attn::MemorySpace::kHost ? "host" : "device");
  absl::PrintF("time:      %.3f ms median of %d runs (min %.3f ms)\n", ms, repeats,
               *std::min_element(run->times_ms.begin(), run->times_ms.end()));
  absl::PrintF("speed:     %.2f GFLOP/s (%.4g GFLOP)\n", p.forward_flops() / (ms * 1e6),
               p.forward_flops() / 1e9);
  absl::PrintF("reference: %s, %.3f ms\n", (*reference)->name(), ref->times_ms.front());
  const size_t shown = std::min<size_t>(4, o.size());
  for (size_t i = 0; i < shown; ++i) {
    absl::PrintF("O[0,0,%d]:  %+.6f (reference %+.6f)\n", i, o[i], o_ref[i]);
  }
  absl::PrintF("max |O - O_ref|:     %.3g (bound %.3g)\n", o_err, o_bound);
  absl::PrintF("max |LSE - LSE_ref|: %.3g (bound %.3g)\n", lse_err, lse_bound);
  const bool ok = o_err <= o_bound && lse_err <= lse_bound;  // false for NaN
  absl::PrintF("%s\n", ok ? "PASS" : "FAIL: error beyond the bound");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Runs one attention problem through an engine in this process and checks it against the "
      "float64 CPU reference.\n"
      "Example: attn_local --engine=cpu_tiled --dtype=bf16 --batch=2 --seqlen_q=512 --heads=8 "
      "--head_dim=64 --causal\n"
      "Engines with device memory (cuda_fused, cuda_naive) need a CUDA build and a GPU; their "
      "inputs are copied to the device and the output back.");
  absl::ParseCommandLine(argc, argv);
  return Main();
}
