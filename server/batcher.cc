#include "server/batcher.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

bool Compatible(const Work& a, const Work& b) {
  return a.batch.has_value() && b.batch.has_value() && *a.batch == *b.batch;
}

}  // namespace

absl::Status Batcher::Submit(std::unique_ptr<Work> work) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("server: shutting down, not accepting requests");
  if (static_cast<int>(queue_.size()) >= options_.queue_capacity) {
    return absl::ResourceExhaustedError(absl::StrCat("queue: full (", options_.queue_capacity,
                                                     " requests waiting); retry with backoff"));
  }
  queue_.push_back(std::move(work));
  metrics_->OnQueued();
  return absl::OkStatus();
}

void Batcher::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

bool Batcher::HasWorkOrStopping() const { return stopping_ || !queue_.empty(); }

bool Batcher::HasQueuedWork() const {
  absl::MutexLock lock(&mu_);
  return !queue_.empty();
}

bool Batcher::FrontBatchFull() const {
  if (stopping_ || queue_.empty()) return true;
  const Work& seed = *queue_.front();
  if (!seed.batch.has_value()) return true;  // runs alone: nothing to wait for
  int count = 0;
  int64_t tokens = 0;
  for (const auto& work : queue_) {
    if (!Compatible(seed, *work)) continue;
    ++count;
    tokens += work->tokens;
    if (count >= options_.max_batch_requests || tokens >= options_.max_batch_tokens) return true;
  }
  return false;
}

Batch Batcher::TakeBatch() {
  Batch batch;
  int64_t tokens = 0;
  int64_t bytes = 0;
  batch.push_back(std::move(queue_.front()));
  queue_.pop_front();
  const Work& seed = *batch.front();
  tokens = seed.tokens;
  bytes = seed.bytes;
  // The seed always goes, even alone over the budget (validation capped it at the memory
  // limit); the others stop at the first one that does not fit, keeping FIFO order.
  for (auto it = queue_.begin();
       it != queue_.end() && static_cast<int>(batch.size()) < options_.max_batch_requests;) {
    Work& work = **it;
    if (!Compatible(seed, work)) {
      ++it;
      continue;
    }
    if (tokens + work.tokens > options_.max_batch_tokens ||
        bytes + work.bytes > options_.memory_limit_bytes) {
      break;
    }
    tokens += work.tokens;
    bytes += work.bytes;
    batch.push_back(std::move(*it));
    it = queue_.erase(it);
  }
  metrics_->OnDequeued(static_cast<int>(batch.size()));
  return batch;
}

Batch Batcher::Next() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(this, &Batcher::HasWorkOrStopping));
    if (queue_.empty()) return {};  // stopping, and nothing left to run
    // Work-conserving by default: this lane is idle, so it runs what is queued now. Under load
    // the lanes are busy and requests pile up meanwhile, which is what grows batches. A
    // positive max_queue_delay holds a batch that is not full up to that long.
    if (options_.max_queue_delay > absl::ZeroDuration()) {
      const absl::Time close_at = queue_.front()->accepted + options_.max_queue_delay;
      mu_.AwaitWithDeadline(absl::Condition(this, &Batcher::FrontBatchFull), close_at);
      if (queue_.empty()) continue;  // another lane took it
    }
    return TakeBatch();
  }
}

}  // namespace attnserve
