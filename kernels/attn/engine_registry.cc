#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "cpu/cpu_engines.h"
#if defined(ATTN_HAVE_CUDA)
#include "cuda/cuda_engines.h"
#endif

namespace attn {

std::string_view EngineKindName(EngineKind kind) {
  switch (kind) {
    case EngineKind::kCpuReference:
      return "cpu_reference";
    case EngineKind::kCpuTiled:
      return "cpu_tiled";
    case EngineKind::kCudaFused:
      return "cuda_fused";
    case EngineKind::kCudaNaive:
      return "cuda_naive";
  }
  return "unknown";
}

absl::StatusOr<EngineKind> ParseEngineKind(std::string_view name) {
  for (EngineKind k : {EngineKind::kCpuReference, EngineKind::kCpuTiled, EngineKind::kCudaFused,
                       EngineKind::kCudaNaive}) {
    if (name == EngineKindName(k)) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("engine: unknown '", std::string(name),
                   "' (expected cpu_reference, cpu_tiled, cuda_fused, cuda_naive)"));
}

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
      return absl::UnavailableError(
          absl::StrCat(std::string(EngineKindName(kind)), ": this build has no CUDA support"));
#endif
  }
  return absl::InvalidArgumentError("engine: unknown kind");
}

}  // namespace attn
