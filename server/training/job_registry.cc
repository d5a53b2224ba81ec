#include "server/training/job_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnserve::training {

std::string_view JobStateName(JobState state) {
  switch (state) {
    case JobState::kQueued:
      return "queued";
    case JobState::kRunning:
      return "running";
    case JobState::kSucceeded:
      return "succeeded";
    case JobState::kFailed:
      return "failed";
    case JobState::kCancelled:
      return "cancelled";
  }
  return "queued";
}

void Curve::Add(int64_t step, float step_loss, float step_metric) {
  if (step % stride != 0) return;
  steps.push_back(step);
  loss.push_back(step_loss);
  metric.push_back(step_metric);
  if (steps.size() < kMaxPoints) return;
  stride *= 2;
  size_t kept = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i] % stride != 0) continue;
    steps[kept] = steps[i];
    loss[kept] = loss[i];
    metric[kept] = metric[i];
    ++kept;
  }
  steps.resize(kept);
  loss.resize(kept);
  metric.resize(kept);
}

void JobRegistry::Add(std::shared_ptr<Job> job) {
  const JobState state = job->state;
  {
    absl::MutexLock lock(&mu_);
    jobs_[job->id] = std::move(job);
  }
  if (on_transition_) on_transition_(std::nullopt, state);
}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::Find(const Identity& caller,
                                                       const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end() || !(it->second->owner == caller)) {
    return absl::NotFoundError(absl::StrCat("training job '", id, "' not found"));
  }
  return it->second;
}

std::vector<std::shared_ptr<Job>> JobRegistry::List(const Identity& caller) const {
  std::vector<std::shared_ptr<Job>> jobs;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, job] : jobs_) {
    if (job->owner == caller) jobs.push_back(job);
  }
  std::sort(jobs.begin(), jobs.end(), [](const auto& a, const auto& b) {
    return a->created != b->created ? a->created < b->created : a->id < b->id;
  });
  return jobs;
}

int JobRegistry::Unfinished() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, job] : jobs_) n += Finished(job->state) ? 0 : 1;
  return n;
}

void JobRegistry::Read(const std::function<void()>& read) const {
  absl::MutexLock lock(&mu_);
  read();
}

void JobRegistry::Update(Job& job, const std::function<void()>& change) {
  std::vector<std::shared_ptr<JobWatcher>> tell;
  JobState before, after;
  {
    absl::MutexLock lock(&mu_);
    before = job.state;
    change();
    after = job.state;
    ++job.version;
    const absl::Time now = absl::Now();
    if (before != after || now - job.last_notified >= kProgressInterval) {
      job.last_notified = now;
      if (auto it = watchers_.find(&job); it != watchers_.end()) tell = it->second;
    }
  }
  if (before != after && on_transition_) on_transition_(before, after);
  for (const auto& watcher : tell) watcher->OnJobChanged();
}

void JobRegistry::Watch(Job& job, std::shared_ptr<JobWatcher> watcher) {
  absl::MutexLock lock(&mu_);
  watchers_[&job].push_back(std::move(watcher));
}

void JobRegistry::Unwatch(Job& job, const JobWatcher* watcher) {
  absl::MutexLock lock(&mu_);
  auto it = watchers_.find(&job);
  if (it == watchers_.end()) return;
  std::erase_if(it->second, [&](const auto& w) { return w.get() == watcher; });
  if (it->second.empty()) watchers_.erase(it);
}

std::vector<std::shared_ptr<JobWatcher>> JobRegistry::AllWatchers() const {
  std::vector<std::shared_ptr<JobWatcher>> all;
  absl::MutexLock lock(&mu_);
  for (const auto& [job, watchers] : watchers_)
    all.insert(all.end(), watchers.begin(), watchers.end());
  return all;
}

}  // namespace attnserve::training
