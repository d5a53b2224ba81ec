// Chooses between the fused kernel and the naive path for each forward call, and says why.
//
// kAuto runs the fused kernel when it covers the problem (FusedForwardSupports: dtype,
// head_dim) and the tensors meet its alignment rule, the naive path otherwise. kFused on a
// problem the fused kernel cannot run is an error carrying the reason; kNaive always runs the
// naive path. Like engines, a Dispatcher is not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/engine.h"

namespace attn::cuda {

enum class PathPreference : uint8_t { kAuto, kFused, kNaive };

std::string_view PathPreferenceName(PathPreference preference);
// Accepts "auto", "fused", "naive".
absl::StatusOr<PathPreference> ParsePathPreference(std::string_view name);

// Which engine ran (or would run) and why.
struct DispatchDecision {
  EngineKind path = EngineKind::kCudaNaive;
  std::string reason;
};

// The fused kernel's alignment rule: 16-byte aligned base pointers, and token and head strides
// that are whole multiples of 16 bytes, for Q, K, V and O. INVALID_ARGUMENT naming the tensor
// otherwise.
absl::Status CheckFusedAlignment(const AttentionProblem& p, const ForwardArgs& args);

class Dispatcher {
 public:
  // Both engines are required; tests may pass stand-ins.
  Dispatcher(std::unique_ptr<Engine> fused, std::unique_ptr<Engine> naive);

  // Creates the CUDA fused and naive engines; UNAVAILABLE when there is no device.
  static absl::StatusOr<std::unique_ptr<Dispatcher>> Create(const EngineOptions& options = {});

  // The decision for this call, after validating the problem and views. Errors: invalid
  // arguments; kFused on a problem the fused kernel cannot run (its reason in the message);
  // a problem the chosen naive path cannot run (e.g. RESOURCE_EXHAUSTED).
  absl::StatusOr<DispatchDecision> Choose(const AttentionProblem& p, const ForwardArgs& args,
                                          PathPreference preference) const;

  // Choose, then run the chosen engine.
  absl::StatusOr<DispatchDecision> Forward(const AttentionProblem& p, const ForwardArgs& args,
                                           PathPreference preference = PathPreference::kAuto);

  Engine& fused() { return *fused_; }
  Engine& naive() { return *naive_; }

 private:
  std::unique_ptr<Engine> fused_;
  std::unique_ptr<Engine> naive_;
};

}  // namespace attn::cuda
