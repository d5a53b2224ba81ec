// AttendStream on gRPC's completion-queue API. The other methods use the callback API; this one
// carries the small-request throughput, and gRPC 1.51's callback API (without a background
// poller) routes every callback of every call through one shared completion queue and a pool
// of "nexting" threads, whose lock and thread hand-offs become the round trip under load
// (docs/server-performance.md). Here each stream lives on one of `threads` queues, and the
// thread that polls a queue runs that stream's reads and write completions itself.
//
// Behaviour is the callback reactor's: requests are admitted as they are read, responses are
// written one at a time in completion order, tagged by request_id; a failed request becomes a
// response carrying `error`; the stream ends once the client half-closed and every admitted
// request has been answered; cancellation marks the stream's queued requests cancelled.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <thread>
#include <vector>

#include "server/attention_service.h"

namespace attnserve {

class StreamFrontend {
 public:
  // threads >= 1: one completion queue and one polling thread each.
  StreamFrontend(AttentionService* service, int threads);
  ~StreamFrontend();

  // Before grpc::ServerBuilder::BuildAndStart.
  void AddQueues(grpc::ServerBuilder* builder);
  // After BuildAndStart: accepts streams on every queue and starts the threads.
  void Start();
  // After grpc::Server::Shutdown has returned (every stream is over): shuts the queues down,
  // drains them and joins the threads. Idempotent.
  void Stop();

 private:
  AttentionService* const service_;
  const int thread_count_;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues_;
  std::vector<std::thread> threads_;
  bool stopped_ = false;
};

}  // namespace attnserve
