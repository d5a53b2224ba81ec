// The scheduler's serving_busy question answered from the server's request counters, until the
// batcher answers it itself: busy while an admitted Attend / AttendBackward request is not yet
// answered, and for `quiet` after the last admission (a client that sends requests back to
// back leaves gaps shorter than that, and a training step started in one would delay the next
// request by up to a step).
#pragma once

#include <functional>

#include "absl/time/time.h"
#include "server/metrics.h"

namespace attnserve::training {

inline constexpr absl::Duration kServingQuietPeriod = absl::Milliseconds(20);

std::function<bool()> ServingBusyFromMetrics(const Metrics* metrics,
                                             absl::Duration quiet = kServingQuietPeriod);

}  // namespace attnserve::training
