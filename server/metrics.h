// The hooks the server calls as requests and batches move through it. Today they keep the
// counters GetServerInfo reports; the Prometheus exporter (next issue) plugs in behind the same
// calls, so no other file changes when it lands.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

class Metrics {
 public:
  // A request passed validation and entered the queue.
  void OnAccepted();
  // A request was turned away before queueing (queue full, draining, invalid, unauthenticated).
  void OnRejected(const absl::Status& why);
  // One engine call ran `requests` requests packed into `tokens` query + key tokens.
  void OnBatch(int requests, int64_t tokens, absl::Duration compute);
  // A queued request finished (ok or not).
  void OnFinished(const absl::Status& status, absl::Duration queue, absl::Duration total);

  v1::Stats Snapshot() const;

 private:
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> completed_{0};
  std::atomic<uint64_t> failed_{0};
  std::atomic<uint64_t> batches_{0};
  std::atomic<uint64_t> batched_requests_{0};
  std::atomic<int> max_batch_requests_{0};
};

}  // namespace attnserve
