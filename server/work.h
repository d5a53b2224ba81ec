// The work that flows from the service (the door) through the batcher to a lane, in attention
// types only: what to compute, where its inputs are, where each output goes, and what the lane
// reports back. The service turns the report into the protobuf response; lanes never see a wire
// type.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attn/engine.h"
#include "proto/wire/request_decoder.h"
#include "server/metrics.h"
#include "server/session_store.h"

namespace attnserve {

// Where a lane writes one output tensor: a fixed range (a shared-memory region), or else a
// buffer the door allocates once the lane knows the bytes (the response's own storage), so that
// each output is copied exactly once.
struct OutputSink {
  std::byte* fixed = nullptr;
  std::function<std::byte*(int64_t bytes)> allocate;

  bool wanted() const { return fixed != nullptr || allocate != nullptr; }
  std::byte* Get(int64_t bytes) const { return fixed != nullptr ? fixed : allocate(bytes); }
};

// What a lane says about the engine call a request took part in.
struct ExecutionReport {
  attn::EngineKind engine = attn::EngineKind::kCpuTiled;
  uint64_t batch_id = 0;
  int batch_requests = 0;
  int64_t batch_tokens = 0;  // query + key tokens of the whole call
  absl::Time started, computed;
  std::optional<absl::Duration> kernel;  // the engine call, when the pool could time it
};

// Which requests may share one engine call: equal keys. A request that never shares (a backward
// pass) has no key.
struct BatchKey {
  bool paged = false;  // session steps: K/V through block tables
  int engine = 0;
  attn::DType dtype = attn::DType::kF32;
  int num_heads = 0, num_kv_heads = 0, head_dim = 0;
  bool causal = false;
  int window_left = -1, window_right = -1;
  float scale = 0;

  static BatchKey Of(int engine, const attn::AttentionProblem& p);
  bool operator==(const BatchKey& o) const {
    return paged == o.paged && engine == o.engine && dtype == o.dtype && num_heads == o.num_heads &&
           num_kv_heads == o.num_kv_heads && head_dim == o.head_dim && causal == o.causal &&
           window_left == o.window_left && window_right == o.window_right && scale == o.scale;
  }
};

enum class WorkKind : uint8_t { kForward, kBackward, kSessionStep, kAppend };

// One accepted request on its way to a lane.
struct Work {
  explicit Work(WorkKind k) : kind(k) {}
  virtual ~Work() = default;

  const WorkKind kind;
  int engine = 0;                 // index into every lane's engines
  std::optional<BatchKey> batch;  // unset: runs alone
  int device = -1;                // the device slot whose lanes must run it; -1: any
  // Work with the same non-null key runs one at a time, in the order it was queued (a session's
  // steps and appends).
  const void* exclusive = nullptr;
  int64_t tokens = 0;  // query + key tokens, for the batch's token budget
  int64_t bytes = 0;   // working set, for the batch's memory budget
  absl::Time accepted;
  absl::Time deadline = absl::InfiniteFuture();
  Metrics::Method method = Metrics::Method::kAttend;             // for the metrics' labels
  Metrics::PathReason path_reason = Metrics::PathReason::kAuto;  // why this engine
  std::shared_ptr<const std::atomic<bool>> cancelled;            // set when the client goes away
  ExecutionReport report;  // filled by the lane before done(OK)
  absl::Status failure;    // set by the lane when this work failed alone (its batch did not)
  // Runs exactly once, on a lane thread or one of its completion threads; the batcher forgets
  // the work after it.
  std::function<void(const absl::Status&, const Work&)> done;
};

// Attend: O (and the LSE when wanted) of one validated request.
struct ForwardWork final : Work {
  ForwardWork() : Work(WorkKind::kForward) {}
  DecodedForward request;  // aliases bytes the RPC keeps alive until `done` runs
  OutputSink o;            // [total_q, num_heads, head_dim]
  OutputSink lse;          // float32 [num_heads, total_q]; unset: not wanted
};

// AttendBackward: dQ, dK, dV (the forward first when the client sent no O and LSE).
struct BackwardWork final : Work {
  BackwardWork() : Work(WorkKind::kBackward) {}
  DecodedBackward request;
  OutputSink dq, dk, dv;
  // attn::BackwardArgs::deterministic: the request asks, or the server runs every backward so.
  // A backward runs alone (no batch key), so no engine call mixes the two modes.
  bool deterministic = false;
};

// Attend with session_id: Q (and with append, the K/V rows to add) against a session's pages.
struct SessionStepWork final : Work {
  SessionStepWork() : Work(WorkKind::kSessionStep) {}
  DecodedForward request;  // cu_seqlens_k = {0, appended}; the lane adds the session's tokens
  SessionUse session;
  bool append = false;
  OutputSink o, lse;
  int64_t keys = 0;  // set by the lane: the keys the step attended over
};

// One chunk of an AppendKV call: its rows into the pages of the call's open append.
struct AppendWork final : Work {
  AppendWork() : Work(WorkKind::kAppend) {}
  SessionAppend* append = nullptr;  // owned by the call, alive until done
  const char* k = nullptr;          // [tokens, num_kv_heads, head_dim], the session's dtype
  const char* v = nullptr;
  int64_t rows = 0;
};

}  // namespace attnserve
