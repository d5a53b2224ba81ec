#include "server/stream_frontend.h"

#include <grpcpp/alarm.h>
#include <pthread.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/grpc_status.h"

namespace attnserve {

class StreamCall;

namespace {

// A completion-queue tag: the step of a call that finished. While its operation is pending the
// step holds a reference to the call, so a call lives as long as any of its operations (and
// any admitted request, whose completion holds one too).
struct Step {
  void (StreamCall::*on_done)(bool ok) = nullptr;
  std::shared_ptr<StreamCall> pending;

  void Run(bool ok);
};

}  // namespace

// One AttendStream call. Its steps all complete on the queue it was accepted on, so they run
// one at a time on that queue's thread; Complete runs on the batcher's threads, hence mu_.
class StreamCall final : public std::enable_shared_from_this<StreamCall> {
 public:
  StreamCall(StreamFrontend* frontend, grpc::ServerCompletionQueue* queue)
      : frontend_(frontend),
        service_(frontend->service_),
        queue_(queue),
        io_(&context_),
        cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    accepted_.on_done = &StreamCall::OnAccepted;
    read_.on_done = &StreamCall::OnRead;
    write_.on_done = &StreamCall::OnWrite;
    finish_.on_done = &StreamCall::OnFinish;
    done_.on_done = &StreamCall::OnDone;
    drain_.on_done = &StreamCall::OnDrain;
  }

  // Waits for the next AttendStream call on `queue`.
  static void Listen(StreamFrontend* frontend, grpc::ServerCompletionQueue* queue) {
    auto call = std::make_shared<StreamCall>(frontend, queue);
    call->done_.pending = call;
    call->context_.AsyncNotifyWhenDone(&call->done_);
    call->accepted_.pending = call;
    frontend->service_->RequestAttendStream(&call->context_, &call->io_, queue, queue,
                                            &call->accepted_);
  }

  // From any thread: run OnDrain on this call's queue thread.
  void NotifyDraining() {
    drain_.pending = shared_from_this();
    drain_alarm_.Set(queue_, gpr_now(GPR_CLOCK_MONOTONIC), &drain_);
  }

 private:
  struct Request {
    v1::AttendRequest request;
    v1::AttendResponse response;
    int64_t reserved = 0;  // bytes held against the bound until the response is queued
  };

  void OnAccepted(bool ok) {
    if (!ok) {  // the server is shutting down; a call that never started gets no done step
      done_.pending.reset();
      return;
    }
    Listen(frontend_, queue_);
    service_->CallStarted();
    started_ = true;
    absl::StatusOr<Identity> caller = service_->CheckCall(context_);
    if (!caller.ok()) {
      service_->metrics()->OnRejected(Metrics::Method::kAttendStream, caller.status());
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;
      }
      finish_.pending = shared_from_this();
      io_.Finish(ToGrpcStatus(caller.status()), &finish_);
      return;
    }
    caller_ = *std::move(caller);
    frontend_->Track(shared_from_this());
    {
      absl::MutexLock lock(&mu_);
      read_in_flight_ = true;
    }
    StartRead();
  }

  void StartRead() {
    read_.pending = shared_from_this();
    io_.Read(&incoming_, &read_);
  }

  void OnRead(bool ok) {
    if (!ok) {  // half-closed by the client, or the call is over
      {
        absl::MutexLock lock(&mu_);
        read_in_flight_ = false;
        reads_done_ = true;
      }
      MaybeFinish();
      return;
    }
    ++messages_read_;
    auto request = std::make_shared<Request>();
    // Until its response is written, a request counts against the stream's bound by its own
    // size: a response (O, LSE, or a shared-memory reference) is no larger than the request
    // that asked for it, so what a stream holds stays bounded before any answer exists.
    request->reserved = static_cast<int64_t>(incoming_.Length());
    const grpc::Status parsed =
        grpc::SerializationTraits<v1::AttendRequest>::Deserialize(&incoming_, &request->request);
    incoming_.Clear();
    if (!parsed.ok()) {
      // Not a half-close: the client sent something this method cannot take. Everything before
      // it is answered, then the stream ends saying so.
      {
        absl::MutexLock lock(&mu_);
        read_in_flight_ = false;
        reads_done_ = true;
        end_status_ = grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("AttendStream: message ", messages_read_,
                         " is not an AttendRequest (it does not parse); the ", messages_read_ - 1,
                         " before it were admitted and are answered"));
      }
      MaybeFinish();
      return;
    }
    request->response.set_request_id(request->request.request_id());
    {
      absl::MutexLock lock(&mu_);
      ++outstanding_;
      Hold(request->reserved);
    }
    const absl::Status status =
        service_->Admit(Metrics::Method::kAttendStream, caller_, request->request,
                        &request->response, AttentionService::DeadlineOf(context_), cancelled_,
                        [self = shared_from_this(), request](const absl::Status& s) {
                          self->Complete(request, s);
                        });
    if (!status.ok()) {
      service_->metrics()->OnRejected(Metrics::Method::kAttendStream, status);
      Complete(request, status);
    }
    bool read_next = false;
    {
      absl::MutexLock lock(&mu_);
      if (draining_ || reads_done_) {
        read_in_flight_ = false;
      } else if (held_bytes_ >= frontend_->options_.max_buffered_bytes) {
        read_in_flight_ = false;  // resumed by OnWrite once the client reads
      } else {
        read_next = true;
      }
    }
    if (read_next) {
      StartRead();
    } else {
      MaybeFinish();
    }
  }

  void Complete(const std::shared_ptr<Request>& request, const absl::Status& status) {
    if (!status.ok()) {
      request->response.Clear();
      request->response.set_request_id(request->request.request_id());
      request->response.mutable_error()->set_code(static_cast<int>(status.code()));
      request->response.mutable_error()->set_message(std::string(status.message()));
    }
    grpc::ByteBuffer bytes;
    bool own_buffer = false;
    const grpc::Status serialized = grpc::SerializationTraits<v1::AttendResponse>::Serialize(
        request->response, &bytes, &own_buffer);
    // The response's tensors are in the byte buffer now; the request's bytes can go too.
    request->response.Clear();
    const int64_t size = static_cast<int64_t>(bytes.Length());
    bool write_now = false;
    {
      absl::MutexLock lock(&mu_);
      --outstanding_;
      Release(request->reserved);
      if (!serialized.ok()) {
        broken_ = true;
        end_status_ = grpc::Status(grpc::StatusCode::INTERNAL,
                                   absl::StrCat("AttendStream: cannot serialize a response: ",
                                                serialized.error_message()));
      } else if (!broken_ && !cancelled_->load()) {
        Hold(size);
        if (write_in_flight_) {
          pending_writes_.push_back({std::move(bytes), size});
        } else {
          writing_ = {std::move(bytes), size};
          write_in_flight_ = true;
          write_now = true;
        }
      }
    }
    if (write_now) {
      StartWrite(/*more_queued=*/false);
    } else {
      MaybeFinish();
    }
  }

  // With more responses queued behind this one, gRPC may hold it (the write completes at once)
  // and send it with the next: one socket write for a batch's responses on this stream. The
  // last of a run is written without the hint, which flushes them all.
  void StartWrite(bool more_queued) {
    grpc::WriteOptions options;
    if (more_queued) options.set_buffer_hint();
    write_.pending = shared_from_this();
    io_.Write(writing_.bytes, options, &write_);
  }

  void OnWrite(bool ok) {
    bool write_next = false, more_queued = false, read_next = false;
    {
      absl::MutexLock lock(&mu_);
      Release(writing_.size);
      writing_ = {};
      if (!ok) DropPendingLocked();  // the client is gone
      if (!pending_writes_.empty()) {
        writing_ = std::move(pending_writes_.front());
        pending_writes_.pop_front();
        write_next = true;
        more_queued = !pending_writes_.empty();
      } else {
        write_in_flight_ = false;
      }
      // Reading paused on a full buffer resumes once half of it has drained.
      if (!read_in_flight_ && !reads_done_ && !draining_ && !broken_ &&
          held_bytes_ < frontend_->options_.max_buffered_bytes / 2) {
        read_in_flight_ = true;
        read_next = true;
      }
    }
    if (read_next) StartRead();
    if (write_next) {
      StartWrite(more_queued);
    } else {
      MaybeFinish();
    }
  }

  void OnDrain(bool) {
    {
      absl::MutexLock lock(&mu_);
      draining_ = true;
    }
    MaybeFinish();
  }

  // Finishes once nothing is left to read (or the server drains, or a message did not parse)
  // and nothing to run or write.
  void MaybeFinish() {
    grpc::Status status = grpc::Status::OK;
    {
      absl::MutexLock lock(&mu_);
      const bool idle = outstanding_ == 0 && !write_in_flight_ && pending_writes_.empty();
      if (finished_ || !idle || !(reads_done_ || draining_ || broken_)) return;
      // A read still in flight when draining completes by itself once the call is finished.
      finished_ = true;
      if (cancelled_->load()) {
        status = grpc::Status::CANCELLED;
      } else if (!end_status_.ok()) {
        status = end_status_;
      } else if (!reads_done_) {
        status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              "server: shutting down; every request read on this stream before "
                              "now has been answered");
      }
    }
    finish_.pending = shared_from_this();
    io_.Finish(status, &finish_);
  }

  void OnFinish(bool) {}

  // The call is over: finished, or cancelled (by the client, its deadline or the drain).
  void OnDone(bool) {
    if (context_.IsCancelled()) cancelled_->store(true);
    {
      absl::MutexLock lock(&mu_);
      DropPendingLocked();
    }
    if (started_) {
      frontend_->Untrack(this);
      service_->CallEnded();
    }
  }

  struct Buffered {
    grpc::ByteBuffer bytes;
    int64_t size = 0;
  };

  void Hold(int64_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    held_bytes_ += size;
    frontend_->buffered_bytes_.fetch_add(size);
  }
  void Release(int64_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    held_bytes_ -= size;
    frontend_->buffered_bytes_.fetch_sub(size);
  }

  // Responses nobody will read are freed at once.
  void DropPendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Buffered& b : pending_writes_) Release(b.size);
    pending_writes_.clear();
    broken_ = true;
  }

  StreamFrontend* const frontend_;
  AttentionService* const service_;
  grpc::ServerCompletionQueue* const queue_;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer> io_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
  Step accepted_, read_, write_, finish_, done_, drain_;
  grpc::Alarm drain_alarm_;
  // Only touched by the accept and read chain (one step at a time on the queue thread).
  grpc::ByteBuffer incoming_;
  Identity caller_;
  int64_t messages_read_ = 0;
  bool started_ = false;

  absl::Mutex mu_;
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  bool read_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status end_status_ ABSL_GUARDED_BY(mu_);
  // Requests admitted and not yet answered (their own size), and responses not yet written.
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  Buffered writing_;  // owned by the write in flight
  std::deque<Buffered> pending_writes_ ABSL_GUARDED_BY(mu_);
};

namespace {

void Step::Run(bool ok) {
  std::shared_ptr<StreamCall> call = std::move(pending);
  (call.get()->*on_done)(ok);
}

void Poll(grpc::ServerCompletionQueue* queue) {
  void* tag = nullptr;
  bool ok = false;
  while (queue->Next(&tag, &ok)) static_cast<Step*>(tag)->Run(ok);
}

}  // namespace

StreamFrontend::StreamFrontend(AttentionService* service, const Options& options)
    : service_(service), options_(options) {}

StreamFrontend::~StreamFrontend() { Stop(); }

void StreamFrontend::AddQueues(grpc::ServerBuilder* builder) {
  for (int i = 0; i < std::max(1, options_.threads); ++i) {
    queues_.push_back(builder->AddCompletionQueue());
  }
}

void StreamFrontend::Start() {
  for (size_t i = 0; i < queues_.size(); ++i) {
    grpc::ServerCompletionQueue* queue = queues_[i].get();
    StreamCall::Listen(this, queue);
    threads_.emplace_back(Poll, queue);
    pthread_setname_np(threads_.back().native_handle(), absl::StrCat("attn-stream-", i).c_str());
  }
}

void StreamFrontend::Track(const std::shared_ptr<StreamCall>& call) {
  bool draining = false;
  {
    absl::MutexLock lock(&calls_mu_);
    calls_[call.get()] = call;
    draining = draining_;
  }
  // A stream accepted as the drain began: CheckCall let it in, the drain must still reach it.
  if (draining) call->NotifyDraining();
}

void StreamFrontend::Untrack(const StreamCall* call) {
  absl::MutexLock lock(&calls_mu_);
  calls_.erase(call);
}

void StreamFrontend::StartDraining() {
  std::vector<std::shared_ptr<StreamCall>> open;
  {
    absl::MutexLock lock(&calls_mu_);
    draining_ = true;
    for (const auto& [ptr, weak] : calls_) {
      if (std::shared_ptr<StreamCall> call = weak.lock()) open.push_back(std::move(call));
    }
  }
  for (const auto& call : open) call->NotifyDraining();
}

void StreamFrontend::Stop() {
  if (stopped_) return;
  stopped_ = true;
  // Never started (the server did not build): nothing was asked of the queues, and destroying
  // them shuts them down; the C++ Shutdown would complain that the discarded server still
  // holds them.
  if (threads_.empty()) return;
  for (auto& queue : queues_) queue->Shutdown();
  for (std::thread& t : threads_) t.join();
}

}  // namespace attnserve
