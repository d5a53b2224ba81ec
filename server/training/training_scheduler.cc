#include "server/training/training_scheduler.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/logging.h"
#include "server/training/training_codec.h"

namespace attnserve::training {

TrainingScheduler::TrainingScheduler(Options options, JobRegistry* registry, CheckpointStore* store,
                                     TrainingMetrics* metrics)
    : options_(std::move(options)), registry_(registry), store_(store), metrics_(metrics) {
  io_thread_ = std::thread([this] { IoLoop(); });
  for (size_t w = 0; w < options_.workers.size(); ++w) {
    workers_.emplace_back([this, w] { WorkerLoop(static_cast<int>(w)); });
  }
}

TrainingScheduler::~TrainingScheduler() { Stop(); }

void TrainingScheduler::Stop() {
  if (stopped_) return;
  stopped_ = true;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : workers_) t.join();
  {
    absl::MutexLock lock(&mu_);
    io_stopping_ = true;
  }
  io_thread_.join();
}

bool TrainingScheduler::Stopping() const {
  absl::MutexLock lock(&mu_);
  return stopping_;
}

int TrainingScheduler::CheckpointEvery(const Job& job) const {
  return job.spec.checkpoint_every > 0 ? job.spec.checkpoint_every : options_.checkpoint_every;
}

void TrainingScheduler::PostIo(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  io_.push_back(std::move(work));
}

void TrainingScheduler::IoLoop() {
  while (true) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](TrainingScheduler* s)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return !s->io_.empty() || s->io_stopping_; },
          this));
      if (io_.empty()) return;  // stopping, and nothing left to write
      work = std::move(io_.front());
      io_.pop_front();
    }
    work();
  }
}

absl::Status TrainingScheduler::Persist(const Job& job, const TrainerState* state,
                                        bool with_moments) {
  if (store_ == nullptr) return absl::OkStatus();
  JobRecord record;
  registry_->Read([&] { record = RecordOf(job, state, with_moments); });
  absl::StatusOr<WriteResult> written = store_->WriteRecord(record);
  metrics_->OnCheckpoint(written.ok(), written.ok() ? written->duration : absl::ZeroDuration());
  return written.status();
}

void TrainingScheduler::Submit(std::shared_ptr<Job> job, std::string inputs, std::string targets) {
  PostIo([this, job = std::move(job), inputs = std::move(inputs),
          targets = std::move(targets)]() mutable {
    absl::Status written = absl::OkStatus();
    if (store_ != nullptr && job->uploaded) {
      absl::StatusOr<WriteResult> a = store_->WriteData(job->id, "inputs", inputs);
      absl::StatusOr<WriteResult> b = a.ok() ? store_->WriteData(job->id, "targets", targets) : a;
      written = b.status();
    }
    if (written.ok()) written = Persist(*job, nullptr, false);
    bool queue = false;
    registry_->Update(*job, [&] {
      if (!written.ok() && job->state == JobState::kQueued) {
        job->state = JobState::kFailed;
        job->error = std::string(written.message());
        job->ended = absl::Now();
        job->data.reset();
      }
      queue = job->state == JobState::kQueued;
    });
    if (!written.ok()) {
      ATTN_LOG(kWarning) << "training job " << job->id << " failed: " << written.message();
      return;
    }
    if (queue) {
      absl::MutexLock lock(&mu_);
      queue_.push_back(std::move(job));
    } else {
      (void)Persist(*job, nullptr, false);  // cancelled meanwhile: say so on disk too
    }
  });
}

void TrainingScheduler::Resume(std::shared_ptr<Job> job) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(job));
}

void TrainingScheduler::Cancel(const std::shared_ptr<Job>& job) {
  bool ended = false;
  registry_->Update(*job, [&] {
    if (job->state == JobState::kQueued) {
      job->state = JobState::kCancelled;
      job->ended = absl::Now();
      job->data.reset();
      if (job->state_on_disk.has_value()) {  // a resumed job keeps what it had learnt
        job->final_state = std::move(job->state_on_disk);
        job->state_on_disk.reset();
        job->final_state->optimizer.m.clear();
        job->final_state->optimizer.v.clear();
      }
      ended = true;
    } else if (job->state == JobState::kRunning) {
      job->cancel_requested = true;
    }
  });
  if (ended) {
    PostIo([this, job] {
      std::optional<TrainerState> state;
      registry_->Read([&] { state = job->final_state; });
      (void)Persist(*job, state.has_value() ? &*state : nullptr, false);
    });
  }
}

void TrainingScheduler::WorkerLoop(int worker) {
  while (true) {
    std::shared_ptr<Job> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](TrainingScheduler* s)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return !s->queue_.empty() || s->stopping_; },
          this));
      if (stopping_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    Run(worker, job);
  }
}

void TrainingScheduler::End(int worker, const std::shared_ptr<Job>& job, JobState state,
                            const std::string& error, const Trainer* trainer) {
  std::optional<TrainerState> final_state;
  if (trainer != nullptr) {
    absl::StatusOr<TrainerState> saved = trainer->Save();
    if (saved.ok()) {
      final_state = *std::move(saved);
      final_state->optimizer.m.clear();  // a finished job never steps again
      final_state->optimizer.v.clear();
    }
  }
  registry_->Update(*job, [&] {
    job->state = state;
    job->error = error;
    job->ended = absl::Now();
    job->progress.eta_seconds = 0;  // tokens_per_second stays: the last run's rate
    if (final_state.has_value()) {
      job->final_state = final_state;
    } else if (job->state_on_disk.has_value()) {
      job->final_state = std::move(job->state_on_disk);
    }
    job->state_on_disk.reset();
    job->data.reset();
  });
  metrics_->OnJobEnded(worker);
  absl::Status written = Persist(*job, final_state.has_value() ? &*final_state : nullptr, false);
  if (!written.ok() && final_state.has_value()) {
    // Most likely the disk is full: the final state without its weights is small.
    written = Persist(*job, nullptr, false);
  }
  if (!written.ok()) {
    ATTN_LOG(kError) << "training job " << job->id << ": its end (" << JobStateName(state)
                     << ") is not on disk: " << written.message();
  }
  ATTN_LOG(kInfo) << "training job " << job->id << " " << JobStateName(state)
                  << (error.empty() ? "" : ": ") << error;
}

void TrainingScheduler::Run(int worker, const std::shared_ptr<Job>& job) {
  bool runs = false;
  std::optional<TrainerState> resume;
  std::shared_ptr<UploadedDataset> data;
  registry_->Update(*job, [&] {
    if (job->state != JobState::kQueued) return;  // cancelled while queued
    runs = true;
    job->state = JobState::kRunning;
    if (job->started == absl::InfinitePast()) job->started = absl::Now();
    resume = job->state_on_disk;
    job->resumed_from_step = resume.has_value() ? resume->step : 0;
    job->progress.total_steps = job->spec.steps;
    data = job->data;
  });
  if (!runs) return;
  metrics_->OnJobStarted(worker);
  const TrainingSpec& spec = job->spec;

  std::unique_ptr<BatchSource> synthetic;
  BatchSource* source = nullptr;
  if (spec.source == DataSource::kSynthetic) {
    synthetic = std::make_unique<SyntheticTask>(spec);
    source = synthetic.get();
  } else {
    if (data == nullptr) {  // after a restart: read back what was uploaded
      absl::StatusOr<std::string> inputs = store_ != nullptr
                                               ? store_->ReadData(job->id, "inputs")
                                               : absl::NotFoundError("no --training_dir");
      absl::StatusOr<std::string> targets =
          inputs.ok() ? store_->ReadData(job->id, "targets") : inputs;
      absl::StatusOr<std::vector<float>> x =
          targets.ok() ? UploadedValues(*inputs, spec.upload.inputs_dtype, InputsBytes(spec),
                                        "data.uploaded.inputs")
                       : targets.status();
      absl::StatusOr<std::vector<float>> y =
          x.ok() ? UploadedValues(*targets, spec.upload.targets_dtype, TargetsBytes(spec),
                                  "data.uploaded.targets")
                 : x.status();
      if (!y.ok()) {
        End(worker, job, JobState::kFailed,
            absl::StrCat("the uploaded data did not survive the restart: ", y.status().message()),
            nullptr);
        return;
      }
      data = std::make_shared<UploadedDataset>(spec, *std::move(x), *std::move(y));
    }
    source = data.get();
  }

  absl::StatusOr<std::unique_ptr<Trainer>> created =
      Trainer::Create(spec, source, options_.workers[worker]);
  if (!created.ok()) {
    End(worker, job, JobState::kFailed, std::string(created.status().message()), nullptr);
    return;
  }
  std::unique_ptr<Trainer> trainer = *std::move(created);
  if (resume.has_value()) {
    if (absl::Status restored = trainer->Restore(*resume); !restored.ok()) {
      End(worker, job, JobState::kFailed,
          absl::StrCat("cannot resume from the checkpoint: ", restored.message()), nullptr);
      return;
    }
  }
  registry_->Update(*job, [&] {
    job->forward_engine = std::string(trainer->forward_engine());
    job->backward_engine = std::string(trainer->backward_engine());
    job->deterministic = trainer->deterministic();
    job->progress.metric_name = std::string(trainer->metric_name());
  });
  ATTN_LOG(kInfo) << "training job " << job->id << " runs on worker " << worker << " ("
                  << trainer->forward_engine() << " forward, " << trainer->backward_engine()
                  << " backward) from step " << trainer->step() << " of " << spec.steps;

  const absl::Time run_start = absl::Now();
  const int64_t first_step = trainer->step();
  const int every = CheckpointEvery(*job);
  while (true) {
    bool cancel = false;
    registry_->Read([&] { cancel = job->cancel_requested; });
    if (cancel) {
      End(worker, job, JobState::kCancelled, "", trainer.get());
      return;
    }
    if (Stopping()) {
      absl::StatusOr<TrainerState> state = trainer->Save();
      registry_->Update(*job, [&] {
        job->state = JobState::kQueued;
        job->progress.tokens_per_second = 0;
      });
      absl::Status written = state.ok() ? Persist(*job, &*state, true) : state.status();
      metrics_->OnJobEnded(worker);
      if (written.ok()) {
        ATTN_LOG(kInfo) << "training job " << job->id << " checkpointed at step " << trainer->step()
                        << " for the restart";
      } else {
        ATTN_LOG(kError) << "training job " << job->id << ": no checkpoint at shutdown ("
                         << written.message() << "); it resumes from step "
                         << (resume.has_value() ? resume->step : 0);
      }
      return;
    }
    if (trainer->step() >= spec.steps) {
      End(worker, job, JobState::kSucceeded, "", trainer.get());
      return;
    }
    if (options_.serving_busy) {
      const absl::Time wait_start = absl::Now();
      bool waited = false;
      while (options_.serving_busy() && !Stopping()) {
        registry_->Read([&] { cancel = job->cancel_requested; });
        if (cancel) break;
        waited = true;
        absl::SleepFor(options_.busy_poll);
      }
      if (waited) metrics_->OnYield(absl::Now() - wait_start);
      if (cancel || Stopping()) continue;
    }

    absl::StatusOr<StepStats> stats = trainer->Step();
    if (!stats.ok()) {
      End(worker, job, JobState::kFailed, std::string(stats.status().message()), trainer.get());
      return;
    }
    const double elapsed = absl::ToDoubleSeconds(absl::Now() - run_start);
    const int64_t tokens = trainer->tokens_per_step();
    const double rate =
        elapsed > 0 ? static_cast<double>((stats->step - first_step) * tokens) / elapsed : 0;
    registry_->Update(*job, [&] {
      Progress& p = job->progress;
      p.step = stats->step;
      p.loss = stats->loss;
      p.metric = stats->metric;
      p.learning_rate = stats->learning_rate;
      p.loss_scale = stats->loss_scale;
      p.tokens_per_second = rate;
      p.eta_seconds =
          rate > 0 ? static_cast<double>((spec.steps - stats->step) * tokens) / rate : 0;
      job->curve.Add(stats->step, static_cast<float>(stats->loss),
                     static_cast<float>(stats->metric));
    });
    metrics_->OnStep(worker, stats->loss, tokens, rate);

    if (store_ != nullptr && stats->step % every == 0 && stats->step < spec.steps) {
      absl::StatusOr<TrainerState> state = trainer->Save();
      absl::Status written = state.ok() ? Persist(*job, &*state, true) : state.status();
      if (!written.ok()) {
        End(worker, job, JobState::kFailed,
            absl::StrCat("step ", stats->step, ": ", written.message()), trainer.get());
        return;
      }
      resume = *std::move(state);
      registry_->Update(*job, [&] { job->checkpoint_step = stats->step; });
    }
  }
}

}  // namespace attnserve::training
