// Runs training jobs: its own queue (first submitted, first run), one worker thread per training
// slot (by default one per device), each running one job at a time, step by step. Training is
// offline work below Attend traffic: before every step a worker asks `serving_busy` and waits
// while it says yes (never inside a step, which is short). Every checkpoint_every steps, when
// a job ends, and when the scheduler stops (SIGTERM), a job's record goes to the checkpoint
// store; a restarted server resumes unfinished jobs from their last record. Submissions and
// cancellations of queued jobs are persisted on an I/O thread of the scheduler's, so that gRPC
// handlers never wait on the disk.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/training/checkpoint_store.h"
#include "server/training/job_registry.h"
#include "server/training/trainer.h"
#include "server/training/training_metrics.h"

namespace attnserve::training {

class TrainingScheduler {
 public:
  struct Options {
    std::vector<TrainerOptions> workers = {TrainerOptions{}};  // one thread each
    int checkpoint_every = 100;                                // when the spec gives 0
    // Asked before every step; the step waits while it returns true. Null: never busy.
    std::function<bool()> serving_busy;
    absl::Duration busy_poll = absl::Milliseconds(1);
  };

  // `store` may be null (no --training_dir): jobs then live in memory only.
  TrainingScheduler(Options options, JobRegistry* registry, CheckpointStore* store,
                    TrainingMetrics* metrics);
  ~TrainingScheduler();
  TrainingScheduler(const TrainingScheduler&) = delete;
  TrainingScheduler& operator=(const TrainingScheduler&) = delete;

  // A job the registry holds, new: its record and uploaded bytes are written on the I/O thread,
  // then it is queued (a job FAILED at submission is only written).
  void Submit(std::shared_ptr<Job> job, std::string inputs, std::string targets);
  // An unfinished job loaded from the store: queued as it is.
  void Resume(std::shared_ptr<Job> job);
  // A queued job ends CANCELLED now; a running one after its current step.
  void Cancel(const std::shared_ptr<Job>& job);

  // Running jobs stop after their current step and are checkpointed as unfinished; queued jobs
  // stay queued on disk. Returns when every thread is done. Idempotent.
  void Stop();

 private:
  void WorkerLoop(int worker);
  void IoLoop();
  void PostIo(std::function<void()> work);
  void Run(int worker, const std::shared_ptr<Job>& job);
  // Writes the job's record (with `state` and, when asked, the optimiser's moments).
  absl::Status Persist(const Job& job, const TrainerState* state, bool with_moments);
  // The job's last word: the state, the error, the final weights, one record (without the
  // weights when the full record does not fit).
  void End(int worker, const std::shared_ptr<Job>& job, JobState state, const std::string& error,
           const Trainer* trainer);
  bool Stopping() const;
  int CheckpointEvery(const Job& job) const;

  const Options options_;
  JobRegistry* const registry_;
  CheckpointStore* const store_;
  TrainingMetrics* const metrics_;

  mutable absl::Mutex mu_;
  std::deque<std::shared_ptr<Job>> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void()>> io_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool io_stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
  std::thread io_thread_;
  bool stopped_ = false;  // Stop's own, called from one thread
};

}  // namespace attnserve::training
