// The registry: the answers attn/engine.h declares for every engine kind (creating one, whether
// one could be created, what one would support, the fused kernels' table). The one file that
// knows every engine, above them all.
#include <string>

#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "cpu/cpu_engines.h"
#include "cuda/fused/capabilities.h"
#if defined(ATTN_HAVE_CUDA)
#include "cuda/cuda_engines.h"
#endif

namespace attn {
namespace {

bool IsCudaKind(EngineKind kind) {
  return kind == EngineKind::kCudaFused || kind == EngineKind::kCudaNaive;
}

#if !defined(ATTN_HAVE_CUDA)
absl::Status NoCuda(EngineKind kind) {
  return absl::UnavailableError(
      absl::StrCat(std::string(EngineKindName(kind)), ": this build has no CUDA support"));
}
#endif

}  // namespace

bool BuiltWithCuda() {
#if defined(ATTN_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(EngineKind kind,
                                                     const EngineOptions& options) {
  switch (kind) {
    case EngineKind::kCpuReference:
      return MakeCpuReferenceEngine(options);
    case EngineKind::kCpuTiled:
      return MakeCpuTiledEngine(options);
    case EngineKind::kCudaFused:
    case EngineKind::kCudaNaive:
#if defined(ATTN_HAVE_CUDA)
      return kind == EngineKind::kCudaFused ? MakeCudaFusedEngine(options)
                                            : MakeCudaNaiveEngine(options);
#else
      return NoCuda(kind);
#endif
  }
  return absl::InvalidArgumentError("engine: unknown kind");
}

absl::Status EngineAvailable(EngineKind kind, const EngineOptions& options) {
  if (!IsCudaKind(kind)) return absl::OkStatus();
#if defined(ATTN_HAVE_CUDA)
  return CudaEngineAvailable(kind, options);
#else
  return NoCuda(kind);
#endif
}

Support EngineSupports(EngineKind kind, Pass pass, const AttentionProblem& p,
                       const EngineOptions& options) {
  if (!IsCudaKind(kind)) return ValidProblemSupport(p);
#if defined(ATTN_HAVE_CUDA)
  return CudaEngineSupports(kind, pass, p, options);
#else
  return Support(Refusal::kUnavailable, NoCuda(kind));
#endif
}

std::span<const FusedCapability> FusedCapabilities() { return cuda::kFusedKernels; }

}  // namespace attn
