#include "server/session_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attn/status_macros.h"
#include "proto/wire/request_decoder.h"
#include "server/attention_service.h"
#include "server/grpc_status.h"
#include "server/response_writer.h"
#include "server/shared_memory.h"
#include "server/work.h"

namespace attnserve {
namespace {

int64_t UnixMillis(absl::Time t) { return absl::ToUnixMillis(t); }

KvGeometry GeometryOf(const Session& s) { return {s.dtype(), s.num_kv_heads(), s.head_dim()}; }

// One AppendKV call. Chunks are copied into the session's pages by a lane of its device, in
// order (the session's exclusive key); while one chunk is being copied the next is read off the
// wire, so the copies overlap the transfer (at most kChunksInFlight chunks are held). The call
// ends by committing the append once the client is done and every chunk is in (OK), or by
// dropping it (any failure, or the client cancelling), so the session shows all of its tokens
// or none.
class AppendReactor final : public grpc::ServerReadReactor<v1::AppendKVRequest> {
 public:
  AppendReactor(AttentionService* door, SessionService* sessions,
                grpc::CallbackServerContext* context, v1::AppendKVResponse* response)
      : door_(door), sessions_(sessions), context_(context), response_(response) {
    door_->CallStarted();
    absl::StatusOr<Identity> caller = door_->CheckCall(*context_);
    absl::Status status = caller.status();
    if (status.ok() && sessions_ == nullptr) {
      status = absl::FailedPreconditionError("session: this server offers no KV sessions");
    }
    if (!status.ok()) {
      door_->metrics()->OnRejected(Metrics::Method::kAppendKV, status);
      End(ToGrpcStatus(status));
      return;
    }
    caller_ = *std::move(caller);
    Read();
  }

  void OnReadDone(bool ok) override {
    std::shared_ptr<v1::AppendKVRequest> chunk;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (!ok) {
        reads_done_ = true;
      } else {
        chunk = std::move(chunk_);
      }
    }
    if (!ok) {  // the client is done sending (or the call is over)
      MaybeFinish();
      return;
    }
    {
      // Counted before the lane can finish it.
      absl::MutexLock lock(&mu_);
      ++in_flight_;
    }
    if (absl::Status s = Submit(std::move(chunk)); !s.ok()) {
      {
        absl::MutexLock lock(&mu_);
        --in_flight_;  // never queued: no Copied will come
      }
      End(ToGrpcStatus(s));
      return;
    }
    bool read_next = false;
    {
      absl::MutexLock lock(&mu_);
      read_next = in_flight_ < kChunksInFlight && !finished_ && !reading_ && !reads_done_;
      if (read_next) reading_ = true;
    }
    if (read_next) Read();
  }

  void OnDone() override {
    door_->CallEnded();
    bool last = false;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      last = in_flight_ == 0;
    }
    // A chunk still being copied holds the reactor (its append and the chunk's bytes); the last
    // one to finish deletes it.
    if (last) delete this;
  }

 private:
  static constexpr int kChunksInFlight = 2;

  void Read() {
    chunk_ = std::make_shared<v1::AppendKVRequest>();
    StartRead(chunk_.get());
  }

  // A chunk's copy is done. This chunk counts as in flight until the end, so that the reactor
  // outlives everything done here even if the call ends meanwhile.
  void Copied(const absl::Status& status) {
    bool over = false, read_next = false;
    {
      absl::MutexLock lock(&mu_);
      over = done_ || finished_;
      read_next = status.ok() && !over && !reading_ && !reads_done_;
      if (read_next) reading_ = true;
    }
    if (!over) {
      if (!status.ok()) {
        End(ToGrpcStatus(status));
      } else if (read_next) {
        Read();
      }
    }
    bool last = false;
    {
      absl::MutexLock lock(&mu_);
      --in_flight_;
      last = done_ && in_flight_ == 0;
    }
    if (last) {
      delete this;
      return;
    }
    if (!over && status.ok()) MaybeFinish();
  }

  void MaybeFinish() {
    {
      absl::MutexLock lock(&mu_);
      if (!reads_done_ || in_flight_ > 0 || finished_) return;
    }
    if (context_->IsCancelled()) {
      End(grpc::Status::CANCELLED);
    } else if (append_ == nullptr) {
      End(ToGrpcStatus(absl::InvalidArgumentError(
          "session_id: missing (the first AppendKV message names the session)")));
    } else if (const absl::Status committed = append_->Commit(); !committed.ok()) {
      End(ToGrpcStatus(committed));  // deleted meanwhile
    } else {
      FillSession(append_->session(), response_->mutable_session());
      response_->set_tokens_appended(append_->appended());
      End(grpc::Status::OK);
    }
  }

  absl::Status Submit(std::shared_ptr<v1::AppendKVRequest> chunk) {
    if (append_ == nullptr) {
      if (chunk->session_id().empty()) {
        return absl::InvalidArgumentError(
            "session_id: missing (the first AppendKV message names the session)");
      }
      ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                            sessions_->store().Get(caller_, chunk->session_id()));
      ATTN_ASSIGN_OR_RETURN(append_, SessionAppend::Open(session));
      use_ = SessionUse(std::move(session));
    } else if (!chunk->session_id().empty() && chunk->session_id() != use_->id()) {
      return absl::InvalidArgumentError(
          "session_id: every message of an AppendKV call names the same session (or none)");
    }
    const SharedMemoryScope scope(&door_->shared_memory(), caller_);
    ATTN_ASSIGN_OR_RETURN(DecodedKvRows rows,
                          DecodeKvRows(chunk->k(), chunk->v(), GeometryOf(*use_.get()),
                                       door_->limits(), door_->SharedMemoryFor(scope)));
    auto work = std::make_unique<AppendWork>();
    work->append = append_.get();
    work->k = rows.k;
    work->v = rows.v;
    work->rows = rows.rows;
    work->device = use_->device_slot();
    work->exclusive = use_.get();
    work->tokens = rows.rows;
    work->bytes = 2 * rows.rows * use_->row_bytes();
    // The chunk's bytes stay alive until the lane is done with them.
    auto keep = std::make_shared<std::pair<std::shared_ptr<v1::AppendKVRequest>, DecodedKvRows>>(
        std::move(chunk), std::move(rows));
    work->done = [this, keep](const absl::Status& s, const Work&) { Copied(s); };
    return door_->Submit(Metrics::Method::kAppendKV, AttentionService::EngineChoice{},
                         AttentionService::DeadlineOf(*context_), nullptr, std::move(work));
  }

  void End(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
    }
    Finish(status);
  }

  AttentionService* const door_;
  SessionService* const sessions_;
  grpc::CallbackServerContext* const context_;
  v1::AppendKVResponse* const response_;
  Identity caller_;
  std::shared_ptr<v1::AppendKVRequest> chunk_;  // the read in flight fills it
  std::unique_ptr<SessionAppend> append_;       // touched by one chunk at a time, in order
  SessionUse use_;
  absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // chunks submitted and not yet copied
  bool reading_ ABSL_GUARDED_BY(mu_) = true;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;  // OnDone ran: the call is over
};

}  // namespace

void FillSession(const Session& s, v1::Session* out) {
  out->set_session_id(s.id());
  out->set_num_kv_heads(s.num_kv_heads());
  out->set_head_dim(s.head_dim());
  out->set_dtype(ToProtoDType(s.dtype()));
  out->set_tokens(s.tokens());
  out->set_max_tokens(s.max_tokens());
  out->set_pages(static_cast<int32_t>(s.pages()));
  out->set_bytes(s.pages() * s.pool().page_bytes());
  out->set_page_tokens(s.page_tokens());
  out->set_device(s.pool().label());
  out->set_created_unix_ms(UnixMillis(s.created()));
  out->set_last_used_unix_ms(UnixMillis(s.last_used()));
  out->set_ttl_seconds(absl::ToInt64Seconds(s.ttl()));
}

SessionService::SessionService(AttentionService* door, SessionStore* store, Batcher* batcher,
                               Metrics* metrics)
    : door_(door), store_(store), batcher_(batcher), metrics_(metrics) {}

absl::Status SessionService::Create(const Identity& caller, const v1::CreateSessionRequest& r,
                                    v1::Session* response) {
  SessionSpec spec;
  absl::StatusOr<attn::DType> dtype = FromProtoDType(r.dtype());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("dtype: ", dtype.status().message()));
  }
  spec.dtype = *dtype;
  spec.num_kv_heads = r.num_kv_heads();
  spec.head_dim = r.head_dim();
  spec.max_tokens = r.max_tokens();
  if (r.ttl_seconds() < 0) return absl::InvalidArgumentError("ttl_seconds: must be >= 0");
  spec.ttl = absl::Seconds(r.ttl_seconds());
  // A session is only worth its pages if an engine where they live can attend over them.
  if (spec.num_kv_heads >= 1 && spec.head_dim >= 1) {
    const attn::AttentionProblem sample = attn::VarlenProblem(
        spec.dtype, {1}, {1}, spec.num_kv_heads, spec.num_kv_heads, spec.head_dim);
    absl::StatusOr<AttentionService::EngineChoice> engine = door_->ChooseEngine(
        sample, v1::PATH_AUTO, attn::Pass::kPagedForward, store_->pools().front()->space());
    if (!engine.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("session: no engine on this server attends over paged K/V of this dtype "
                       "and head_dim: ",
                       engine.status().message()));
    }
  }
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, store_->Create(caller, spec));
  FillSession(*session, response);
  return absl::OkStatus();
}

absl::Status SessionService::Get(const Identity& caller, const v1::GetSessionRequest& r,
                                 v1::Session* response) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, store_->Get(caller, r.session_id()));
  FillSession(*session, response);
  return absl::OkStatus();
}

absl::Status SessionService::List(const Identity& caller, const v1::ListSessionsRequest&,
                                  v1::ListSessionsResponse* response) {
  for (const auto& session : store_->List(caller)) FillSession(*session, response->add_sessions());
  return absl::OkStatus();
}

absl::Status SessionService::Delete(const Identity& caller, const v1::DeleteSessionRequest& r,
                                    v1::DeleteSessionResponse*) {
  return store_->Delete(caller, r.session_id());
}

absl::Status SessionService::AdmitStep(Metrics::Method method, const Identity& caller,
                                       const v1::AttendRequest& request,
                                       v1::AttendResponse* response, absl::Time deadline,
                                       std::shared_ptr<const std::atomic<bool>> cancelled,
                                       std::function<void(const absl::Status&)> done) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                        store_->Get(caller, request.session_id()));
  const SharedMemoryScope scope(&door_->shared_memory(), caller);
  ATTN_ASSIGN_OR_RETURN(DecodedForward decoded,
                        DecodeSessionAttendRequest(request, GeometryOf(*session), door_->limits(),
                                                   door_->SharedMemoryFor(scope)));
  ATTN_ASSIGN_OR_RETURN(const AttentionService::EngineChoice engine,
                        door_->ChooseEngine(decoded.problem, decoded.path,
                                            attn::Pass::kPagedForward, session->pool().space()));
  auto work = std::make_unique<SessionStepWork>();
  work->request = std::move(decoded);
  work->append = request.append();
  work->device = session->device_slot();
  work->exclusive = session.get();
  work->session = SessionUse(std::move(session));
  const attn::AttentionProblem& p = work->request.problem;
  BatchKey key = BatchKey::Of(engine.index, p);
  key.paged = true;
  work->batch = key;
  work->tokens = p.total_q() + p.total_k();
  const TensorSizes sizes = TensorSizesOf(p);
  work->bytes = 2 * sizes.q + 2 * sizes.kv + sizes.lse;
  BindOutputs(work.get(), response);
  work->done = [response, done = std::move(done)](const absl::Status& s, const Work& w) {
    if (s.ok()) FillResponse(static_cast<const SessionStepWork&>(w), response);
    done(s);
  };
  return door_->Submit(method, engine, deadline, std::move(cancelled), std::move(work));
}

grpc::ServerReadReactor<v1::AppendKVRequest>* SessionService::StartAppend(
    AttentionService* door, SessionService* sessions, grpc::CallbackServerContext* context,
    v1::AppendKVResponse* response) {
  return new AppendReactor(door, sessions, context, response);
}

}  // namespace attnserve
