// Factories of the CPU engines (used by the registry's CreateEngine). Both engines run every
// valid problem, so their support is ValidProblemSupport.
#pragma once

#include <memory>

#include "attn/engine.h"

namespace attn {

// float64 reference: materialises S and P; forward and analytic backward. Tests only.
std::unique_ptr<Engine> MakeCpuReferenceEngine(const EngineOptions& options);
// Online-softmax tiled forward and recomputing backward, multi-threaded.
std::unique_ptr<Engine> MakeCpuTiledEngine(const EngineOptions& options);

}  // namespace attn
