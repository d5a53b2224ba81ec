// Training jobs' metrics, in the server's prometheus registry (docs/training.md lists them):
//   attnserve_training_jobs{state}                 jobs by state (gauge)
//   attnserve_training_steps_total                 optimiser steps run
//   attnserve_training_tokens_total                tokens trained on (rate() = tokens/s)
//   attnserve_training_tokens_per_second{worker}   the running job's rate, per scheduler worker
//   attnserve_training_loss{worker}                the running job's last loss, per worker
//   attnserve_training_yield_seconds_total         time jobs waited for Attend traffic
//   attnserve_training_checkpoint_writes_total{result}   ok / error
//   attnserve_training_checkpoint_duration_seconds       write time, fsync and rename included
// The per-job series are labelled by worker (bounded by the workers' count), never by job id;
// a worker's series exist only while it runs a job.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/training/training_job.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace attnserve::training {

class TrainingMetrics {
 public:
  // Null registry: every hook does nothing.
  TrainingMetrics(prometheus::Registry* registry, int workers);

  void OnTransition(std::optional<JobState> from, JobState to);
  void OnJobStarted(int worker);
  void OnStep(int worker, double loss, int64_t tokens, double tokens_per_second);
  void OnJobEnded(int worker);
  void OnYield(absl::Duration waited);
  void OnCheckpoint(bool ok, absl::Duration duration);

 private:
  static constexpr int kStates = static_cast<int>(JobState::kCancelled) + 1;
  bool enabled_ = false;
  std::array<prometheus::Gauge*, kStates> jobs_{};
  prometheus::Counter* steps_ = nullptr;
  prometheus::Counter* tokens_ = nullptr;
  prometheus::Counter* yield_ = nullptr;
  prometheus::Counter* checkpoints_ok_ = nullptr;
  prometheus::Counter* checkpoints_error_ = nullptr;
  prometheus::Histogram* checkpoint_duration_ = nullptr;
  prometheus::Family<prometheus::Gauge>* loss_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* rate_family_ = nullptr;
  absl::Mutex mu_;  // the per-worker series come and go with jobs
  std::vector<prometheus::Gauge*> loss_ ABSL_GUARDED_BY(mu_);
  std::vector<prometheus::Gauge*> rate_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve::training
