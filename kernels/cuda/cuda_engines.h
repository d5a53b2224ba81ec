// Factories of the CUDA engines (used by CreateEngine). UNAVAILABLE when no device is usable.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "attn/engine.h"

namespace attn {

absl::StatusOr<std::unique_ptr<Engine>> MakeCudaFusedEngine(const EngineOptions& options);
absl::StatusOr<std::unique_ptr<Engine>> MakeCudaNaiveEngine(const EngineOptions& options);

}  // namespace attn
