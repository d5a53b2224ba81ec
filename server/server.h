// The running attnserve server: engines, lanes, batcher, the gRPC service with health and
// reflection, and the graceful drain. main.cc builds a Config and calls Start and Drain.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/status/statusor.h"
#include "server/attention_service.h"
#include "server/authenticator.h"
#include "server/batcher.h"
#include "server/config.h"
#include "server/descriptor_socket.h"
#include "server/kv_page_pool.h"
#include "server/lane.h"
#include "server/metrics.h"
#include "server/session_service.h"
#include "server/session_store.h"
#include "server/stream_frontend.h"
#include "server/training/training_service.h"

namespace attnserve {

class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Start(const Config& config);
  ~Server();

  int port() const { return port_; }

  // Health goes NOT_SERVING and new calls are refused (UNAVAILABLE); open streams stop
  // admitting and end once what they accepted is answered; accepted calls get until the drain
  // timeout to finish (then they are cancelled). As soon as no call is left, every connection
  // is closed (idle ones included) and the batcher stops. Returns when everything is down.
  void Drain();

  // Re-reads the token file (SIGHUP); on error the tokens in force stay and the error is logged.
  void ReloadTokens();

 private:
  explicit Server(const Config& config) : config_(config) {}
  // Stops the batcher and joins the lanes once they have run what was queued.
  void StopLanes();

  Config config_;
  int port_ = 0;
  Metrics metrics_;
  std::shared_ptr<Authenticator> authenticator_;
  std::unique_ptr<DescriptorSocket> descriptor_socket_;
  // KV sessions: one page pool per device slot; the store and the door outlive the lanes, the
  // pools outlive every session.
  std::vector<std::unique_ptr<KvPagePool>> kv_pools_;
  std::unique_ptr<SessionStore> session_store_;
  std::unique_ptr<SessionService> session_service_;
  std::unique_ptr<Batcher> batcher_;
  std::vector<std::unique_ptr<Lane>> lanes_;  // pull from batcher_; joined by StopLanes
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<training::TrainingService> training_;  // asks service_ about its callers
  std::unique_ptr<StreamFrontend> stream_frontend_;
  std::unique_ptr<grpc::Server> server_;
  bool drained_ = false;
};

}  // namespace attnserve
