#include "common/accuracy.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace attn::testing {

std::string ErrorStats::ToString() const {
  return absl::StrCat("n=", count, " max_abs_err=", max_abs_err, " (at ", worst_index,
                      ") mean_abs_err=", mean_abs_err, " max_abs_ref=", max_abs_ref,
                      " nonfinite_mismatches=", nonfinite_mismatches,
                      " first_mismatch=", first_mismatch);
}

ErrorStats Compare(const std::vector<double>& got, const std::vector<double>& ref) {
  ErrorStats s;
  s.count = static_cast<int64_t>(std::min(got.size(), ref.size()));
  if (got.size() != ref.size()) {
    s.nonfinite_mismatches = 1;
    s.first_mismatch = s.count;
  }
  double sum = 0;
  for (int64_t i = 0; i < s.count; ++i) {
    const double g = got[i], r = ref[i];
    if (std::isfinite(r)) s.max_abs_ref = std::max(s.max_abs_ref, std::abs(r));
    if (std::isfinite(g) && std::isfinite(r)) {
      const double e = std::abs(g - r);
      sum += e;
      if (e > s.max_abs_err) {
        s.max_abs_err = e;
        s.worst_index = i;
      }
      continue;
    }
    const bool same = (std::isnan(g) && std::isnan(r)) || g == r;
    if (!same) {
      if (s.first_mismatch < 0) s.first_mismatch = i;
      ++s.nonfinite_mismatches;
    }
  }
  s.mean_abs_err = s.count > 0 ? sum / static_cast<double>(s.count) : 0.0;
  return s;
}

absl::Status CheckAccuracy(std::string_view what, DType dtype, const std::vector<double>& got,
                           const std::vector<double>& ref, const std::vector<double>* naive,
                           double f32_rtol) {
  const ErrorStats s = Compare(got, ref);
  if (s.nonfinite_mismatches > 0) {
    return absl::InternalError(absl::StrCat(
        std::string(what), ": non-finite values differ from the reference: ", s.ToString()));
  }
  double limit;
  std::string rule;
  if (dtype == DType::kF32) {
    limit = f32_rtol * std::max(1.0, s.max_abs_ref);
    rule = absl::StrCat("rtol ", f32_rtol, " * max(1, max|ref|)");
  } else {
    if (naive == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(std::string(what), ": a low-precision check needs the naive result"));
    }
    const ErrorStats n = Compare(*naive, ref);
    limit = kToleranceFactor * n.max_abs_err + kAbsoluteFloor;
    rule = absl::StrCat(kToleranceFactor, " * naive max_abs_err ", n.max_abs_err, " + ",
                        kAbsoluteFloor);
  }
  if (s.max_abs_err > limit) {
    return absl::InternalError(absl::StrCat(std::string(what), " (", std::string(DTypeName(dtype)),
                                            "): max_abs_err ", s.max_abs_err, " > ", limit, " = ",
                                            rule, "; ", s.ToString()));
  }
  return absl::OkStatus();
}

double FractionCorrectlyRounded(const std::vector<double>& got, const std::vector<double>& ref,
                                DType dtype) {
  if (got.empty() || got.size() != ref.size()) return got.size() == ref.size() ? 1.0 : 0.0;
  int64_t exact = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double rounded = RoundToDType(static_cast<float>(ref[i]), dtype);
    exact += got[i] == rounded || (std::isnan(got[i]) && std::isnan(ref[i]));
  }
  return static_cast<double>(exact) / static_cast<double>(got.size());
}

absl::Status CheckLse(const std::vector<float>& got, const std::vector<double>& ref) {
  if (got.size() != ref.size()) {
    return absl::InternalError(absl::StrCat("lse: size ", got.size(), " vs ", ref.size()));
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], r = ref[i];
    if (std::isnan(g) && std::isnan(r)) continue;
    if (!std::isfinite(g) || !std::isfinite(r)) {
      if (g == r) continue;
      return absl::InternalError(absl::StrCat("lse[", i, "] = ", g, ", reference ", r));
    }
    if (std::abs(g - r) > kLseRtol * std::max(1.0, std::abs(r))) {
      return absl::InternalError(
          absl::StrCat("lse[", i, "] = ", g, ", reference ", r, " (error ", std::abs(g - r), ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace attn::testing
