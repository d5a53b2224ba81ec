#include "server/stream_frontend.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/grpc_status.h"

namespace attnserve {
namespace {

class StreamCall;

// A completion-queue tag: the step of a call that finished. While its operation is pending the
// step holds a reference to the call, so a call lives as long as any of its operations (and
// any admitted request, whose completion holds one too).
struct Step {
  void (StreamCall::*on_done)(bool ok) = nullptr;
  std::shared_ptr<StreamCall> pending;

  void Run(bool ok) {
    std::shared_ptr<StreamCall> call = std::move(pending);
    (call.get()->*on_done)(ok);
  }
};

// One AttendStream call. Its steps all complete on the queue it was accepted on, so they run
// one at a time on that queue's thread; Complete runs on the batcher's threads, hence mu_.
class StreamCall final : public std::enable_shared_from_this<StreamCall> {
 public:
  StreamCall(AttentionService* service, grpc::ServerCompletionQueue* queue)
      : service_(service),
        queue_(queue),
        io_(&context_),
        cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    accepted_.on_done = &StreamCall::OnAccepted;
    read_.on_done = &StreamCall::OnRead;
    write_.on_done = &StreamCall::OnWrite;
    finish_.on_done = &StreamCall::OnFinish;
    done_.on_done = &StreamCall::OnDone;
  }

  // Waits for the next AttendStream call on `queue`.
  static void Listen(AttentionService* service, grpc::ServerCompletionQueue* queue) {
    auto call = std::make_shared<StreamCall>(service, queue);
    call->done_.pending = call;
    call->context_.AsyncNotifyWhenDone(&call->done_);
    call->accepted_.pending = call;
    service->RequestAttendStream(&call->context_, &call->io_, queue, queue, &call->accepted_);
  }

 private:
  struct Request {
    v1::AttendRequest request;
    v1::AttendResponse response;
  };

  void OnAccepted(bool ok) {
    if (!ok) {  // the server is shutting down; a call that never started gets no done step
      done_.pending.reset();
      return;
    }
    Listen(service_, queue_);
    if (const absl::Status status = service_->CheckCall(context_); !status.ok()) {
      service_->metrics()->OnRejected(Metrics::Method::kAttendStream, status);
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;
      }
      finish_.pending = shared_from_this();
      io_.Finish(ToGrpcStatus(status), &finish_);
      return;
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
        reads_done_ = true;
      }
      MaybeFinish();
      return;
    }
    auto request = std::make_shared<Request>();
    request->request = std::move(incoming_);
    incoming_.Clear();
    request->response.set_request_id(request->request.request_id());
    {
      absl::MutexLock lock(&mu_);
      ++outstanding_;
    }
    const absl::Status status =
        service_->Admit(Metrics::Method::kAttendStream, request->request, &request->response,
                        AttentionService::DeadlineOf(context_), cancelled_,
                        [self = shared_from_this(), request](const absl::Status& s) {
                          self->Complete(request, s);
                        });
    if (!status.ok()) {
      service_->metrics()->OnRejected(Metrics::Method::kAttendStream, status);
      Complete(request, status);
    }
    StartRead();
  }

  void Complete(const std::shared_ptr<Request>& request, const absl::Status& status) {
    if (!status.ok()) {
      request->response.Clear();
      request->response.set_request_id(request->request.request_id());
      request->response.mutable_error()->set_code(static_cast<int>(status.code()));
      request->response.mutable_error()->set_message(std::string(status.message()));
    }
    bool write_now = false;
    {
      absl::MutexLock lock(&mu_);
      --outstanding_;
      if (!broken_ && !cancelled_->load()) {
        if (write_in_flight_) {
          pending_writes_.push_back(std::move(request->response));
        } else {
          writing_ = std::move(request->response);
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
    io_.Write(writing_, options, &write_);
  }

  void OnWrite(bool ok) {
    bool write_next = false, more_queued = false;
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
        more_queued = !pending_writes_.empty();
      } else {
        write_in_flight_ = false;
      }
    }
    if (write_next) {
      StartWrite(more_queued);
    } else {
      MaybeFinish();
    }
  }

  // Finishes once nothing is left to read, run or write.
  void MaybeFinish() {
    {
      absl::MutexLock lock(&mu_);
      const bool idle = outstanding_ == 0 && !write_in_flight_ && pending_writes_.empty();
      if (finished_ || !reads_done_ || !idle) return;
      finished_ = true;
    }
    finish_.pending = shared_from_this();
    io_.Finish(cancelled_->load() ? grpc::Status::CANCELLED : grpc::Status::OK, &finish_);
  }

  void OnFinish(bool) {}

  // The call is over: finished, or cancelled (by the client, its deadline or the drain).
  void OnDone(bool) {
    if (context_.IsCancelled()) cancelled_->store(true);
  }

  AttentionService* const service_;
  grpc::ServerCompletionQueue* const queue_;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<v1::AttendResponse, v1::AttendRequest> io_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
  Step accepted_, read_, write_, finish_, done_;
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

void Poll(grpc::ServerCompletionQueue* queue) {
  void* tag = nullptr;
  bool ok = false;
  while (queue->Next(&tag, &ok)) static_cast<Step*>(tag)->Run(ok);
}

}  // namespace

StreamFrontend::StreamFrontend(AttentionService* service, int threads)
    : service_(service), thread_count_(std::max(1, threads)) {}

StreamFrontend::~StreamFrontend() { Stop(); }

void StreamFrontend::AddQueues(grpc::ServerBuilder* builder) {
  for (int i = 0; i < thread_count_; ++i) queues_.push_back(builder->AddCompletionQueue());
}

void StreamFrontend::Start() {
  for (size_t i = 0; i < queues_.size(); ++i) {
    grpc::ServerCompletionQueue* queue = queues_[i].get();
    StreamCall::Listen(service_, queue);
    threads_.emplace_back(Poll, queue);
    pthread_setname_np(threads_.back().native_handle(), absl::StrCat("attn-stream-", i).c_str());
  }
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
