#include "server/training/serving_activity.h"

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace attnserve::training {
namespace {

class ServingActivity {
 public:
  ServingActivity(const Metrics* metrics, absl::Duration quiet)
      : metrics_(metrics), quiet_(quiet) {}

  bool Busy() {
    const v1::Stats stats = metrics_->Snapshot();
    const uint64_t answered = stats.requests_completed() + stats.requests_failed();
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&mu_);
    if (stats.requests_accepted() != accepted_) {
      accepted_ = stats.requests_accepted();
      last_admission_ = now;
    }
    return stats.requests_accepted() > answered || now - last_admission_ < quiet_;
  }

 private:
  const Metrics* const metrics_;
  const absl::Duration quiet_;
  absl::Mutex mu_;
  uint64_t accepted_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_admission_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace

std::function<bool()> ServingBusyFromMetrics(const Metrics* metrics, absl::Duration quiet) {
  auto activity = std::make_shared<ServingActivity>(metrics, quiet);
  return [activity] { return activity->Busy(); };
}

}  // namespace attnserve::training
