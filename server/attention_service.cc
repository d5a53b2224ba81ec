#include "server/attention_service.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attn/status_macros.h"
#include "server/grpc_status.h"
#include "server/logging.h"

namespace attnserve {
namespace {

// Compares without an early exit, so response time does not reveal a matching prefix.
bool SameSecret(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
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
      : cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    response->set_request_id(request->request_id());
    absl::Status status = service->CheckCall(*context);
    if (status.ok()) {
      status = service->Admit(Metrics::Method::kAttend, *request, response,
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
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<std::atomic<bool>> cancelled_;
};

// One AttendBackward call, the same way.
class AttendBackwardReactor final : public grpc::ServerUnaryReactor {
 public:
  AttendBackwardReactor(AttentionService* service, grpc::CallbackServerContext* context,
                        const v1::AttendBackwardRequest* request,
                        v1::AttendBackwardResponse* response)
      : cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    response->set_request_id(request->forward().request_id());
    absl::Status status = service->CheckCall(*context);
    if (status.ok()) {
      status = service->AdmitBackward(*request, response, AttentionService::DeadlineOf(*context),
                                      cancelled_,
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
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<std::atomic<bool>> cancelled_;
};

}  // namespace

AttentionService::AttentionService(Options options,
                                   std::vector<std::unique_ptr<attn::Engine>> probes,
                                   Batcher* batcher, Metrics* metrics, v1::ServerInfo info)
    : options_(std::move(options)),
      batcher_(batcher),
      metrics_(metrics),
      info_(std::move(info)),
      shared_memory_(options_.shared_memory_pinning),
      probes_(std::move(probes)) {
  absl::MutexLock lock(&probes_mu_);
  for (const auto& e : probes_) kinds_.push_back(e->kind());
}

absl::Time AttentionService::DeadlineOf(const grpc::ServerContextBase& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

absl::Status AttentionService::CheckCall(const grpc::ServerContextBase& context) const {
  if (!options_.auth_token.empty()) {
    const auto& metadata = context.client_metadata();
    const auto it = metadata.find("authorization");
    const std::string expected = absl::StrCat("Bearer ", options_.auth_token);
    if (it == metadata.end() ||
        !SameSecret(std::string_view(it->second.data(), it->second.size()), expected)) {
      return absl::UnauthenticatedError(
          "authorization: missing or wrong bearer token (metadata 'authorization: Bearer ...')");
    }
  }
  if (draining_.load()) {
    return absl::UnavailableError("server: shutting down, not accepting requests");
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionService::EngineChoice> AttentionService::ChooseEngine(
    const DecodedRequest& request) {
  absl::Status last = absl::InvalidArgumentError(
      absl::StrCat("path: ", v1::Path_Name(request.path), " is not available on this server"));
  // For the metrics: why the chosen engine, when AUTO passed over a GPU engine or had none.
  const bool automatic = request.path == v1::PATH_AUTO;
  Metrics::PathReason reason = Metrics::PathReason::kNoGpu;
  bool refused = false;
  for (attn::EngineKind kind : kinds_) {
    if (kind == attn::EngineKind::kCudaFused || kind == attn::EngineKind::kCudaNaive) {
      reason = Metrics::PathReason::kAuto;
    }
  }
  absl::MutexLock lock(&probes_mu_);
  for (size_t i = 0; i < probes_.size(); ++i) {
    if (!PathRuns(request.path, kinds_[i])) continue;
    absl::Status s = request.backward ? probes_[i]->SupportsBackward(request.problem)
                                      : probes_[i]->SupportsForward(request.problem);
    if (s.ok()) {
      return EngineChoice{static_cast<int>(i),
                          automatic ? reason : Metrics::PathReason::kRequested};
    }
    if (automatic && !refused) {
      refused = true;
      reason = Metrics::FallbackReason(s);
    }
    if (absl::IsUnimplemented(s)) s = absl::InvalidArgumentError(s.message());
    last = absl::Status(
        s.code(), absl::StrCat(s.message(), " (engine ", std::string(probes_[i]->name()), ")"));
  }
  return last;
}

absl::Status AttentionService::Admit(Metrics::Method method, const v1::AttendRequest& request,
                                     v1::AttendResponse* response, absl::Time deadline,
                                     std::shared_ptr<const std::atomic<bool>> cancelled,
                                     std::function<void(const absl::Status&)> done) {
  absl::StatusOr<DecodedRequest> decoded = DecodeAttendRequest(
      request, options_.limits, options_.shared_memory ? &shared_memory_ : nullptr);
  if (!decoded.ok()) return decoded.status();
  return Submit(method, *std::move(decoded), response, nullptr, deadline, std::move(cancelled),
                std::move(done));
}

absl::Status AttentionService::AdmitBackward(const v1::AttendBackwardRequest& request,
                                             v1::AttendBackwardResponse* response,
                                             absl::Time deadline,
                                             std::shared_ptr<const std::atomic<bool>> cancelled,
                                             std::function<void(const absl::Status&)> done) {
  absl::StatusOr<DecodedRequest> decoded = DecodeAttendBackwardRequest(
      request, options_.limits, options_.shared_memory ? &shared_memory_ : nullptr);
  if (!decoded.ok()) return decoded.status();
  return Submit(Metrics::Method::kAttendBackward, *std::move(decoded), nullptr, response, deadline,
                std::move(cancelled), std::move(done));
}

absl::Status AttentionService::Submit(Metrics::Method method, DecodedRequest request,
                                      v1::AttendResponse* response,
                                      v1::AttendBackwardResponse* backward_response,
                                      absl::Time deadline,
                                      std::shared_ptr<const std::atomic<bool>> cancelled,
                                      std::function<void(const absl::Status&)> done) {
  absl::StatusOr<EngineChoice> engine = ChooseEngine(request);
  if (!engine.ok()) return engine.status();

  auto item = std::make_unique<WorkItem>();
  item->request = std::move(request);
  item->engine = engine->index;
  item->method = method;
  item->path_reason = engine->reason;
  item->response = response;
  item->backward_response = backward_response;
  item->accepted = absl::Now();
  item->deadline = deadline;
  item->cancelled = std::move(cancelled);
  item->done = std::move(done);
  if (absl::Status s = batcher_->Submit(std::move(item)); !s.ok()) return s;
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
  if (absl::Status s = CheckCall(*context); !s.ok() && !absl::IsUnavailable(s)) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  *response = info_;
  *response->mutable_stats() = metrics_->Snapshot();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::Status AttentionService::CheckSharedMemoryCall(
    const grpc::CallbackServerContext& context) const {
  ATTN_RETURN_IF_ERROR(CheckCall(context));
  if (!options_.shared_memory) {
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
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::RegisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterSharedMemoryRequest* request,
    v1::RegisterSharedMemoryResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = CheckSharedMemoryCall(*context);
  // Opening and mapping a shared-memory object are quick system calls; page-locking it on a GPU
  // server takes ~0.25 ms per MiB. Registration is rare, so it runs on the callback thread.
  bool pinned = false;
  if (status.ok()) status = shared_memory_.Register(*request, &pinned);
  if (status.ok()) {
    response->set_pinned(pinned);
    metrics_->OnSharedMemory(shared_memory_.size(), shared_memory_.mapped_bytes());
    ATTN_LOG(kDebug) << "shared memory region '" << request->name() << "' registered ("
                     << request->key() << ", " << request->byte_size() << " bytes"
                     << (pinned ? ", page-locked" : "") << ")";
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::UnregisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
    v1::UnregisterSharedMemoryResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = CheckSharedMemoryCall(*context);
  if (status.ok()) {
    absl::StatusOr<int> removed = shared_memory_.Unregister(request->name());
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

}  // namespace attnserve
