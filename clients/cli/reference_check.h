// Checks a server's answer against the CPU reference engine (float64) run locally on the same
// request.
#pragma once

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve::client {

struct CheckResult {
  double max_abs_error = 0;  // over O, in float
  double max_lse_error = 0;  // when the response carries an LSE
  double tolerance = 0;      // what max_abs_error was held to
};

// FAILED_PRECONDITION when the response does not match (shape, dtype or values beyond the
// dtype's tolerance); INVALID_ARGUMENT when the request itself is malformed.
absl::StatusOr<CheckResult> CheckAgainstReference(const v1::AttendRequest& request,
                                                  const v1::AttendResponse& response);

struct BackwardCheckResult {
  double max_abs_error[3] = {0, 0, 0};  // dQ, dK, dV
  double tolerance[3] = {0, 0, 0};      // each held to the dtype's tolerance x max(1, max |ref|)
};

// The same for AttendBackward: dQ, dK, dV against the reference engine's backward pass, from the
// O and LSE the request carries, or from the reference's own forward when it carries none.
absl::StatusOr<BackwardCheckResult> CheckBackwardAgainstReference(
    const v1::AttendBackwardRequest& request, const v1::AttendBackwardResponse& response);

}  // namespace attnserve::client
