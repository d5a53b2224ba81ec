#include "clients/cli/reference_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/engine.h"
#include "attn/status_macros.h"
#include "attn/tensor.h"
#include "proto/wire/request_decoder.h"

namespace attnserve::client {
namespace {

// A few units in the last place of the storage type at |O| <= 1 (inputs are in [-1, 1]):
// the server's engine and the reference both round O once to the dtype.
double Tolerance(attn::DType dtype) {
  switch (dtype) {
    case attn::DType::kF32:
      return 1e-4;
    case attn::DType::kF16:
      return 2e-3;
    case attn::DType::kBF16:
      return 1.6e-2;
  }
  return 0;
}

// Gradients go through more roundings than O (O and dO in the dtype, D = rowsum(dO * O), the
// dtype's dQ/dK/dV), and grow with the sequence: the bound is relative to max(1, max |ref|).
double GradientTolerance(attn::DType dtype) {
  switch (dtype) {
    case attn::DType::kF32:
      return 1e-4;
    case attn::DType::kF16:
      return 4e-3;
    case attn::DType::kBF16:
      return 3e-2;
  }
  return 0;
}

absl::Status CheckTensorLike(const char* name, const v1::Tensor& got, const v1::Tensor& like,
                             const char* like_name) {
  if (got.dtype() != like.dtype()) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, ".dtype: differs from ", like_name, ".dtype"));
  }
  if (got.shape_size() != like.shape_size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, ".shape: rank differs from ", like_name));
  }
  for (int i = 0; i < got.shape_size(); ++i) {
    if (got.shape(i) != like.shape(i)) {
      return absl::FailedPreconditionError(
          absl::StrCat(name, ".shape[", i, "]: differs from ", like_name));
    }
  }
  if (got.data().size() != like.data().size()) {
    return absl::FailedPreconditionError(absl::StrCat(name, ".data: wrong length"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckResult> CheckAgainstReference(const v1::AttendRequest& request,
                                                  const v1::AttendResponse& response) {
  DecodeLimits limits;
  limits.memory_limit_bytes = int64_t{1} << 40;
  ATTN_ASSIGN_OR_RETURN(DecodedForward d, DecodeAttendRequest(request, limits));
  const attn::AttentionProblem& p = d.problem;

  const v1::Tensor& o = response.o();
  ATTN_RETURN_IF_ERROR(CheckTensorLike("o", o, request.q(), "q"));

  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<attn::Engine> engine,
                        attn::CreateEngine(attn::EngineKind::kCpuReference));
  std::vector<char> ref(request.q().data().size());
  std::vector<float> lse(static_cast<size_t>(p.total_q() * p.num_heads));
  attn::ForwardArgs args;
  args.q = attn::Packed<const void*>(d.q, p.num_heads, p.head_dim);
  args.k = attn::Packed<const void*>(d.k, p.num_kv_heads, p.head_dim);
  args.v = attn::Packed<const void*>(d.v, p.num_kv_heads, p.head_dim);
  args.o = attn::Packed<void*>(ref.data(), p.num_heads, p.head_dim);
  args.lse = lse.data();
  ATTN_RETURN_IF_ERROR(engine->Forward(p, args));

  CheckResult result;
  result.tolerance = Tolerance(p.dtype);
  const int64_t n = p.total_q() * p.num_heads * p.head_dim;
  for (int64_t i = 0; i < n; ++i) {
    const double got = attn::LoadAsFloat(o.data().data(), p.dtype, i);
    const double want = attn::LoadAsFloat(ref.data(), p.dtype, i);
    const double err = std::isnan(got) ? INFINITY : std::abs(got - want);
    if (err > result.max_abs_error) result.max_abs_error = err;
  }
  if (result.max_abs_error > result.tolerance) {
    return absl::FailedPreconditionError(
        absl::StrCat("o: max abs error ", result.max_abs_error, " exceeds ", result.tolerance));
  }
  if (response.has_lse()) {
    const v1::Tensor& l = response.lse();
    if (l.dtype() != v1::DTYPE_FLOAT32 || l.data().size() != lse.size() * sizeof(float)) {
      return absl::FailedPreconditionError("lse: expected float32 [num_heads, total_q]");
    }
    for (size_t i = 0; i < lse.size(); ++i) {
      const float got = attn::LoadAsFloat(l.data().data(), attn::DType::kF32, i);
      const double err =
          (std::isinf(got) && std::isinf(lse[i])) ? 0.0 : std::abs(double{got} - lse[i]);
      if (!(err <= result.max_lse_error)) result.max_lse_error = std::isnan(err) ? INFINITY : err;
    }
    if (result.max_lse_error > 1e-3) {
      return absl::FailedPreconditionError(
          absl::StrCat("lse: max abs error ", result.max_lse_error, " exceeds 1e-3"));
    }
  } else if (request.return_lse()) {
    return absl::FailedPreconditionError("lse: requested but missing");
  }
  return result;
}

absl::StatusOr<BackwardCheckResult> CheckBackwardAgainstReference(
    const v1::AttendBackwardRequest& request, const v1::AttendBackwardResponse& response) {
  DecodeLimits limits;
  limits.memory_limit_bytes = int64_t{1} << 40;
  ATTN_ASSIGN_OR_RETURN(DecodedBackward backward, DecodeAttendBackwardRequest(request, limits));
  const DecodedForward& d = backward.forward;
  const attn::AttentionProblem& p = d.problem;
  const v1::AttendRequest& f = request.forward();
  ATTN_RETURN_IF_ERROR(CheckTensorLike("d_q", response.d_q(), f.q(), "q"));
  ATTN_RETURN_IF_ERROR(CheckTensorLike("d_k", response.d_k(), f.k(), "k"));
  ATTN_RETURN_IF_ERROR(CheckTensorLike("d_v", response.d_v(), f.v(), "v"));

  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<attn::Engine> engine,
                        attn::CreateEngine(attn::EngineKind::kCpuReference));
  std::vector<char> o(f.q().data().size());
  std::vector<float> lse(static_cast<size_t>(p.total_q() * p.num_heads));
  const char* o_data = backward.o;
  const float* lse_data = reinterpret_cast<const float*>(backward.lse);
  if (o_data == nullptr) {
    attn::ForwardArgs args;
    args.q = attn::Packed<const void*>(d.q, p.num_heads, p.head_dim);
    args.k = attn::Packed<const void*>(d.k, p.num_kv_heads, p.head_dim);
    args.v = attn::Packed<const void*>(d.v, p.num_kv_heads, p.head_dim);
    args.o = attn::Packed<void*>(o.data(), p.num_heads, p.head_dim);
    args.lse = lse.data();
    ATTN_RETURN_IF_ERROR(engine->Forward(p, args));
    o_data = o.data();
    lse_data = lse.data();
  } else {  // the request's bytes need not be aligned for float
    std::memcpy(lse.data(), backward.lse, lse.size() * sizeof(float));
    lse_data = lse.data();
  }
  std::vector<char> dq(f.q().data().size()), dk(f.k().data().size()), dv(f.v().data().size());
  attn::BackwardArgs b;
  b.q = attn::Packed<const void*>(d.q, p.num_heads, p.head_dim);
  b.k = attn::Packed<const void*>(d.k, p.num_kv_heads, p.head_dim);
  b.v = attn::Packed<const void*>(d.v, p.num_kv_heads, p.head_dim);
  b.o = attn::Packed<const void*>(o_data, p.num_heads, p.head_dim);
  b.d_o = attn::Packed<const void*>(backward.d_o, p.num_heads, p.head_dim);
  b.lse = lse_data;
  b.dq = attn::Packed<void*>(dq.data(), p.num_heads, p.head_dim);
  b.dk = attn::Packed<void*>(dk.data(), p.num_kv_heads, p.head_dim);
  b.dv = attn::Packed<void*>(dv.data(), p.num_kv_heads, p.head_dim);
  ATTN_RETURN_IF_ERROR(engine->Backward(p, b));

  BackwardCheckResult result;
  const char* names[3] = {"d_q", "d_k", "d_v"};
  const std::string* got[3] = {&response.d_q().data(), &response.d_k().data(),
                               &response.d_v().data()};
  const std::vector<char>* want[3] = {&dq, &dk, &dv};
  const int64_t es = attn::DTypeSize(p.dtype);
  for (int t = 0; t < 3; ++t) {
    const int64_t n = static_cast<int64_t>(want[t]->size()) / es;
    double scale = 1;
    for (int64_t i = 0; i < n; ++i) {
      scale = std::max(scale, std::abs(double{attn::LoadAsFloat(want[t]->data(), p.dtype, i)}));
    }
    result.tolerance[t] = GradientTolerance(p.dtype) * scale;
    for (int64_t i = 0; i < n; ++i) {
      const double g = attn::LoadAsFloat(got[t]->data(), p.dtype, i);
      const double w = attn::LoadAsFloat(want[t]->data(), p.dtype, i);
      const double err = std::isnan(g) ? INFINITY : std::abs(g - w);
      result.max_abs_error[t] = std::max(result.max_abs_error[t], err);
    }
    if (result.max_abs_error[t] > result.tolerance[t]) {
      return absl::FailedPreconditionError(absl::StrCat(
          names[t], ": max abs error ", result.max_abs_error[t], " exceeds ", result.tolerance[t]));
    }
  }
  return result;
}

}  // namespace attnserve::client
