// Error metrics and the accuracy rule every engine test applies.
//
// The rule (FlashAttention's): compare against the float64 reference (EngineKind::kCpuReference).
//  - float16 / bfloat16 results: max|got - ref| <= kToleranceFactor * max|naive - ref| +
//    kAbsoluteFloor, where `naive` is the plain same-precision implementation of
//    naive_attention.h. An engine may be at most twice as wrong as an unfused framework
//    implementation in the same precision. The floor only rescues 0-vs-0 comparisons.
//  - float32 results: max|got - ref| <= rtol * max(1, max|ref|), rtol ~ 1e-5.
//  - Non-finite values must match: NaN where the reference is NaN, the same infinity where it is
//    infinite, and nothing non-finite elsewhere.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "attn/dtype.h"

namespace attn::testing {

inline constexpr double kToleranceFactor = 2.0;
inline constexpr double kAbsoluteFloor = 1e-5;
inline constexpr double kF32ForwardRtol = 1e-5;
inline constexpr double kF32BackwardRtol = 2e-5;
// LSE (always float32): |got - ref| <= kLseRtol * max(1, |ref|) element-wise.
inline constexpr double kLseRtol = 2e-5;

struct ErrorStats {
  int64_t count = 0;
  double max_abs_err = 0;  // over elements where both values are finite
  double mean_abs_err = 0;
  double max_abs_ref = 0;
  int64_t worst_index = -1;
  int64_t nonfinite_mismatches = 0;  // NaN/Inf in one but not the same in the other
  int64_t first_mismatch = -1;
  std::string ToString() const;
};

// Element-wise comparison of equally sized arrays.
ErrorStats Compare(const std::vector<double>& got, const std::vector<double>& ref);

// Applies the rule above to one output tensor. `naive` is required for float16/bfloat16 (the
// same-precision implementation's values), ignored for float32. The error names `what`.
absl::Status CheckAccuracy(std::string_view what, DType dtype, const std::vector<double>& got,
                           const std::vector<double>& ref, const std::vector<double>* naive,
                           double f32_rtol = kF32ForwardRtol);

// Share of elements (0..1) where got equals the reference rounded to the dtype (NaN matching
// NaN). An engine that accumulates in float32 and rounds once at the end reaches nearly 1, well
// beyond what the 2x rule can tell apart from a rounding bug such as truncation.
double FractionCorrectlyRounded(const std::vector<double>& got, const std::vector<double>& ref,
                                DType dtype);

// The LSE rule (kLseRtol); -inf must match -inf exactly.
absl::Status CheckLse(const std::vector<float>& got, const std::vector<double>& ref);

}  // namespace attn::testing
