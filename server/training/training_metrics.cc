#include "server/training/training_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <string>

namespace attnserve::training {

TrainingMetrics::TrainingMetrics(prometheus::Registry* registry, int workers)
    : loss_(workers, nullptr), rate_(workers, nullptr) {
  if (registry == nullptr) return;
  enabled_ = true;
  prometheus::Registry& r = *registry;
  auto& jobs = prometheus::BuildGauge()
                   .Name("attnserve_training_jobs")
                   .Help("Training jobs this server holds, by state")
                   .Register(r);
  for (int s = 0; s < kStates; ++s) {
    jobs_[s] = &jobs.Add({{"state", std::string(JobStateName(static_cast<JobState>(s)))}});
  }
  steps_ = &prometheus::BuildCounter()
                .Name("attnserve_training_steps_total")
                .Help("Optimiser steps run by training jobs")
                .Register(r)
                .Add({});
  tokens_ = &prometheus::BuildCounter()
                 .Name("attnserve_training_tokens_total")
                 .Help("Tokens training jobs trained on (batch_size x seqlen per step)")
                 .Register(r)
                 .Add({});
  yield_ = &prometheus::BuildCounter()
                .Name("attnserve_training_yield_seconds_total")
                .Help("Time training jobs waited between steps while Attend traffic was served")
                .Register(r)
                .Add({});
  auto& writes = prometheus::BuildCounter()
                     .Name("attnserve_training_checkpoint_writes_total")
                     .Help("Job records written (checkpoints, state changes), by result")
                     .Register(r);
  checkpoints_ok_ = &writes.Add({{"result", "ok"}});
  checkpoints_error_ = &writes.Add({{"result", "error"}});
  checkpoint_duration_ =
      &prometheus::BuildHistogram()
           .Name("attnserve_training_checkpoint_duration_seconds")
           .Help("Time to write a job record: temporary file, fsync, rename, folder fsync")
           .Register(r)
           .Add({},
                prometheus::Histogram::BucketBoundaries{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                        0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10});
  loss_family_ = &prometheus::BuildGauge()
                      .Name("attnserve_training_loss")
                      .Help("Loss of the last step of the job each scheduler worker runs")
                      .Register(r);
  rate_family_ = &prometheus::BuildGauge()
                      .Name("attnserve_training_tokens_per_second")
                      .Help(
                          "Training tokens/s of the job each scheduler worker runs, since it "
                          "(re)started")
                      .Register(r);
}

void TrainingMetrics::OnTransition(std::optional<JobState> from, JobState to) {
  if (!enabled_) return;
  if (from.has_value()) jobs_[static_cast<int>(*from)]->Decrement();
  jobs_[static_cast<int>(to)]->Increment();
}

void TrainingMetrics::OnJobStarted(int worker) {
  if (!enabled_) return;
  absl::MutexLock lock(&mu_);
  const std::map<std::string, std::string> labels = {{"worker", std::to_string(worker)}};
  loss_[worker] = &loss_family_->Add(labels);
  rate_[worker] = &rate_family_->Add(labels);
}

void TrainingMetrics::OnStep(int worker, double loss, int64_t tokens, double tokens_per_second) {
  if (!enabled_) return;
  steps_->Increment();
  tokens_->Increment(static_cast<double>(tokens));
  absl::MutexLock lock(&mu_);
  if (loss_[worker] != nullptr) loss_[worker]->Set(loss);
  if (rate_[worker] != nullptr) rate_[worker]->Set(tokens_per_second);
}

void TrainingMetrics::OnJobEnded(int worker) {
  if (!enabled_) return;
  absl::MutexLock lock(&mu_);
  if (loss_[worker] != nullptr) loss_family_->Remove(loss_[worker]);
  if (rate_[worker] != nullptr) rate_family_->Remove(rate_[worker]);
  loss_[worker] = rate_[worker] = nullptr;
}

void TrainingMetrics::OnYield(absl::Duration waited) {
  if (enabled_) yield_->Increment(absl::ToDoubleSeconds(waited));
}

void TrainingMetrics::OnCheckpoint(bool ok, absl::Duration duration) {
  if (!enabled_) return;
  (ok ? checkpoints_ok_ : checkpoints_error_)->Increment();
  if (ok) checkpoint_duration_->Observe(absl::ToDoubleSeconds(duration));
}

}  // namespace attnserve::training
