#include "server/attention_service.h"

#include <chrono>
#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attn/status_macros.h"
#include "server/grpc_status.h"
#include "server/logging.h"

namespace attnserve {
namespace {

absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

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
      status =
          service->Admit(Metrics::Method::kAttend, *request, response, DeadlineOf(*context),
                         cancelled_, [this](const absl::Status& s) { Finish(ToGrpcStatus(s)); });
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
      status = service->AdmitBackward(*request, response, DeadlineOf(*context), cancelled_,
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

// One AttendStream call. Each request read is admitted like a unary call; responses are written
// one at a time in completion order, tagged by request_id. A failed request becomes a response
// carrying `error`, and the stream goes on. The stream finishes when the client has half-closed
// and every admitted request has been answered.
class AttendStreamReactor final
    : public grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse> {
 public:
  AttendStreamReactor(AttentionService* service, grpc::CallbackServerContext* context)
      : service_(service),
        context_(context),
        cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    const absl::Status status = service_->CheckCall(*context_);
    if (!status.ok()) {
      service_->metrics()->OnRejected(Metrics::Method::kAttendStream, status);
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;
      }
      Finish(ToGrpcStatus(status));
      return;
    }
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      {
        absl::MutexLock lock(&mu_);
        reads_done_ = true;
      }
      MaybeFinish();
      return;
    }
    auto call = std::make_shared<Call>();
    call->request = std::move(incoming_);
    incoming_.Clear();
    call->response.set_request_id(call->request.request_id());
    {
      absl::MutexLock lock(&mu_);
      ++outstanding_;
    }
    const absl::Status status = service_->Admit(
        Metrics::Method::kAttendStream, call->request, &call->response, DeadlineOf(*context_),
        cancelled_, [this, call](const absl::Status& s) { Complete(call, s); });
    if (!status.ok()) {
      service_->metrics()->OnRejected(Metrics::Method::kAttendStream, status);
      Complete(call, status);
    }
    StartRead(&incoming_);
  }

  void OnWriteDone(bool ok) override {
    bool write_next = false;
    {
      absl::MutexLock lock(&mu_);
      if (!ok) {
        pending_writes_.clear();  // the client is gone
        broken_ = true;
      }
      if (!pending_writes_.empty()) {
        writing_ = std::move(pending_writes_.front());
        pending_writes_.pop_front();
        write_next = true;
      } else {
        write_in_flight_ = false;
      }
    }
    if (write_next) {
      StartWrite(&writing_);
    } else {
      MaybeFinish();
    }
  }

  void OnCancel() override { cancelled_->store(true); }
  void OnDone() override { delete this; }

 private:
  struct Call {
    v1::AttendRequest request;
    v1::AttendResponse response;
  };

  void Complete(const std::shared_ptr<Call>& call, const absl::Status& status) {
    if (!status.ok()) {
      call->response.Clear();
      call->response.set_request_id(call->request.request_id());
      call->response.mutable_error()->set_code(static_cast<int>(status.code()));
      call->response.mutable_error()->set_message(std::string(status.message()));
    }
    bool write_now = false;
    {
      absl::MutexLock lock(&mu_);
      --outstanding_;
      if (!broken_ && !cancelled_->load()) {
        if (write_in_flight_) {
          pending_writes_.push_back(std::move(call->response));
        } else {
          writing_ = std::move(call->response);
          write_in_flight_ = true;
          write_now = true;
        }
      }
    }
    if (write_now) {
      StartWrite(&writing_);
    } else {
      MaybeFinish();
    }
  }

  // Finishes once nothing is left to read, run or write. Must be the caller's last action:
  // OnDone may delete the reactor as soon as Finish is called.
  void MaybeFinish() {
    {
      absl::MutexLock lock(&mu_);
      const bool idle = outstanding_ == 0 && !write_in_flight_ && pending_writes_.empty();
      if (finished_ || !reads_done_ || !idle) return;
      finished_ = true;
    }
    Finish(cancelled_->load() ? grpc::Status::CANCELLED : grpc::Status::OK);
  }

  AttentionService* const service_;
  grpc::CallbackServerContext* const context_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
  v1::AttendRequest incoming_;  // only touched by the read chain

  absl::Mutex mu_;
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  v1::AttendResponse writing_;  // owned by the write in flight
  std::deque<v1::AttendResponse> pending_writes_ ABSL_GUARDED_BY(mu_);
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

absl::Status AttentionService::CheckCall(const grpc::CallbackServerContext& context) const {
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

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttentionService::AttendStream(
    grpc::CallbackServerContext* context) {
  return new AttendStreamReactor(this, context);
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
