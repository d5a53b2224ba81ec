#include "server/metrics.h"

namespace attnserve {

void Metrics::OnAccepted() { accepted_.fetch_add(1, std::memory_order_relaxed); }

void Metrics::OnRejected(const absl::Status&) { rejected_.fetch_add(1, std::memory_order_relaxed); }

void Metrics::OnBatch(int requests, int64_t, absl::Duration) {
  batches_.fetch_add(1, std::memory_order_relaxed);
  if (requests > 1) batched_requests_.fetch_add(requests, std::memory_order_relaxed);
  int seen = max_batch_requests_.load(std::memory_order_relaxed);
  while (requests > seen &&
         !max_batch_requests_.compare_exchange_weak(seen, requests, std::memory_order_relaxed)) {
  }
}

void Metrics::OnFinished(const absl::Status& status, absl::Duration, absl::Duration) {
  (status.ok() ? completed_ : failed_).fetch_add(1, std::memory_order_relaxed);
}

v1::Stats Metrics::Snapshot() const {
  v1::Stats s;
  s.set_requests_accepted(accepted_.load(std::memory_order_relaxed));
  s.set_requests_rejected(rejected_.load(std::memory_order_relaxed));
  s.set_requests_completed(completed_.load(std::memory_order_relaxed));
  s.set_requests_failed(failed_.load(std::memory_order_relaxed));
  s.set_batches(batches_.load(std::memory_order_relaxed));
  s.set_batched_requests(batched_requests_.load(std::memory_order_relaxed));
  s.set_max_batch_requests_seen(max_batch_requests_.load(std::memory_order_relaxed));
  return s;
}

}  // namespace attnserve
