// One training job as the server keeps it: what was submitted (fixed) and where it stands (under
// the registry's lock). The registry (job_registry.h) owns jobs; the scheduler runs them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "attnserve/v1/training.pb.h"
#include "server/identity.h"
#include "server/training/batch_source.h"
#include "server/training/trainer.h"
#include "server/training/training_spec.h"

namespace attnserve::training {

enum class JobState : uint8_t { kQueued, kRunning, kSucceeded, kFailed, kCancelled };

inline bool Finished(JobState s) { return s >= JobState::kSucceeded; }
std::string_view JobStateName(JobState state);  // "queued", "running", ...

struct Progress {
  int64_t step = 0;
  int64_t total_steps = 0;
  double loss = 0;
  double metric = 0;
  std::string metric_name;
  double tokens_per_second = 0;
  double eta_seconds = 0;
  float learning_rate = 0;
  float loss_scale = 1;
};

// The loss curve: every step up to kMaxPoints, then every other point dropped each time it fills
// (stride doubles), so it spans the whole run in bounded memory.
struct Curve {
  static constexpr size_t kMaxPoints = 100000;
  std::vector<int64_t> steps;
  std::vector<float> loss, metric;
  int64_t stride = 1;

  void Add(int64_t step, float step_loss, float step_metric);
};

struct Job {
  // Fixed at submission.
  std::string id;
  Identity owner;
  TrainingSpec spec;
  v1::TrainingJobSpec wire_spec;  // as submitted, less the uploaded tensors' bytes
  bool spec_valid = false;        // `spec` came from wire_spec (false: FAILED at submission)
  bool uploaded = false;          // inputs.bin / targets.bin hold its data

  // Guarded by JobRegistry::mu_.
  JobState state = JobState::kQueued;
  std::string error;
  absl::Time created, started, ended;  // InfinitePast until they happen
  Progress progress;
  Curve curve;
  int64_t resumed_from_step = 0;
  int64_t checkpoint_step = 0;
  std::string forward_engine, backward_engine;
  bool deterministic = false;  // the current (or last) run's backward passes
  bool cancel_requested = false;
  // Where a run continues from (a checkpoint), and then where it ended (the final weights).
  std::optional<TrainerState> state_on_disk;
  std::optional<TrainerState> final_state;
  // Uploaded data in memory until the job ends (read back from disk after a restart).
  std::shared_ptr<UploadedDataset> data;
  uint64_t version = 0;  // bumped on every change, for watchers
  absl::Time last_notified = absl::InfinitePast();
};

}  // namespace attnserve::training
