// The CUDA engines' factories and their engine-less answers, for the registry
// (kernels/registry/). UNAVAILABLE when no device is usable.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/engine.h"
#include "cuda/fused/fused_forward.h"
#include "cuda/fused/paged_forward.h"

namespace attn {

// `kernel` pins one forward kernel (tests and benchmarks: kPortable, the mma.sync kernel, on
// Hopper too; kSm90Lockstep or kSm90Tma); `paged` forces the paged forward's kernel or split
// count instead of its heuristics (tests, and benchmarks that measure the heuristics);
// `forward_block_n` and `forward_consumers` run the TMA kernel at one of its compiled shapes
// (FusedForwardParams::block_n and consumer_warpgroups), `forward_ctas` on that many persistent
// CTAs (FusedForwardParams::persistent_ctas; the paged prefill's TMA kernel too).
absl::StatusOr<std::unique_ptr<Engine>> MakeCudaFusedEngine(
    const EngineOptions& options, cuda::FusedKernel kernel = cuda::FusedKernel::kAuto,
    const cuda::PagedOverrides& paged = {}, int forward_block_n = 0, int forward_ctas = 0,
    int forward_consumers = 0);
absl::StatusOr<std::unique_ptr<Engine>> MakeCudaNaiveEngine(const EngineOptions& options);

// EngineAvailable and EngineSupports for kCudaFused and kCudaNaive.
absl::Status CudaEngineAvailable(EngineKind kind, const EngineOptions& options);
Support CudaEngineSupports(EngineKind kind, Pass pass, const AttentionProblem& p,
                           const EngineOptions& options);

}  // namespace attn
