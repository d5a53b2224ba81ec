// The attnserve.v1.AttentionService on gRPC's callback API, except AttendStream, which runs on
// completion queues (server/stream_frontend.h says why). The door: handlers never block; they
// check the call (token, draining), decode and validate the request, pick the engine, and hand
// Work (attention types, with sinks into the response; server/response_writer.h) to the
// Batcher; the lane that runs it finishes the RPC.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "attn/engine.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "proto/wire/request_decoder.h"
#include "server/authenticator.h"
#include "server/batcher.h"
#include "server/descriptor_socket.h"
#include "server/metrics.h"
#include "server/shared_memory.h"
#include "server/work.h"

namespace attnserve {

// Every method on the callback API but AttendStream, which StreamFrontend serves.
using AttentionServiceBase = v1::AttentionService::WithCallbackMethod_Attend<
    v1::AttentionService::WithRawMethod_AttendStream<
        v1::AttentionService::WithCallbackMethod_AttendBackward<
            v1::AttentionService::WithCallbackMethod_GetServerInfo<
                v1::AttentionService::WithCallbackMethod_RegisterSharedMemory<
                    v1::AttentionService::WithCallbackMethod_UnregisterSharedMemory<
                        v1::AttentionService::WithCallbackMethod_CreateSession<
                            v1::AttentionService::WithCallbackMethod_GetSession<
                                v1::AttentionService::WithCallbackMethod_ListSessions<
                                    v1::AttentionService::WithCallbackMethod_DeleteSession<
                                        v1::AttentionService::WithCallbackMethod_AppendKV<
                                            v1::AttentionService::Service>>>>>>>>>>>;

class SessionService;

class AttentionService final : public AttentionServiceBase {
 public:
  struct Options {
    // Never null; an Authenticator without tokens lets every call in as one identity.
    std::shared_ptr<const Authenticator> authenticator = std::make_shared<Authenticator>();
    DecodeLimits limits;
    // RegisterSharedMemory for same-host peers: descriptors arrive through this socket (null:
    // shared memory is disabled).
    DescriptorSocket* descriptor_socket = nullptr;
    SharedMemoryRegistry::Limits shared_memory_limits;
    HostMemoryPinning shared_memory_pinning;  // GPU servers: page-lock regions
    // What the lanes' engines were created with: their support answers depend on it.
    attn::EngineOptions engine_options;
    // Every AttendBackward runs deterministic, whatever its request says.
    bool deterministic_backward = false;
  };

  // `engines` are the kinds every lane runs, in the same order (AUTO's preference); the
  // service asks attn::EngineSupports about them. `info` is GetServerInfo's answer, less the
  // stats.
  AttentionService(Options options, std::vector<attn::EngineKind> engines, Batcher* batcher,
                   Metrics* metrics, v1::ServerInfo info);

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerUnaryReactor* AttendBackward(grpc::CallbackServerContext* context,
                                           const v1::AttendBackwardRequest* request,
                                           v1::AttendBackwardResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(
      grpc::CallbackServerContext* context, const v1::RegisterSharedMemoryRequest* request,
      v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
      v1::UnregisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const v1::CreateSessionRequest* request,
                                          v1::Session* response) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::GetSessionRequest* request,
                                       v1::Session* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteSession(grpc::CallbackServerContext* context,
                                          const v1::DeleteSessionRequest* request,
                                          v1::DeleteSessionResponse* response) override;
  grpc::ServerReadReactor<v1::AppendKVRequest>* AppendKV(grpc::CallbackServerContext* context,
                                                         v1::AppendKVResponse* response) override;

  // KV sessions' RPCs and steps go to `sessions` (never attached: not offered). Before serving.
  void AttachSessions(SessionService* sessions) { sessions_ = sessions; }

  // From now on new requests get UNAVAILABLE; accepted ones run to the end.
  void StartDraining() { draining_.store(true); }

  bool draining() const { return draining_.load(); }

  // Used by the reactors and StreamFrontend: the caller's identity, or UNAUTHENTICATED, or
  // UNAVAILABLE once draining.
  absl::StatusOr<Identity> CheckCall(const grpc::ServerContextBase& context) const;
  // The caller's identity, or UNAUTHENTICATED, draining or not.
  absl::StatusOr<Identity> Authenticate(const grpc::ServerContextBase& context) const;
  // The call's deadline; InfiniteFuture when it has none.
  static absl::Time DeadlineOf(const grpc::ServerContextBase& context);
  // CheckCall, then shared memory enabled and the peer on this host.
  absl::StatusOr<Identity> CheckSharedMemoryCall(const grpc::CallbackServerContext& context) const;
  // Validates the request and queues it; `done` runs once the response is filled (OK) or the
  // request failed. On error `done` is not called and nothing was queued; UNAVAILABLE once
  // draining.
  absl::Status Admit(Metrics::Method method, const Identity& caller,
                     const v1::AttendRequest& request, v1::AttendResponse* response,
                     absl::Time deadline, std::shared_ptr<const std::atomic<bool>> cancelled,
                     std::function<void(const absl::Status&)> done);
  // The same for AttendBackward.
  absl::Status AdmitBackward(const Identity& caller, const v1::AttendBackwardRequest& request,
                             v1::AttendBackwardResponse* response, absl::Time deadline,
                             std::shared_ptr<const std::atomic<bool>> cancelled,
                             std::function<void(const absl::Status&)> done);
  Metrics* metrics() { return metrics_; }

  // RPCs in progress (unary calls from their start to their end, streams likewise): the drain
  // waits for this to reach zero. StreamFrontend counts its streams through these.
  void CallStarted();
  void CallEnded();
  // Waits until no call is in progress or `deadline`; true when none is.
  bool AwaitNoCalls(absl::Time deadline);

  struct EngineChoice {
    int index = 0;  // into kinds_ and every lane's engines
    Metrics::PathReason reason = Metrics::PathReason::kAuto;
  };
  // The first engine in AUTO's order (or the one `path` names) that runs `pass` of the problem
  // and, when given, works in `space` (a session step must run where its pages are).
  absl::StatusOr<EngineChoice> ChooseEngine(
      const attn::AttentionProblem& problem, v1::Path path, attn::Pass pass,
      std::optional<attn::MemorySpace> space = std::nullopt) const;
  // Stamps the work with its engine and admission facts and queues it.
  absl::Status Submit(Metrics::Method method, const EngineChoice& engine, absl::Time deadline,
                      std::shared_ptr<const std::atomic<bool>> cancelled,
                      std::unique_ptr<Work> work);
  // The resolver a caller's shared-memory references go through (null: shared memory off).
  const SharedMemoryResolver* SharedMemoryFor(const SharedMemoryScope& scope) const {
    return shared_memory_enabled() ? &scope : nullptr;
  }
  const SharedMemoryRegistry& shared_memory() const { return shared_memory_; }
  const DecodeLimits& limits() const { return options_.limits; }

 private:
  bool shared_memory_enabled() const { return options_.descriptor_socket != nullptr; }

  const Options options_;
  Batcher* const batcher_;
  Metrics* const metrics_;
  const v1::ServerInfo info_;
  std::atomic<bool> draining_{false};
  SharedMemoryRegistry shared_memory_;

  absl::Mutex calls_mu_;
  int64_t calls_in_progress_ ABSL_GUARDED_BY(calls_mu_) = 0;

  const std::vector<attn::EngineKind> kinds_;  // the lanes' engines
  SessionService* sessions_ = nullptr;
};

}  // namespace attnserve
