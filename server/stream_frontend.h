// AttendStream on gRPC's completion-queue API. The other methods use the callback API; this one
// carries the small-request throughput, and gRPC 1.51's callback API (without a background
// poller) routes every callback of every call through one shared completion queue and a pool
// of "nexting" threads, whose lock and thread hand-offs become the round trip under load
// (docs/server-performance.md). Here each stream lives on one of `threads` queues, and the
// thread that polls a queue runs that stream's reads and write completions itself.
//
// Requests are admitted as they are read, responses are written one at a time in completion
// order, tagged by request_id; a failed request becomes a response carrying `error`. The stream
// ends with OK once the client half-closed and every admitted request has been answered.
// Messages arrive as raw bytes and are parsed here, so that a message that does not parse ends
// the stream with INVALID_ARGUMENT (after answering what came before it) instead of looking like
// a half-close. What a stream holds is bounded (`max_buffered_bytes`: requests admitted and not
// yet answered, by their size, plus responses not yet written): past the bound the stream stops
// reading, so a client that never reads is slowed by HTTP/2 flow control instead of growing
// the server. Once the server drains, each newly read request is
// answered UNAVAILABLE and the stream ends with UNAVAILABLE as soon as everything it accepted is
// answered, without waiting for the client to half-close.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/attention_service.h"

namespace attnserve {

class StreamCall;

class StreamFrontend {
 public:
  struct Options {
    int threads = 1;                                 // completion queues, one polling thread each
    int64_t max_buffered_bytes = int64_t{64} << 20;  // per stream
  };

  StreamFrontend(AttentionService* service, const Options& options);
  ~StreamFrontend();

  // Before grpc::ServerBuilder::BuildAndStart.
  void AddQueues(grpc::ServerBuilder* builder);
  // After BuildAndStart: accepts streams on every queue and starts the threads.
  void Start();
  // After AttentionService::StartDraining: every open stream finishes once what it accepted is
  // answered.
  void StartDraining();
  // After grpc::Server::Shutdown has returned (every stream is over): shuts the queues down,
  // drains them and joins the threads. Idempotent.
  void Stop();

  // Bytes held by every stream: requests in progress and responses waiting to be written.
  int64_t buffered_bytes() const { return buffered_bytes_.load(); }

 private:
  friend class StreamCall;
  void Track(const std::shared_ptr<StreamCall>& call);
  void Untrack(const StreamCall* call);

  AttentionService* const service_;
  const Options options_;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues_;
  std::vector<std::thread> threads_;
  bool stopped_ = false;
  std::atomic<int64_t> buffered_bytes_{0};

  absl::Mutex calls_mu_;
  std::unordered_map<const StreamCall*, std::weak_ptr<StreamCall>> calls_
      ABSL_GUARDED_BY(calls_mu_);
  bool draining_ ABSL_GUARDED_BY(calls_mu_) = false;
};

}  // namespace attnserve
