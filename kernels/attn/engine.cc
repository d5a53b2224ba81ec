// Names of engine kinds and refusal reasons, and the Support answer. CreateEngine and the other
// questions about every kind live in the registry (kernels/registry/engine_registry.cc).
#include "attn/engine.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

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

std::string_view RefusalName(Refusal reason) {
  switch (reason) {
    case Refusal::kNone:
      return "none";
    case Refusal::kInvalidProblem:
      return "invalid_problem";
    case Refusal::kUnsupportedDtype:
      return "unsupported_dtype";
    case Refusal::kUnsupportedHeadDim:
      return "unsupported_head_dim";
    case Refusal::kUnaligned:
      return "unaligned";
    case Refusal::kTooLarge:
      return "too_large";
    case Refusal::kUnavailable:
      return "unavailable";
    case Refusal::kOther:
      return "other";
  }
  return "unknown";
}

Support::Support(Refusal reason, absl::Status status)
    : reason_(reason), status_(std::move(status)) {
  // A refusal always carries both: a reason to branch on and a status to return.
  if (reason_ == Refusal::kNone) reason_ = Refusal::kOther;
  if (status_.ok())
    status_ = absl::UnknownError(absl::StrCat("refused: ", std::string(RefusalName(reason_))));
}

std::ostream& operator<<(std::ostream& out, const Support& support) {
  if (support.ok()) return out << "supported";
  return out << RefusalName(support.reason()) << ": " << support.status();
}

Support Engine::SupportsPagedForward(const AttentionProblem&) const {
  return Support(Refusal::kOther,
                 absl::UnimplementedError(absl::StrCat(std::string(name()),
                                                       ": keys and values in pages are not "
                                                       "supported")));
}

absl::Status Engine::ForwardPaged(const AttentionProblem& p, const PagedForwardArgs&) {
  return SupportsPagedForward(p).status();
}

Support ValidProblemSupport(const AttentionProblem& p) {
  absl::Status valid = ValidateProblem(p);
  if (valid.ok()) return Support();
  return Support(Refusal::kInvalidProblem, std::move(valid));
}

}  // namespace attn
