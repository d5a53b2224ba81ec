// The running attnserve server: engines, lanes, batcher, the gRPC service with health and
// reflection, and the graceful drain. main.cc builds a Config and calls Start and Drain.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/status/statusor.h"
#include "server/attention_service.h"
#include "server/batcher.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/stream_frontend.h"

namespace attnserve {

class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Start(const Config& config);
  ~Server();

  int port() const { return port_; }

  // Health goes NOT_SERVING, new calls are refused, accepted calls get until the drain timeout
  // to finish (then they are cancelled), the batcher stops. Returns when everything is down.
  void Drain();

 private:
  explicit Server(const Config& config) : config_(config) {}

  Config config_;
  int port_ = 0;
  Metrics metrics_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<StreamFrontend> stream_frontend_;
  std::unique_ptr<grpc::Server> server_;
  bool drained_ = false;
};

}  // namespace attnserve
