// attnserve.v1.TrainingService on gRPC's callback API: submit, inspect, watch, cancel and
// collect training jobs. Handlers never block: they check the caller (the same bearer tokens
// and drain state as AttentionService, through Options::check_call), read or change the job
// registry, and hand disk work to the scheduler's threads. The protobuf messages stop here;
// the registry, scheduler and trainer see server/training's own types.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnserve/v1/training.grpc.pb.h"
#include "server/identity.h"
#include "server/training/checkpoint_store.h"
#include "server/training/job_registry.h"
#include "server/training/trainer.h"
#include "server/training/training_metrics.h"
#include "server/training/training_scheduler.h"

namespace prometheus {
class Registry;
}

namespace attnserve::training {

class TrainingService final : public v1::TrainingService::CallbackService {
 public:
  struct Options {
    // The caller's identity, or the status to refuse the call with (UNAUTHENTICATED,
    // UNAVAILABLE once draining). Required.
    std::function<absl::StatusOr<Identity>(const grpc::ServerContextBase&)> check_call;
    std::string dir;               // --training_dir; empty: jobs in memory, no checkpoints
    int64_t disk_limit_bytes = 0;  // --training_disk_limit_bytes
    int checkpoint_every = 100;    // --training_checkpoint_every
    int max_unfinished_jobs = 16;  // --training_max_jobs
    int64_t max_data_bytes = int64_t{1} << 30;  // --training_max_data_bytes, per job
    std::vector<TrainerOptions> workers = {TrainerOptions{}};
    std::function<bool()> serving_busy;
  };

  // Opens the store and resumes the unfinished jobs it holds. `registry` (metrics) may be null.
  static absl::StatusOr<std::unique_ptr<TrainingService>> Create(Options options,
                                                                 prometheus::Registry* registry);
  ~TrainingService() override;

  // Checkpoints running jobs and stops the scheduler, and ends watch streams with UNAVAILABLE
  // (their jobs resume after the restart). New calls get UNAVAILABLE. Idempotent.
  void Shutdown();

  grpc::ServerReadReactor<v1::SubmitTrainingJobRequest>* SubmitTrainingJob(
      grpc::CallbackServerContext* context, v1::TrainingJob* response) override;
  grpc::ServerUnaryReactor* GetTrainingJob(grpc::CallbackServerContext* context,
                                           const v1::GetTrainingJobRequest* request,
                                           v1::TrainingJob* response) override;
  grpc::ServerUnaryReactor* ListTrainingJobs(grpc::CallbackServerContext* context,
                                             const v1::ListTrainingJobsRequest* request,
                                             v1::ListTrainingJobsResponse* response) override;
  grpc::ServerWriteReactor<v1::TrainingJobEvent>* WatchTrainingJob(
      grpc::CallbackServerContext* context, const v1::WatchTrainingJobRequest* request) override;
  grpc::ServerUnaryReactor* CancelTrainingJob(grpc::CallbackServerContext* context,
                                              const v1::CancelTrainingJobRequest* request,
                                              v1::TrainingJob* response) override;
  grpc::ServerUnaryReactor* GetTrainingResult(grpc::CallbackServerContext* context,
                                              const v1::GetTrainingResultRequest* request,
                                              v1::TrainingResult* response) override;

 private:
  class SubmitReactor;
  class WatchReactor;
  friend class SubmitReactor;
  friend class WatchReactor;

  TrainingService(Options options, prometheus::Registry* registry);
  absl::Status Resume();
  // check_call, then UNAVAILABLE once shut down.
  absl::StatusOr<Identity> CheckCall(const grpc::ServerContextBase& context) const;
  absl::StatusOr<std::shared_ptr<Job>> FindJob(const grpc::ServerContextBase& context,
                                               const std::string& id) const;
  // Creates the job of a finished submission stream (FAILED with `problem` when it is not OK).
  std::shared_ptr<Job> CreateJob(const Identity& owner, const v1::TrainingJobSpec& wire,
                                 absl::Status problem, std::string inputs, std::string targets);

  const Options options_;
  TrainingMetrics metrics_;
  JobRegistry registry_;
  std::unique_ptr<CheckpointStore> store_;
  std::unique_ptr<TrainingScheduler> scheduler_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace attnserve::training
