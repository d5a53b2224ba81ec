// The jobs of this server, by id, each owned by the identity that submitted it: a caller sees
// only its own (NOT_FOUND otherwise, as for an id that never existed). Holds every job's
// changing state under one lock, and tells watchers (WatchTrainingJob streams) when a job
// changes: at once for state changes, at most every kProgressInterval for progress.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/identity.h"
#include "server/training/training_job.h"

namespace attnserve::training {

// Told that a job changed; runs outside the registry's lock, on the thread that changed it.
class JobWatcher {
 public:
  virtual ~JobWatcher() = default;
  virtual void OnJobChanged() = 0;
};

class JobRegistry {
 public:
  static constexpr absl::Duration kProgressInterval = absl::Milliseconds(100);

  // Called (outside the lock) after every state transition, with the old and the new state;
  // the metrics' job gauges follow it.
  using TransitionHook = std::function<void(std::optional<JobState>, JobState)>;
  explicit JobRegistry(TransitionHook on_transition = nullptr)
      : on_transition_(std::move(on_transition)) {}

  void Add(std::shared_ptr<Job> job);
  // The caller's job, or NOT_FOUND.
  absl::StatusOr<std::shared_ptr<Job>> Find(const Identity& caller, const std::string& id) const;
  // The caller's jobs, oldest first.
  std::vector<std::shared_ptr<Job>> List(const Identity& caller) const;
  int Unfinished() const;

  // Runs `read` under the lock (to copy a job's state out).
  void Read(const std::function<void()>& read) const;
  // Runs `change` under the lock and tells the job's watchers: all of them when the state
  // changed, otherwise when kProgressInterval passed since they were last told.
  void Update(Job& job, const std::function<void()>& change);

  void Watch(Job& job, std::shared_ptr<JobWatcher> watcher);
  void Unwatch(Job& job, const JobWatcher* watcher);
  // Every watcher of every job, for the shutdown to end their streams.
  std::vector<std::shared_ptr<JobWatcher>> AllWatchers() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<const Job*, std::vector<std::shared_ptr<JobWatcher>>> watchers_ ABSL_GUARDED_BY(mu_);
  const TransitionHook on_transition_;
};

}  // namespace attnserve::training
