#include "cuda/common/dispatch.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"
#include "cuda/cuda_engines.h"

namespace attn::cuda {
namespace {

constexpr int64_t kFusedAlignBytes = 16;

absl::Status CheckAligned(const char* name, const void* data, int64_t token_stride,
                          int64_t head_stride, int64_t tokens, int heads, int64_t element_size) {
  if (tokens == 0) return absl::OkStatus();
  if (reinterpret_cast<uintptr_t>(data) % kFusedAlignBytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": data is not ", kFusedAlignBytes, "-byte aligned"));
  }
  if (tokens > 1 && (token_stride * element_size) % kFusedAlignBytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": token_stride ", token_stride,
                                                   " elements is not a multiple of ",
                                                   kFusedAlignBytes, " bytes"));
  }
  if (heads > 1 && (head_stride * element_size) % kFusedAlignBytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": head_stride ", head_stride,
                                                   " elements is not a multiple of ",
                                                   kFusedAlignBytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view PathPreferenceName(PathPreference preference) {
  switch (preference) {
    case PathPreference::kAuto:
      return "auto";
    case PathPreference::kFused:
      return "fused";
    case PathPreference::kNaive:
      return "naive";
  }
  return "unknown";
}

absl::StatusOr<PathPreference> ParsePathPreference(std::string_view name) {
  for (PathPreference p : {PathPreference::kAuto, PathPreference::kFused, PathPreference::kNaive}) {
    if (name == PathPreferenceName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("path: unknown '", std::string(name), "' (expected auto, fused or naive)"));
}

absl::Status CheckFusedAlignment(const AttentionProblem& p, const ForwardArgs& a) {
  const int64_t es = DTypeSize(p.dtype);
  const int64_t tq = p.total_q(), tk = p.total_k();
  ATTN_RETURN_IF_ERROR(
      CheckAligned("q", a.q.data, a.q.token_stride, a.q.head_stride, tq, p.num_heads, es));
  ATTN_RETURN_IF_ERROR(
      CheckAligned("k", a.k.data, a.k.token_stride, a.k.head_stride, tk, p.num_kv_heads, es));
  ATTN_RETURN_IF_ERROR(
      CheckAligned("v", a.v.data, a.v.token_stride, a.v.head_stride, tk, p.num_kv_heads, es));
  ATTN_RETURN_IF_ERROR(
      CheckAligned("o", a.o.data, a.o.token_stride, a.o.head_stride, tq, p.num_heads, es));
  return absl::OkStatus();
}

Dispatcher::Dispatcher(std::unique_ptr<Engine> fused, std::unique_ptr<Engine> naive)
    : fused_(std::move(fused)), naive_(std::move(naive)) {}

absl::StatusOr<std::unique_ptr<Dispatcher>> Dispatcher::Create(const EngineOptions& options) {
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<Engine> fused, MakeCudaFusedEngine(options));
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<Engine> naive, MakeCudaNaiveEngine(options));
  return std::make_unique<Dispatcher>(std::move(fused), std::move(naive));
}

absl::StatusOr<DispatchDecision> Dispatcher::Choose(const AttentionProblem& p,
                                                    const ForwardArgs& args,
                                                    PathPreference preference) const {
  ATTN_RETURN_IF_ERROR(ValidateForward(p, args));
  absl::Status fused_ok;
  if (preference != PathPreference::kNaive) {
    fused_ok = fused_->SupportsForward(p);
    if (fused_ok.ok()) fused_ok = CheckFusedAlignment(p, args);
    if (fused_ok.ok()) {
      return DispatchDecision{EngineKind::kCudaFused, preference == PathPreference::kFused
                                                          ? "fused requested"
                                                          : "fused kernel supports it"};
    }
    if (preference == PathPreference::kFused) {
      return absl::Status(fused_ok.code(), absl::StrCat("fused path requested but unusable: ",
                                                        std::string(fused_ok.message())));
    }
  }
  if (absl::Status s = naive_->SupportsForward(p); !s.ok()) return s;
  if (preference == PathPreference::kNaive) {
    return DispatchDecision{EngineKind::kCudaNaive, "naive requested"};
  }
  return DispatchDecision{EngineKind::kCudaNaive,
                          absl::StrCat("fused unusable: ", std::string(fused_ok.message()))};
}

absl::StatusOr<DispatchDecision> Dispatcher::Forward(const AttentionProblem& p,
                                                     const ForwardArgs& args,
                                                     PathPreference preference) {
  ATTN_ASSIGN_OR_RETURN(DispatchDecision decision, Choose(p, args, preference));
  Engine& engine = decision.path == EngineKind::kCudaFused ? *fused_ : *naive_;
  ATTN_RETURN_IF_ERROR(engine.Forward(p, args));
  return decision;
}

}  // namespace attn::cuda
