#include "server/attention_service.h"

#include <chrono>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attn/status_macros.h"
#include "server/grpc_status.h"
#include "server/logging.h"
#include "server/response_writer.h"
#include "server/session_service.h"

namespace attnserve {
namespace {

attn::MemorySpace SpaceOf(attn::EngineKind kind) {
  return kind == attn::EngineKind::kCudaFused || kind == attn::EngineKind::kCudaNaive
             ? attn::MemorySpace::kDevice
             : attn::MemorySpace::kHost;
}

bool PathRuns(v1::Path path, attn::EngineKind kind) {
  switch (path) {
    case v1::PATH_FUSED:
      return kind == attn::EngineKind::kCudaFused;
    case v1::PATH_NAIVE:
      return kind == attn::EngineKind::kCudaNaive;
    case v1::PATH_CPU:
      return kind == attn::EngineKind::kCpuTiled || kind == attn::EngineKind::kCpuReference;
    default:
      return true;
  }
}

// One unary Attend call: admitted in the constructor, finished by the batcher's lane.
class AttendReactor final : public grpc::ServerUnaryReactor {
 public:
  AttendReactor(AttentionService* service, grpc::CallbackServerContext* context,
                const v1::AttendRequest* request, v1::AttendResponse* response)
      : service_(service), cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    service_->CallStarted();
    response->set_request_id(request->request_id());
    absl::StatusOr<Identity> caller = service->CheckCall(*context);
    absl::Status status = caller.status();
    if (status.ok()) {
      status = service->Admit(Metrics::Method::kAttend, *caller, *request, response,
                              AttentionService::DeadlineOf(*context), cancelled_,
                              [this](const absl::Status& s) { Finish(ToGrpcStatus(s)); });
    }
    if (!status.ok()) {
      service->metrics()->OnRejected(Metrics::Method::kAttend, status);
      ATTN_LOG(kDebug) << "Attend " << request->request_id() << " rejected: " << status;
      Finish(ToGrpcStatus(status));
    }
  }

  void OnCancel() override { cancelled_->store(true); }
  void OnDone() override {
    service_->CallEnded();
    delete this;
  }

 private:
  AttentionService* const service_;
  std::shared_ptr<std::atomic<bool>> cancelled_;
};

// One AttendBackward call, the same way.
class AttendBackwardReactor final : public grpc::ServerUnaryReactor {
 public:
  AttendBackwardReactor(AttentionService* service, grpc::CallbackServerContext* context,
                        const v1::AttendBackwardRequest* request,
                        v1::AttendBackwardResponse* response)
      : service_(service), cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    service_->CallStarted();
    response->set_request_id(request->forward().request_id());
    absl::StatusOr<Identity> caller = service->CheckCall(*context);
    absl::Status status = caller.status();
    if (status.ok()) {
      status = service->AdmitBackward(*caller, *request, response,
                                      AttentionService::DeadlineOf(*context), cancelled_,
                                      [this](const absl::Status& s) { Finish(ToGrpcStatus(s)); });
    }
    if (!status.ok()) {
      service->metrics()->OnRejected(Metrics::Method::kAttendBackward, status);
      ATTN_LOG(kDebug) << "AttendBackward " << request->forward().request_id()
                       << " rejected: " << status;
      Finish(ToGrpcStatus(status));
    }
  }

  void OnCancel() override { cancelled_->store(true); }
  void OnDone() override {
    service_->CallEnded();
    delete this;
  }

 private:
  AttentionService* const service_;
  std::shared_ptr<std::atomic<bool>> cancelled_;
};

}  // namespace

AttentionService::AttentionService(Options options, std::vector<attn::EngineKind> engines,
                                   Batcher* batcher, Metrics* metrics, v1::ServerInfo info)
    : options_(std::move(options)),
      batcher_(batcher),
      metrics_(metrics),
      info_(std::move(info)),
      shared_memory_(options_.shared_memory_limits, options_.shared_memory_pinning),
      kinds_(std::move(engines)) {}

absl::Time AttentionService::DeadlineOf(const grpc::ServerContextBase& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

absl::StatusOr<Identity> AttentionService::Authenticate(
    const grpc::ServerContextBase& context) const {
  absl::string_view authorization;
  bool has_authorization = false;
  const auto& metadata = context.client_metadata();
  if (const auto it = metadata.find("authorization"); it != metadata.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
    has_authorization = true;
  }
  return options_.authenticator->Authenticate(has_authorization ? &authorization : nullptr);
}

absl::StatusOr<Identity> AttentionService::CheckCall(const grpc::ServerContextBase& context) const {
  absl::StatusOr<Identity> caller = Authenticate(context);
  if (!caller.ok()) return caller.status();
  if (draining_.load()) {
    return absl::UnavailableError("server: shutting down, not accepting requests");
  }
  return caller;
}

void AttentionService::CallStarted() {
  absl::MutexLock lock(&calls_mu_);
  ++calls_in_progress_;
}

void AttentionService::CallEnded() {
  absl::MutexLock lock(&calls_mu_);
  --calls_in_progress_;
}

bool AttentionService::AwaitNoCalls(absl::Time deadline) {
  absl::MutexLock lock(&calls_mu_);
  return calls_mu_.AwaitWithDeadline(
      absl::Condition(
          +[](int64_t* calls) { return *calls == 0; }, &calls_in_progress_),
      deadline);
}

absl::StatusOr<AttentionService::EngineChoice> AttentionService::ChooseEngine(
    const attn::AttentionProblem& problem, v1::Path path, attn::Pass pass,
    std::optional<attn::MemorySpace> space) const {
  absl::Status last = absl::InvalidArgumentError(
      absl::StrCat("path: ", v1::Path_Name(path), " is not available on this server"));
  // For the metrics: why the chosen engine, when AUTO passed over a GPU engine or had none.
  const bool automatic = path == v1::PATH_AUTO;
  Metrics::PathReason reason = Metrics::PathReason::kNoGpu;
  bool refused = false;
  for (attn::EngineKind kind : kinds_) {
    if (kind == attn::EngineKind::kCudaFused || kind == attn::EngineKind::kCudaNaive) {
      reason = Metrics::PathReason::kAuto;
    }
  }
  for (size_t i = 0; i < kinds_.size(); ++i) {
    if (!PathRuns(path, kinds_[i])) continue;
    if (space.has_value() && SpaceOf(kinds_[i]) != *space) continue;
    const attn::Support support =
        attn::EngineSupports(kinds_[i], pass, problem, options_.engine_options);
    if (support.ok()) {
      return EngineChoice{static_cast<int>(i),
                          automatic ? reason : Metrics::PathReason::kRequested};
    }
    if (automatic && !refused) {
      refused = true;
      reason = Metrics::FallbackReason(support.reason());
    }
    absl::Status s = support.status();
    if (absl::IsUnimplemented(s)) s = absl::InvalidArgumentError(s.message());
    last = absl::Status(s.code(), absl::StrCat(s.message(), " (engine ",
                                               std::string(attn::EngineKindName(kinds_[i])), ")"));
  }
  return last;
}

absl::Status AttentionService::Admit(Metrics::Method method, const Identity& caller,
                                     const v1::AttendRequest& request, v1::AttendResponse* response,
                                     absl::Time deadline,
                                     std::shared_ptr<const std::atomic<bool>> cancelled,
                                     std::function<void(const absl::Status&)> done) {
  // Streams admit request by request: once draining, each new one is refused on its stream.
  if (draining_.load()) {
    return absl::UnavailableError("server: shutting down, not accepting requests");
  }
  if (!request.session_id().empty()) {
    if (sessions_ == nullptr) {
      return absl::FailedPreconditionError("session_id: this server offers no KV sessions");
    }
    return sessions_->AdmitStep(method, caller, request, response, deadline, std::move(cancelled),
                                std::move(done));
  }
  const SharedMemoryScope scope(&shared_memory_, caller);
  absl::StatusOr<DecodedForward> decoded =
      DecodeAttendRequest(request, options_.limits, shared_memory_enabled() ? &scope : nullptr);
  if (!decoded.ok()) return decoded.status();
  auto work = std::make_unique<ForwardWork>();
  work->request = *std::move(decoded);
  const attn::AttentionProblem& problem = work->request.problem;
  ATTN_ASSIGN_OR_RETURN(const EngineChoice engine,
                        ChooseEngine(problem, work->request.path, attn::Pass::kForward));
  work->batch = BatchKey::Of(engine.index, problem);
  work->tokens = work->request.tokens();
  work->bytes = WorkingSetBytes(problem);
  BindOutputs(work.get(), response);
  work->done = [response, done = std::move(done)](const absl::Status& s, const Work& w) {
    if (s.ok()) FillResponse(static_cast<const ForwardWork&>(w), response);
    done(s);
  };
  return Submit(method, engine, deadline, std::move(cancelled), std::move(work));
}

absl::Status AttentionService::AdmitBackward(const Identity& caller,
                                             const v1::AttendBackwardRequest& request,
                                             v1::AttendBackwardResponse* response,
                                             absl::Time deadline,
                                             std::shared_ptr<const std::atomic<bool>> cancelled,
                                             std::function<void(const absl::Status&)> done) {
  const SharedMemoryScope scope(&shared_memory_, caller);
  absl::StatusOr<DecodedBackward> decoded = DecodeAttendBackwardRequest(
      request, options_.limits, shared_memory_enabled() ? &scope : nullptr);
  if (!decoded.ok()) return decoded.status();
  auto work = std::make_unique<BackwardWork>();
  work->request = *std::move(decoded);
  const attn::AttentionProblem& problem = work->request.problem();
  ATTN_ASSIGN_OR_RETURN(const EngineChoice engine,
                        ChooseEngine(problem, work->request.forward.path, attn::Pass::kBackward));
  work->deterministic = work->request.deterministic || options_.deterministic_backward;
  work->tokens = work->request.forward.tokens();
  work->bytes = BackwardWorkingSetBytes(problem);
  BindOutputs(work.get(), response);
  work->done = [response, done = std::move(done)](const absl::Status& s, const Work& w) {
    if (s.ok()) FillResponse(static_cast<const BackwardWork&>(w), response);
    done(s);
  };
  return Submit(Metrics::Method::kAttendBackward, engine, deadline, std::move(cancelled),
                std::move(work));
}

absl::Status AttentionService::Submit(Metrics::Method method, const EngineChoice& engine,
                                      absl::Time deadline,
                                      std::shared_ptr<const std::atomic<bool>> cancelled,
                                      std::unique_ptr<Work> work) {
  work->engine = engine.index;
  work->method = method;
  work->path_reason = engine.reason;
  work->accepted = absl::Now();
  work->deadline = deadline;
  work->cancelled = std::move(cancelled);
  if (absl::Status s = batcher_->Submit(std::move(work)); !s.ok()) return s;
  metrics_->OnAccepted();
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::Attend(grpc::CallbackServerContext* context,
                                                   const v1::AttendRequest* request,
                                                   v1::AttendResponse* response) {
  return new AttendReactor(this, context, request, response);
}

grpc::ServerUnaryReactor* AttentionService::AttendBackward(grpc::CallbackServerContext* context,
                                                           const v1::AttendBackwardRequest* request,
                                                           v1::AttendBackwardResponse* response) {
  return new AttendBackwardReactor(this, context, request, response);
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const v1::GetServerInfoRequest*,
                                                          v1::ServerInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = CheckCall(*context).status(); !s.ok() && !absl::IsUnavailable(s)) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  *response = info_;
  *response->mutable_stats() = metrics_->Snapshot();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::StatusOr<Identity> AttentionService::CheckSharedMemoryCall(
    const grpc::CallbackServerContext& context) const {
  absl::StatusOr<Identity> caller = CheckCall(context);
  if (!caller.ok()) return caller;
  if (options_.descriptor_socket == nullptr) {
    return absl::FailedPreconditionError(
        "shared memory: disabled on this server (--shared_memory=false); send tensor bytes in "
        "the request");
  }
  if (const std::string peer = context.peer(); !IsSameHostPeer(peer)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shared memory: only for clients on the server's host (loopback or a unix socket); "
        "peer is ",
        peer));
  }
  return caller;
}

grpc::ServerUnaryReactor* AttentionService::RegisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterSharedMemoryRequest* request,
    v1::RegisterSharedMemoryResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Identity> caller = CheckSharedMemoryCall(*context);
  absl::Status status = caller.status();
  if (status.ok() && !request->key().empty()) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "key: registration by shared-memory name is not accepted (the server would open '",
        request->key(),
        "' with its own rights, not yours); pass the object's descriptor to "
        "ServerInfo.shared_memory_socket and register with fd_token"));
  }
  if (status.ok() && request->fd_token().empty()) {
    status = absl::InvalidArgumentError(
        "fd_token: missing; pass the object's descriptor to ServerInfo.shared_memory_socket "
        "first (proto/attnserve/v1/attention.proto, RegisterSharedMemoryRequest)");
  }
  absl::StatusOr<UniqueFd> fd;
  if (status.ok()) {
    fd = options_.descriptor_socket->Claim(request->fd_token());
    status = fd.status();
  }
  // Mapping is a quick system call; page-locking it on a GPU server takes ~0.25 ms per MiB.
  // Registration is rare, so it runs on the callback thread.
  bool pinned = false;
  if (status.ok()) status = shared_memory_.Register(*caller, *request, fd->get(), &pinned);
  if (status.ok()) {
    response->set_pinned(pinned);
    metrics_->OnSharedMemory(shared_memory_.size(), shared_memory_.mapped_bytes());
    ATTN_LOG(kDebug) << "shared memory region '" << request->name() << "' registered ("
                     << request->byte_size() << " bytes" << (pinned ? ", page-locked" : "") << ")";
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::UnregisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
    v1::UnregisterSharedMemoryResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Identity> caller = CheckSharedMemoryCall(*context);
  absl::Status status = caller.status();
  if (status.ok()) {
    absl::StatusOr<int> removed = shared_memory_.Unregister(*caller, request->name());
    if (removed.ok()) {
      response->set_unregistered(*removed);
      metrics_->OnSharedMemory(shared_memory_.size(), shared_memory_.mapped_bytes());
    } else {
      status = removed.status();
    }
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// The session RPCs: the call's checks here, the rest in SessionService.
namespace {

template <typename Request, typename Response>
grpc::ServerUnaryReactor* SessionCall(
    AttentionService* service, SessionService* sessions, grpc::CallbackServerContext* context,
    const Request& request, Response* response,
    absl::Status (SessionService::*handler)(const Identity&, const Request&, Response*)) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Identity> caller = service->CheckCall(*context);
  absl::Status status = caller.status();
  // Reading and deleting sessions stays open while draining; creating one does not (CheckCall).
  if (absl::IsUnavailable(status) && !std::is_same_v<Request, v1::CreateSessionRequest>) {
    caller = service->Authenticate(*context);
    status = caller.status();
  }
  if (status.ok() && sessions == nullptr) {
    status = absl::FailedPreconditionError("session: this server offers no KV sessions");
  }
  if (status.ok()) status = (sessions->*handler)(*caller, request, response);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* AttentionService::CreateSession(grpc::CallbackServerContext* context,
                                                          const v1::CreateSessionRequest* request,
                                                          v1::Session* response) {
  return SessionCall(this, sessions_, context, *request, response, &SessionService::Create);
}

grpc::ServerUnaryReactor* AttentionService::GetSession(grpc::CallbackServerContext* context,
                                                       const v1::GetSessionRequest* request,
                                                       v1::Session* response) {
  return SessionCall(this, sessions_, context, *request, response, &SessionService::Get);
}

grpc::ServerUnaryReactor* AttentionService::ListSessions(grpc::CallbackServerContext* context,
                                                         const v1::ListSessionsRequest* request,
                                                         v1::ListSessionsResponse* response) {
  return SessionCall(this, sessions_, context, *request, response, &SessionService::List);
}

grpc::ServerUnaryReactor* AttentionService::DeleteSession(grpc::CallbackServerContext* context,
                                                          const v1::DeleteSessionRequest* request,
                                                          v1::DeleteSessionResponse* response) {
  return SessionCall(this, sessions_, context, *request, response, &SessionService::Delete);
}

grpc::ServerReadReactor<v1::AppendKVRequest>* AttentionService::AppendKV(
    grpc::CallbackServerContext* context, v1::AppendKVResponse* response) {
  return SessionService::StartAppend(this, sessions_, context, response);
}

}  // namespace attnserve
