#include "server/batcher.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

bool Compatible(const Work& a, const Work& b) {
  return a.batch.has_value() && b.batch.has_value() && *a.batch == *b.batch && a.device == b.device;
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

bool Batcher::HasQueuedWork() const {
  absl::MutexLock lock(&mu_);
  return !queue_.empty();
}

bool Batcher::Runnable(const Work& work, int device) const {
  return (work.device < 0 || work.device == device) &&
         (work.exclusive == nullptr || running_.count(work.exclusive) == 0);
}

std::deque<std::unique_ptr<Work>>::const_iterator Batcher::Seed(int device) const {
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (Runnable(**it, device)) return it;
  }
  return queue_.end();
}

bool Batcher::SeedBatchFull(int device) const {
  if (stopping_) return true;
  const auto seed_it = Seed(device);
  if (seed_it == queue_.end()) return true;
  const Work& seed = **seed_it;
  if (!seed.batch.has_value()) return true;  // runs alone: nothing to wait for
  const int max_requests =
      seed.batch->paged ? options_.max_session_batch : options_.max_batch_requests;
  int count = 0;
  int64_t tokens = 0;
  for (auto it = seed_it; it != queue_.end(); ++it) {
    if (!Compatible(seed, **it) || !Runnable(**it, device)) continue;
    ++count;
    tokens += (*it)->tokens;
    if (count >= max_requests || tokens >= options_.max_batch_tokens) return true;
  }
  return false;
}

Batch Batcher::TakeBatch(int device) {
  Batch batch;
  auto seed_it = queue_.begin() + (Seed(device) - queue_.cbegin());
  batch.push_back(std::move(*seed_it));
  auto it = queue_.erase(seed_it);
  const Work& seed = *batch.front();
  int64_t tokens = seed.tokens;
  int64_t bytes = seed.bytes;
  std::set<const void*> keys;
  if (seed.exclusive != nullptr) keys.insert(seed.exclusive);
  const int max_requests = seed.batch.has_value() && seed.batch->paged
                               ? options_.max_session_batch
                               : options_.max_batch_requests;
  // The seed always goes, even alone over the budget (validation capped it at the memory
  // limit); the others stop at the first one that does not fit, keeping FIFO order. A second
  // work of an exclusive key already in the batch waits for the next one.
  while (it != queue_.end() && static_cast<int>(batch.size()) < max_requests) {
    Work& work = **it;
    if (!Compatible(seed, work) || !Runnable(work, device) ||
        (work.exclusive != nullptr && keys.count(work.exclusive) != 0)) {
      ++it;
      continue;
    }
    if (tokens + work.tokens > options_.max_batch_tokens ||
        bytes + work.bytes > options_.memory_limit_bytes) {
      break;
    }
    tokens += work.tokens;
    bytes += work.bytes;
    if (work.exclusive != nullptr) keys.insert(work.exclusive);
    batch.push_back(std::move(*it));
    it = queue_.erase(it);
  }
  running_.insert(keys.begin(), keys.end());
  metrics_->OnDequeued(static_cast<int>(batch.size()));
  return batch;
}

void Batcher::Release(const Batch& batch) {
  absl::MutexLock lock(&mu_);
  for (const auto& work : batch) {
    if (work->exclusive != nullptr) running_.erase(work->exclusive);
  }
}

Batch Batcher::Next(int device) {
  absl::MutexLock lock(&mu_);
  struct Args {
    const Batcher* self;
    int device;
  } args{this, device};
  const absl::Condition runnable(
      +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return a->self->stopping_ || a->self->Seed(a->device) != a->self->queue_.end();
      },
      &args);
  while (true) {
    mu_.Await(runnable);
    if (Seed(device) == queue_.end()) {
      // Stopping, with nothing this lane may run. What is left belongs to other devices' lanes
      // or waits for a key another lane holds: leave once the queue is empty, or take what
      // becomes runnable.
      mu_.Await(absl::Condition(
          +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return a->self->queue_.empty() || a->self->Seed(a->device) != a->self->queue_.end();
          },
          &args));
      if (queue_.empty()) return {};
      continue;
    }
    // Work-conserving by default: this lane is idle, so it runs what is queued now. Under load
    // the lanes are busy and requests pile up meanwhile, which is what grows batches. A
    // positive max_queue_delay holds a batch that is not full up to that long.
    if (options_.max_queue_delay > absl::ZeroDuration()) {
      const absl::Time close_at = (*Seed(device))->accepted + options_.max_queue_delay;
      struct FullArgs {
        const Batcher* self;
        int device;
      } full{this, device};
      mu_.AwaitWithDeadline(absl::Condition(
                                +[](FullArgs* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                  return a->self->SeedBatchFull(a->device);
                                },
                                &full),
                            close_at);
      if (Seed(device) == queue_.end()) continue;  // another lane took it
    }
    return TakeBatch(device);
  }
}

}  // namespace attnserve
