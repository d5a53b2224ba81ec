// The door of KV sessions: the session RPCs (CreateSession, GetSession, ListSessions,
// DeleteSession, the client-streamed AppendKV) and Attend steps with session_id, turned into
// the SessionStore's calls and into Work for the lanes of the session's device. AttentionService
// checks each call (token, draining) and hands it here.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "server/batcher.h"
#include "server/identity.h"
#include "server/metrics.h"
#include "server/session_store.h"

namespace attnserve {

class AttentionService;

class SessionService {
 public:
  // `spaces[slot]`: where device slot `slot`'s pages live (its steps run on engines there).
  SessionService(AttentionService* door, SessionStore* store, Batcher* batcher, Metrics* metrics);

  absl::Status Create(const Identity& caller, const v1::CreateSessionRequest& request,
                      v1::Session* response);
  absl::Status Get(const Identity& caller, const v1::GetSessionRequest& request,
                   v1::Session* response);
  absl::Status List(const Identity& caller, const v1::ListSessionsRequest& request,
                    v1::ListSessionsResponse* response);
  absl::Status Delete(const Identity& caller, const v1::DeleteSessionRequest& request,
                      v1::DeleteSessionResponse* response);

  // An Attend with session_id, as AttentionService::Admit takes one.
  absl::Status AdmitStep(Metrics::Method method, const Identity& caller,
                         const v1::AttendRequest& request, v1::AttendResponse* response,
                         absl::Time deadline, std::shared_ptr<const std::atomic<bool>> cancelled,
                         std::function<void(const absl::Status&)> done);

  // The AppendKV call's reactor (`sessions` null: it answers FAILED_PRECONDITION).
  static grpc::ServerReadReactor<v1::AppendKVRequest>* StartAppend(
      AttentionService* door, SessionService* sessions, grpc::CallbackServerContext* context,
      v1::AppendKVResponse* response);

  SessionStore& store() { return *store_; }
  AttentionService& door() { return *door_; }
  Batcher& batcher() { return *batcher_; }
  Metrics& metrics() { return *metrics_; }

 private:
  AttentionService* const door_;
  SessionStore* const store_;
  Batcher* const batcher_;
  Metrics* const metrics_;
};

// The Session message for a session as it is now.
void FillSession(const Session& session, v1::Session* out);

}  // namespace attnserve
