// The one interface every attention engine implements: CPU reference, CPU tiled, CUDA fused
// and CUDA naive. The server, the tests and the benchmarks only talk to engines through it.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <span>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/capability.h"
#include "attn/paged_kv.h"
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

// Why an engine does not run a problem: a bounded set that callers branch on (the server's
// fallback metrics) without reading messages.
enum class Refusal : uint8_t {
  kNone,                // it does run it
  kInvalidProblem,      // ValidateProblem refuses the problem: no engine runs it
  kUnsupportedDtype,    // no kernel for the dtype
  kUnsupportedHeadDim,  // no kernel for the head_dim (at this dtype)
  kUnaligned,           // pointers or strides break the engine's alignment rule
  kTooLarge,            // beyond the engine's memory or grid limits
  kUnavailable,         // the engine is not in this build, or its device is missing
  kOther,
};

std::string_view RefusalName(Refusal reason);

// An engine's answer to "do you run this problem": yes, or a refusal carrying both the reason
// and the status a caller returns (its code and a message naming what is not covered).
class Support {
 public:
  Support() = default;  // yes
  // A refusal; `reason` is not kNone and `status` is not OK.
  Support(Refusal reason, absl::Status status);

  bool ok() const { return reason_ == Refusal::kNone; }
  Refusal reason() const { return reason_; }
  const absl::Status& status() const { return status_; }

 private:
  Refusal reason_ = Refusal::kNone;
  absl::Status status_;
};

std::ostream& operator<<(std::ostream& out, const Support& support);

// ValidateProblem as an answer: a refusal with kInvalidProblem when the problem is invalid.
Support ValidProblemSupport(const AttentionProblem& p);

// Engines are not thread-safe: a caller that shares one across threads serialises its calls.
class Engine {
 public:
  virtual ~Engine() = default;

  virtual EngineKind kind() const = 0;
  std::string_view name() const { return EngineKindName(kind()); }
  virtual MemorySpace memory_space() const = 0;

  // Yes when Forward/Backward can run this (valid) problem; otherwise the reason, with
  // UNIMPLEMENTED, or RESOURCE_EXHAUSTED for a problem too large for the engine's memory.
  // The same answer as EngineSupports for this engine's kind and options.
  virtual Support SupportsForward(const AttentionProblem& p) const = 0;
  virtual Support SupportsBackward(const AttentionProblem& p) const = 0;

  // Computes O (and the LSE when args.lse is set). Validates the problem and views first.
  virtual absl::Status Forward(const AttentionProblem& p, const ForwardArgs& args) = 0;
  // Computes dQ, dK, dV from Q, K, V, O, dO and the forward LSE.
  virtual absl::Status Backward(const AttentionProblem& p, const BackwardArgs& args) = 0;

  // The forward with K and V read through a block table (attn/paged_kv.h): KV sessions'
  // prefill and decode steps. Engines without it refuse (kOther) and return UNIMPLEMENTED.
  virtual Support SupportsPagedForward(const AttentionProblem& p) const;
  virtual absl::Status ForwardPaged(const AttentionProblem& p, const PagedForwardArgs& args);
};

// The functions below answer for every engine kind, so they are defined by the registry
// (kernels/registry/, target attn_kernels), the one layer above all engines; this layer only
// declares them.

// Creates an engine. CUDA kinds return UNAVAILABLE when the library was built without CUDA or
// no usable device is present.
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(EngineKind kind,
                                                     const EngineOptions& options = {});

// OK when CreateEngine(kind, options) would find what the engine needs (the build's CUDA
// support, the device), without creating one; otherwise CreateEngine's UNAVAILABLE status.
absl::Status EngineAvailable(EngineKind kind, const EngineOptions& options = {});

// What an engine of this kind, created with these options, answers for the problem, without
// creating one: support depends only on the problem and the options.
Support EngineSupports(EngineKind kind, Pass pass, const AttentionProblem& p,
                       const EngineOptions& options = {});

// The fused kernels' table: every compiled (pass, dtype, head_dim) and its architectures. The
// same in every build; whether the fused engine runs here is EngineAvailable's answer.
std::span<const FusedCapability> FusedCapabilities();

// True when this build contains the CUDA engines (it may still find no device at run time).
bool BuiltWithCuda();

}  // namespace attn
