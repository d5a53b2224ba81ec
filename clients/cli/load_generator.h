// The load generator behind `attnserve_client bench`: closed-loop (N clients, each sending its
// next request when the last one returns) and open-loop (requests at a fixed mean rate,
// Poisson arrivals, whatever the latency). Requests are drawn from a pre-built pool so that
// the generator measures the server, not its own random number generation; the closed loop
// also serializes each pooled request once and sends the same bytes every time (the call only
// takes references to them), so its per-request cost is the RPC, not building the payload.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/rpc_method.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "clients/cli/channel_factory.h"

namespace attnserve::client {

struct LoadResult {
  std::string mode;  // "closed" or "open"
  double level = 0;  // concurrency (closed) or offered requests/s (open)
  double seconds = 0;
  int64_t ok = 0;
  std::map<std::string, int64_t> errors;  // by gRPC code name
  double requests_per_s = 0;
  double tokens_per_s = 0;  // query + key tokens
  double tflops = 0;        // forward FLOPs of the visible pairs
  double p50_ms = 0, p90_ms = 0, p99_ms = 0;
  double mean_batch_requests = 0;  // as the server reported per response
  // Medians of the response's timing fields and of what the server does not account as
  // compute: overhead = end-to-end - compute_us (queueing, batching delay, decode, gRPC,
  // serialization, transport); outside = end-to-end - total_us (what happens outside the
  // server's accepted -> response-ready window: transport, (de)serialization, the client).
  double p50_queue_ms = 0, p50_compute_ms = 0, p50_overhead_ms = 0, p50_outside_ms = 0;

  std::string ToJson() const;
  std::string ToText() const;
};

class LoadGenerator {
 public:
  // Clients and open-loop calls take the channels round-robin (each channel is a connection).
  LoadGenerator(const ChannelFactory* factory,
                const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                std::vector<v1::AttendRequest> pool, absl::Duration timeout);

  LoadResult RunClosedLoop(int concurrency, absl::Duration duration);
  LoadResult RunOpenLoop(double requests_per_s, absl::Duration duration);

 private:
  struct Sample {
    absl::Duration latency;
    size_t request;
    int batch_requests;
    int64_t queue_us, compute_us, total_us;  // the response's timing
  };
  static Sample MakeSample(absl::Duration latency, size_t request,
                           const v1::AttendResponse& response);
  LoadResult Summarize(const std::string& mode, double level, absl::Duration elapsed,
                       std::vector<Sample> samples,
                       const std::map<std::string, int64_t>& errors) const;

  const ChannelFactory* factory_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::AttentionService::Stub>> stubs_;
  std::vector<std::unique_ptr<grpc::internal::RpcMethod>> attend_methods_;  // one per channel
  std::vector<v1::AttendRequest> pool_;
  std::vector<grpc::ByteBuffer> payloads_;  // pool_, serialized once
  std::vector<double> flops_;
  std::vector<int64_t> tokens_;
  absl::Duration timeout_;
};

std::string StatusCodeName(grpc::StatusCode code);

}  // namespace attnserve::client
