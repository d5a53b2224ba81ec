#include "server/training/training_service.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attn/status_macros.h"
#include "server/grpc_status.h"
#include "server/logging.h"
#include "server/training/training_codec.h"

namespace attnserve::training {
namespace {

std::string NewJobId() {
  static absl::Mutex mu(absl::kConstInit);
  static std::mt19937_64* random = nullptr;
  absl::MutexLock lock(&mu);
  if (random == nullptr) {
    std::random_device device;
    random = new std::mt19937_64((uint64_t{device()} << 32) ^ device());
  }
  return absl::StrFormat("tj-%016x", (*random)());
}

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

// One SubmitTrainingJob stream: the spec, then the uploaded tensors' chunks. Problems with the
// job (its spec, its data) are collected and make it FAILED when the stream ends; only a stream
// that is not a submission at all (no spec first) or a caller that is refused ends the call
// with an error.
class TrainingService::SubmitReactor final
    : public grpc::ServerReadReactor<v1::SubmitTrainingJobRequest> {
 public:
  SubmitReactor(TrainingService* service, grpc::CallbackServerContext* context,
                v1::TrainingJob* response)
      : service_(service), context_(context), response_(response) {
    absl::StatusOr<Identity> caller = service->CheckCall(*context);
    if (!caller.ok()) {
      Finish(ToGrpcStatus(caller.status()));
      return;
    }
    caller_ = *std::move(caller);
    const int unfinished = service->registry_.Unfinished();
    if (unfinished >= service->options_.max_unfinished_jobs) {
      Finish(ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
          "training: ", unfinished, " jobs are queued or running (--training_max_jobs=",
          service->options_.max_unfinished_jobs, "); submit again once one ends"))));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (context_->IsCancelled()) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the submission was cancelled"));
        return;
      }
      if (!has_spec_) {
        Finish(ToGrpcStatus(absl::InvalidArgumentError(
            "SubmitTrainingJob: the stream ended before its spec (the first message)")));
        return;
      }
      Complete();
      return;
    }
    if (!has_spec_) {
      if (!request_.has_spec()) {
        Finish(ToGrpcStatus(
            absl::InvalidArgumentError("SubmitTrainingJob: the first message must be the spec")));
        return;
      }
      has_spec_ = true;
      spec_ = std::move(*request_.mutable_spec());
      if (spec_.data().has_uploaded()) {
        v1::UploadedData* uploaded = spec_.mutable_data()->mutable_uploaded();
        Append(v1::DataChunk::FIELD_INPUTS, 0, uploaded->inputs().data());
        Append(v1::DataChunk::FIELD_TARGETS, 0, uploaded->targets().data());
        inline_inputs_ = !uploaded->inputs().data().empty();
        inline_targets_ = !uploaded->targets().data().empty();
        uploaded->mutable_inputs()->clear_data();
        uploaded->mutable_targets()->clear_data();
      }
    } else if (request_.has_chunk()) {
      const v1::DataChunk& chunk = request_.chunk();
      if (!spec_.data().has_uploaded()) {
        Problem("data: chunks arrived but the spec uploads no data (data.uploaded)");
      } else if ((chunk.field() == v1::DataChunk::FIELD_INPUTS && inline_inputs_) ||
                 (chunk.field() == v1::DataChunk::FIELD_TARGETS && inline_targets_)) {
        Problem(absl::StrCat("data.uploaded: chunks of ", v1::DataChunk::Field_Name(chunk.field()),
                             " beside its inline data; send one or the other"));
      } else {
        Append(chunk.field(), chunk.offset(), chunk.data());
      }
    } else {
      Problem("SubmitTrainingJob: a second spec, or an empty message, after the first");
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  void Problem(std::string message) {
    if (problem_.ok()) problem_ = absl::InvalidArgumentError(std::move(message));
  }

  void Append(v1::DataChunk::Field field, uint64_t offset, const std::string& bytes) {
    std::string* buffer = field == v1::DataChunk::FIELD_INPUTS    ? &inputs_
                          : field == v1::DataChunk::FIELD_TARGETS ? &targets_
                                                                  : nullptr;
    if (buffer == nullptr) {
      Problem("data chunk: field unset (FIELD_INPUTS or FIELD_TARGETS)");
      return;
    }
    const char* name = field == v1::DataChunk::FIELD_INPUTS ? "inputs" : "targets";
    if (offset != buffer->size() && problem_.ok()) {
      Problem(absl::StrCat("data.uploaded.", name, ": a chunk at offset ", offset, " after ",
                           buffer->size(), " bytes (chunks go in order)"));
    }
    const uint64_t total = inputs_.size() + targets_.size() + bytes.size();
    if (total > static_cast<uint64_t>(service_->options_.max_data_bytes)) {
      if (problem_.ok()) {
        Problem(absl::StrCat("data.uploaded: more than ", service_->options_.max_data_bytes,
                             " bytes (--training_max_data_bytes)"));
      }
      return;  // the rest is read and dropped
    }
    if (problem_.ok()) buffer->append(bytes);
  }

  void Complete() {
    if (service_->shut_down_.load()) {
      Finish(ToGrpcStatus(absl::UnavailableError("server: shutting down, not accepting jobs")));
      return;
    }
    std::shared_ptr<Job> job =
        service_->CreateJob(caller_, spec_, problem_, std::move(inputs_), std::move(targets_));
    service_->registry_.Read([&] { *response_ = JobToProto(*job); });
    Finish(grpc::Status::OK);
  }

  TrainingService* const service_;
  grpc::CallbackServerContext* const context_;
  v1::TrainingJob* const response_;
  Identity caller_;
  v1::SubmitTrainingJobRequest request_;
  bool has_spec_ = false;
  v1::TrainingJobSpec spec_;
  bool inline_inputs_ = false, inline_targets_ = false;
  std::string inputs_, targets_;
  absl::Status problem_;
};

// One WatchTrainingJob stream: the job's state now, then after each change the registry reports,
// coalesced to the latest while a write is in flight, and the call ends after the event that
// shows the job finished. State is under the reactor's mutex, and no lock is held while calling
// into gRPC: a write or a finish may complete (and OnDone run) on the calling thread.
class TrainingService::WatchReactor final : public grpc::ServerWriteReactor<v1::TrainingJobEvent> {
 public:
  WatchReactor(TrainingService* service, grpc::CallbackServerContext* context,
               const v1::WatchTrainingJobRequest* request)
      : service_(service) {
    absl::StatusOr<std::shared_ptr<Job>> job = service->FindJob(*context, request->job_id());
    if (!job.ok()) {
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;
      }
      Finish(ToGrpcStatus(job.status()));
      return;
    }
    job_ = *std::move(job);
    watcher_ = std::make_shared<Watcher>(this);
    service->registry_.Watch(*job_, watcher_);
    if (WatchReactor* self = watcher_->Acquire()) {
      self->Send();
      watcher_->Release();
    }
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok && !finished_) {
        finished_ = true;
        pending_finish_ = grpc::Status(grpc::StatusCode::CANCELLED, "the watcher went away");
      } else if (terminal_sent_ && !finished_) {
        finished_ = true;
        pending_finish_ = grpc::Status::OK;
      }
    }
    if (!FinishIfDue()) Send();
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
      pending_finish_ = grpc::Status(grpc::StatusCode::CANCELLED, "the watcher went away");
    }
    FinishIfDue();
  }

  void OnDone() override {
    if (watcher_ == nullptr) {
      delete this;
      return;
    }
    service_->registry_.Unwatch(*job_, watcher_.get());
    if (watcher_->Detach()) delete this;  // else the notification in progress deletes it
  }

 private:
  // The registry's handle on this stream, which outlives it. A notification holds the reactor
  // (Acquire .. Release) without holding a lock; when OnDone comes meanwhile (possibly on the
  // same thread, from within the notification's write), the last Release deletes the reactor.
  class Watcher final : public JobWatcher {
   public:
    explicit Watcher(WatchReactor* reactor) : reactor_(reactor) {}

    void OnJobChanged() override {
      if (WatchReactor* reactor = Acquire()) {
        reactor->Send();
        Release();
      }
    }
    void ShutDown() {
      if (WatchReactor* reactor = Acquire()) {
        reactor->ShutDown();
        Release();
      }
    }

    WatchReactor* Acquire() {
      absl::MutexLock lock(&mu_);
      if (reactor_ == nullptr) return nullptr;
      ++active_;
      return reactor_;
    }
    void Release() {
      WatchReactor* done = nullptr;
      {
        absl::MutexLock lock(&mu_);
        if (--active_ == 0) std::swap(done, detached_);
      }
      delete done;
    }
    // OnDone: true when the reactor may be deleted now.
    bool Detach() {
      absl::MutexLock lock(&mu_);
      if (active_ > 0) detached_ = reactor_;
      reactor_ = nullptr;
      return detached_ == nullptr;
    }

   private:
    absl::Mutex mu_;
    WatchReactor* reactor_ ABSL_GUARDED_BY(mu_);
    WatchReactor* detached_ ABSL_GUARDED_BY(mu_) = nullptr;
    int active_ ABSL_GUARDED_BY(mu_) = 0;
  };
  friend class TrainingService;

  // Writes the job's latest state when it changed since the last write and none is in flight.
  void Send() {
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || writing_) return;
      uint64_t version = 0;
      bool terminal = false;
      service_->registry_.Read([&] {
        version = job_->version;
        terminal = Finished(job_->state);
        if (!sent_any_ || version != sent_version_) *event_.mutable_job() = JobToProto(*job_);
      });
      if (sent_any_ && version == sent_version_) return;
      sent_any_ = true;
      sent_version_ = version;
      terminal_sent_ = terminal;
      writing_ = true;
    }
    StartWrite(&event_);
  }

  // The server shuts down: the job resumes after the restart, this stream ends now.
  void ShutDown() {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
      pending_finish_ = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                     "server: shutting down; the job resumes after the restart");
    }
    FinishIfDue();
  }

  // Finishes when a finish is pending and no write is in flight; true when it did (the reactor
  // may be gone then).
  bool FinishIfDue() {
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      if (!pending_finish_.has_value() || writing_) return false;
      status = *std::move(pending_finish_);
      pending_finish_.reset();
    }
    Finish(status);
    return true;
  }

  TrainingService* const service_;
  std::shared_ptr<Job> job_;
  std::shared_ptr<Watcher> watcher_;
  absl::Mutex mu_;
  v1::TrainingJobEvent event_;  // filled under mu_, read by gRPC while writing_
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool sent_any_ ABSL_GUARDED_BY(mu_) = false;
  bool terminal_sent_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t sent_version_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<grpc::Status> pending_finish_ ABSL_GUARDED_BY(mu_);
};

TrainingService::TrainingService(Options options, prometheus::Registry* registry)
    : options_(std::move(options)),
      metrics_(registry, static_cast<int>(options_.workers.size())),
      registry_(
          [this](std::optional<JobState> from, JobState to) { metrics_.OnTransition(from, to); }) {}

absl::StatusOr<std::unique_ptr<TrainingService>> TrainingService::Create(
    Options options, prometheus::Registry* registry) {
  if (!options.check_call) return absl::InvalidArgumentError("training: no check_call");
  if (options.workers.empty()) return absl::InvalidArgumentError("training: no workers");
  std::unique_ptr<TrainingService> service(new TrainingService(std::move(options), registry));
  if (!service->options_.dir.empty()) {
    ATTN_ASSIGN_OR_RETURN(
        service->store_,
        CheckpointStore::Open(service->options_.dir, service->options_.disk_limit_bytes));
  }
  TrainingScheduler::Options scheduler;
  scheduler.workers = service->options_.workers;
  scheduler.checkpoint_every = service->options_.checkpoint_every;
  scheduler.serving_busy = service->options_.serving_busy;
  service->scheduler_ = std::make_unique<TrainingScheduler>(
      std::move(scheduler), &service->registry_, service->store_.get(), &service->metrics_);
  ATTN_RETURN_IF_ERROR(service->Resume());
  return service;
}

absl::Status TrainingService::Resume() {
  if (store_ == nullptr) return absl::OkStatus();
  std::vector<std::string> problems;
  std::vector<JobRecord> records = store_->LoadAll(&problems);
  for (const std::string& problem : problems) ATTN_LOG(kWarning) << "training: " << problem;
  std::vector<std::shared_ptr<Job>> jobs;
  for (const JobRecord& record : records) jobs.push_back(JobFromRecord(record));
  std::sort(jobs.begin(), jobs.end(),
            [](const auto& a, const auto& b) { return a->created < b->created; });
  int resumed = 0;
  for (std::shared_ptr<Job>& job : jobs) {
    const bool unfinished = !Finished(job->state);
    registry_.Add(job);
    if (unfinished) {
      ++resumed;
      ATTN_LOG(kInfo) << "training job " << job->id << " resumes from step " << job->checkpoint_step
                      << " of " << job->spec.steps;
      scheduler_->Resume(std::move(job));
    }
  }
  ATTN_LOG(kInfo) << "training: " << jobs.size() << " jobs in " << store_->dir() << ", " << resumed
                  << " to resume";
  return absl::OkStatus();
}

TrainingService::~TrainingService() { Shutdown(); }

void TrainingService::Shutdown() {
  if (shut_down_.exchange(true)) return;
  scheduler_->Stop();
  for (const std::shared_ptr<JobWatcher>& watcher : registry_.AllWatchers()) {
    static_cast<WatchReactor::Watcher*>(watcher.get())->ShutDown();
  }
}

absl::StatusOr<Identity> TrainingService::CheckCall(const grpc::ServerContextBase& context) const {
  absl::StatusOr<Identity> caller = options_.check_call(context);
  if (caller.ok() && shut_down_.load()) {
    return absl::UnavailableError("server: shutting down, not accepting requests");
  }
  return caller;
}

absl::StatusOr<std::shared_ptr<Job>> TrainingService::FindJob(
    const grpc::ServerContextBase& context, const std::string& id) const {
  ATTN_ASSIGN_OR_RETURN(const Identity caller, CheckCall(context));
  return registry_.Find(caller, id);
}

std::shared_ptr<Job> TrainingService::CreateJob(const Identity& owner,
                                                const v1::TrainingJobSpec& wire,
                                                absl::Status problem, std::string inputs,
                                                std::string targets) {
  auto job = std::make_shared<Job>();
  job->id = NewJobId();
  job->owner = owner;
  job->wire_spec = WithoutData(wire);
  job->created = absl::Now();
  job->started = job->ended = absl::InfinitePast();
  if (problem.ok()) {
    absl::StatusOr<TrainingSpec> spec = SpecFromProto(wire);
    if (spec.ok()) {
      job->spec = *std::move(spec);
      job->spec_valid = true;
    } else {
      problem = spec.status();
    }
  }
  if (problem.ok() && job->spec.source == DataSource::kUploaded) {
    absl::StatusOr<std::vector<float>> x = UploadedValues(
        inputs, job->spec.upload.inputs_dtype, InputsBytes(job->spec), "data.uploaded.inputs");
    absl::StatusOr<std::vector<float>> y =
        x.ok() ? UploadedValues(targets, job->spec.upload.targets_dtype, TargetsBytes(job->spec),
                                "data.uploaded.targets")
               : x.status();
    if (y.ok()) {
      job->uploaded = true;
      job->data = std::make_shared<UploadedDataset>(job->spec, *std::move(x), *std::move(y));
    } else {
      problem = y.status();
    }
  }
  job->progress.total_steps = job->spec_valid ? job->spec.steps : wire.steps();
  if (!problem.ok()) {
    job->state = JobState::kFailed;
    job->error = std::string(problem.message());
    job->ended = job->created;
    job->uploaded = false;
    inputs.clear();
    targets.clear();
    ATTN_LOG(kInfo) << "training job " << job->id << " of '" << owner.name
                    << "' failed at submission: " << job->error;
  } else {
    ATTN_LOG(kInfo) << "training job " << job->id << " of '" << owner.name
                    << "' queued: " << job->spec.steps << " steps of " << job->spec.batch_size
                    << " x " << job->spec.seqlen << " tokens";
  }
  registry_.Add(job);
  scheduler_->Submit(job, std::move(inputs), std::move(targets));
  return job;
}

grpc::ServerReadReactor<v1::SubmitTrainingJobRequest>* TrainingService::SubmitTrainingJob(
    grpc::CallbackServerContext* context, v1::TrainingJob* response) {
  return new SubmitReactor(this, context, response);
}

grpc::ServerUnaryReactor* TrainingService::GetTrainingJob(grpc::CallbackServerContext* context,
                                                          const v1::GetTrainingJobRequest* request,
                                                          v1::TrainingJob* response) {
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(*context, request->job_id());
  if (job.ok()) registry_.Read([&] { *response = JobToProto(**job); });
  return Done(context, job.status());
}

grpc::ServerUnaryReactor* TrainingService::ListTrainingJobs(
    grpc::CallbackServerContext* context, const v1::ListTrainingJobsRequest* request,
    v1::ListTrainingJobsResponse* response) {
  absl::StatusOr<Identity> caller = CheckCall(*context);
  if (caller.ok()) {
    const std::vector<std::shared_ptr<Job>> jobs = registry_.List(*caller);
    registry_.Read([&] {
      for (const auto& job : jobs) *response->add_jobs() = JobToProto(*job);
    });
  }
  return Done(context, caller.status());
}

grpc::ServerWriteReactor<v1::TrainingJobEvent>* TrainingService::WatchTrainingJob(
    grpc::CallbackServerContext* context, const v1::WatchTrainingJobRequest* request) {
  return new WatchReactor(this, context, request);
}

grpc::ServerUnaryReactor* TrainingService::CancelTrainingJob(
    grpc::CallbackServerContext* context, const v1::CancelTrainingJobRequest* request,
    v1::TrainingJob* response) {
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(*context, request->job_id());
  if (job.ok()) {
    scheduler_->Cancel(*job);
    registry_.Read([&] { *response = JobToProto(**job); });
  }
  return Done(context, job.status());
}

grpc::ServerUnaryReactor* TrainingService::GetTrainingResult(
    grpc::CallbackServerContext* context, const v1::GetTrainingResultRequest* request,
    v1::TrainingResult* response) {
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(*context, request->job_id());
  absl::Status status = job.status();
  if (job.ok()) {
    registry_.Read([&] {
      if (!Finished((*job)->state)) {
        status = absl::FailedPreconditionError(absl::StrCat(
            "training job '", (*job)->id, "' is ", std::string(JobStateName((*job)->state)),
            "; its result exists once it ends"));
      } else {
        *response = ResultToProto(**job);
      }
    });
  }
  return Done(context, status);
}

}  // namespace attnserve::training
