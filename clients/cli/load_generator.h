// The load generator behind `attnserve_client bench`: closed-loop (N clients, each sending its
// next request when the last one returns) and open-loop (requests at a fixed mean rate,
// Poisson arrivals, whatever the latency). Requests are drawn from a pre-built pool so that
// the generator measures the server, not its own random number generation; the closed loop
// also serializes each pooled request once and sends the same bytes every time (the call only
// takes references to them), so its per-request cost is the RPC, not building the payload.
//
// The closed loop runs over either RPC: unary Attend (one blocking call per client thread) or
// AttendStream (the concurrency split over a few bidirectional streams, each keeping its share
// of requests in flight and matching responses by request_id; one thread per stream sends a
// slot's next request as soon as it reads the answer).
//
// With shared memory (same-host clients) the pool's Q, K and V live in a registered region and
// the messages only refer to them; in the closed loops each request in flight has its own O
// slot in the region too, so gRPC moves a few hundred bytes per request each way.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/rpc_method.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "clients/cli/channel_factory.h"
#include "clients/cli/shared_memory_buffer.h"

namespace attnserve::client {

struct LoadResult {
  std::string mode;  // "closed" or "open"
  std::string rpc;   // "unary" or "stream"
  int streams = 0;   // AttendStream calls the load ran over (stream only)
  // Q, K, V by reference to shared memory (and O too in the closed loops), not in the messages.
  bool shared_memory = false;
  double level = 0;  // concurrency (closed) or offered requests/s (open)
  double seconds = 0;
  int64_t ok = 0;
  std::map<std::string, int64_t> errors;            // by gRPC code name
  std::map<std::string, std::string> first_errors;  // the first message seen for each code
  double requests_per_s = 0;
  double tokens_per_s = 0;  // query + key tokens
  double tflops = 0;        // forward FLOPs of the visible pairs
  double p50_ms = 0, p90_ms = 0, p99_ms = 0;
  double mean_batch_requests = 0;  // as the server reported per response
  // Medians of the response's timing fields and of what is not the kernel:
  // overhead = end-to-end - kernel_us (everything a request meets besides the engine call:
  // gRPC, (de)serialization, transport, queueing, staging and PCIe copies);
  // outside = end-to-end - total_us (what happens outside the server's accepted ->
  // response-ready window: transport, (de)serialization, the client).
  double p50_queue_ms = 0, p50_compute_ms = 0, p50_kernel_ms = 0, p50_overhead_ms = 0,
         p50_outside_ms = 0;
  // CPU time (user + system) this client process spent during the level: the load
  // generator's own share of a host it shares with the server.
  double client_cpu_s = 0;

  std::string ToJson() const;
  std::string ToText() const;
};

// What a level has done so far, while it runs (LoadGenerator::SetProgress).
struct LevelProgress {
  std::string mode;  // "closed" or "open"
  std::string rpc;   // "unary" or "stream"
  double level = 0;  // concurrency (closed) or offered requests/s (open)
  absl::Duration elapsed, duration;
  int64_t ok = 0, errors = 0;
  bool done = false;  // the level's last call: it has ended

  std::string ToText() const;
};

// Where the pool's tensors go when they travel by reference.
struct SharedMemoryTensors {
  std::string region;                    // the name `buffer` is registered under
  SharedMemoryBuffer* buffer = nullptr;  // at least SharedMemoryBytes(pool, output_slots)
  int output_slots = 0;                  // O slots: >= the closed loops' largest concurrency
};

class LoadGenerator {
 public:
  // Clients and open-loop calls take the channels round-robin (each channel is a connection).
  // With `shared_memory` the pool's tensors are moved into its buffer.
  LoadGenerator(const ChannelFactory* factory,
                const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                std::vector<v1::AttendRequest> pool, absl::Duration timeout,
                const SharedMemoryTensors* shared_memory = nullptr);

  // The buffer `pool` needs: its Q, K, V and `output_slots` O slots as large as its largest O.
  static int64_t SharedMemoryBytes(const std::vector<v1::AttendRequest>& pool, int output_slots);

  LoadResult RunClosedLoop(int concurrency, absl::Duration duration);
  // `concurrency` requests in flight over min(streams, concurrency) AttendStream calls.
  LoadResult RunClosedLoopStream(int concurrency, int streams, absl::Duration duration);
  LoadResult RunOpenLoop(double requests_per_s, absl::Duration duration);

  // While a level runs, `report` gets its progress every `every`, then once with done = true
  // when it ends, from a thread of the generator's own (the client threads never wait for it).
  void SetProgress(absl::Duration every, std::function<void(const LevelProgress&)> report);
  // SetProgress with a printer to `out`: on a terminal one line rewritten in place four times a
  // second and erased when the level ends; otherwise a line every `every` (none if it is 0).
  void ShowProgress(FILE* out, absl::Duration every);

 private:
  class ProgressWatch;  // one level's progress thread
  struct Sample {
    absl::Duration latency;
    size_t request;
    int batch_requests;
    int64_t queue_us, compute_us, total_us, kernel_us;  // the response's timing
  };
  struct Tally {  // what the client threads of one level collect
    absl::Mutex mu;
    std::vector<Sample> samples ABSL_GUARDED_BY(mu);
    std::map<std::string, int64_t> errors ABSL_GUARDED_BY(mu);
    std::map<std::string, std::string> first_errors ABSL_GUARDED_BY(mu);
    void Error(const std::string& code, const std::string& message, int64_t count = 1)
        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      errors[code] += count;
      first_errors.emplace(code, message);
    }
    double cpu_at_start = 0;  // process CPU seconds when the level started
  };
  // One AttendStream call keeping `depth` requests in flight until `stop`; its slot i uses O
  // slot first_slot + i.
  void RunStream(int stream, int depth, int first_slot, absl::Time stop, Tally* tally);
  // A closed-loop message: pooled request `request`'s body, and O slot `slot` when O goes to
  // shared memory.
  void AppendBody(size_t request, int slot, std::vector<grpc::Slice>* message) const;
  static Sample MakeSample(absl::Duration latency, size_t request,
                           const v1::AttendResponse& response);
  LoadResult Summarize(const std::string& mode, const std::string& rpc, double level,
                       absl::Duration elapsed, Tally& tally) const;

  const ChannelFactory* factory_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::AttentionService::Stub>> stubs_;
  std::vector<std::unique_ptr<grpc::internal::RpcMethod>> attend_methods_;  // one per channel
  std::vector<std::unique_ptr<grpc::internal::RpcMethod>> stream_methods_;  // one per channel
  std::vector<v1::AttendRequest> pool_;
  std::vector<grpc::ByteBuffer> payloads_;  // pool_, serialized once
  // pool_ without request_id, serialized once; a stream sends a short message carrying only the
  // request_id followed by these bytes, which protobuf parses as the two merged.
  std::vector<std::vector<grpc::Slice>> bodies_;
  // Shared memory: per O slot, a message holding only o_shared_memory (merged like the id).
  std::vector<grpc::Slice> o_slots_;
  std::vector<double> flops_;
  std::vector<int64_t> tokens_;
  absl::Duration timeout_;
  absl::Duration progress_every_;
  std::function<void(const LevelProgress&)> progress_;  // empty: no progress reports
};

std::string StatusCodeName(grpc::StatusCode code);

}  // namespace attnserve::client
