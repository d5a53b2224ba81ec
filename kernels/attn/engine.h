// The one interface every attention engine implements: CPU reference, CPU tiled, CUDA fused
// and CUDA naive. The server, the tests and the benchmarks only talk to engines through it.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/problem.h"
#include "attn/tensor.h"

namespace attn {

enum class EngineKind : uint8_t {
  kCpuReference,  // float64, materialises S and P; for tests
  kCpuTiled,      // online-softmax tiles on the CPU, O(N d) memory
  kCudaFused,     // FlashAttention-style fused kernel
  kCudaNaive,     // S in device memory, softmax kernel, P @ V through cuBLAS
};

std::string_view EngineKindName(EngineKind kind);
absl::StatusOr<EngineKind> ParseEngineKind(std::string_view name);

enum class MemorySpace : uint8_t { kHost, kDevice };

struct EngineOptions {
  // CPU engines: worker threads; 0 = the hardware concurrency.
  int num_threads = 0;
  // CUDA engines: device ordinal.
  int device = 0;
  // CUDA engines: most bytes of device workspace the engine may hold (naive path's S/P).
  int64_t workspace_limit_bytes = int64_t{8} << 30;
};

// Engines are not thread-safe: a caller that shares one across threads serialises its calls.
class Engine {
 public:
  virtual ~Engine() = default;

  virtual EngineKind kind() const = 0;
  std::string_view name() const { return EngineKindName(kind()); }
  virtual MemorySpace memory_space() const = 0;

  // OK when Forward/Backward can run this (valid) problem; otherwise UNIMPLEMENTED, or
  // RESOURCE_EXHAUSTED for a problem too large for the engine's memory, with the reason.
  virtual absl::Status SupportsForward(const AttentionProblem& p) const = 0;
  virtual absl::Status SupportsBackward(const AttentionProblem& p) const = 0;

  // Computes O (and the LSE when args.lse is set). Validates the problem and views first.
  virtual absl::Status Forward(const AttentionProblem& p, const ForwardArgs& args) = 0;
  // Computes dQ, dK, dV from Q, K, V, O, dO and the forward LSE.
  virtual absl::Status Backward(const AttentionProblem& p, const BackwardArgs& args) = 0;
};

// Creates an engine. CUDA kinds return UNAVAILABLE when the library was built without CUDA or
// no usable device is present.
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(EngineKind kind,
                                                     const EngineOptions& options = {});

// True when this build contains the CUDA engines (it may still find no device at run time).
bool BuiltWithCuda();

}  // namespace attn
