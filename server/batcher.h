// The queue between the service and the lanes: admission into one bounded FIFO, which requests
// may share an engine call (equal BatchKeys), and what a free lane takes.
//
// Close policy: a lane that is free takes the compatible requests queued at that moment and
// runs them at once (work-conserving; max_queue_delay = 0, the default). Batches grow with load
// because requests pile up while every lane is busy. A positive max_queue_delay makes a free
// lane hold a batch that is not full until its query + key tokens reach max_batch_tokens, it
// holds max_batch_requests requests, or max_queue_delay has passed since its oldest request was
// accepted. A batch never exceeds max_batch_tokens, max_batch_requests (max_session_batch for
// session steps, which carry a token or a few each) or the lane's memory limit; work without a
// BatchKey always runs alone.
//
// Affinity: work bound to a device slot (a session's steps) goes only to that slot's lanes, and
// work sharing an exclusive key (one session's steps and appends) runs one at a time, in queue
// order: a lane skips it while another lane holds the key.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/metrics.h"
#include "server/work.h"

namespace attnserve {

using Batch = std::vector<std::unique_ptr<Work>>;

class Batcher {
 public:
  struct Options {
    int64_t max_batch_tokens = 16384;
    int max_batch_requests = 32;
    absl::Duration max_queue_delay = absl::ZeroDuration();  // 0: never hold a batch
    int queue_capacity = 256;
    int64_t memory_limit_bytes = int64_t{2} << 30;  // one batch's working set
    int max_session_batch = 256;                    // session steps in one launch
  };

  Batcher(const Options& options, Metrics* metrics) : options_(options), metrics_(metrics) {}
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queues the work. RESOURCE_EXHAUSTED when the queue is full and UNAVAILABLE once stopping;
  // `done` is not called then.
  absl::Status Submit(std::unique_ptr<Work> work);

  // For a lane thread of device slot `device`: waits for the next batch it may run, by the close
  // policy. Empty once stopping and nothing is left. The batch's exclusive keys are held until
  // Release.
  Batch Next(int device);
  // The lane is done with these keys (its batch's effects are visible): their next work may go.
  void Release(const Batch& batch);

  // Refuses new work; lanes run everything already queued, then Next returns empty.
  void Stop();

  bool HasQueuedWork() const;
  const Options& options() const { return options_; }

 private:
  // The first queued work a lane of `device` may run now, or queue_.end().
  std::deque<std::unique_ptr<Work>>::const_iterator Seed(int device) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Runnable(const Work& work, int device) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool SeedBatchFull(int device) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Batch TakeBatch(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  Metrics* const metrics_;
  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Work>> queue_ ABSL_GUARDED_BY(mu_);
  std::set<const void*> running_ ABSL_GUARDED_BY(mu_);  // exclusive keys held by lanes
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attnserve
