// One job's training run, gRPC-free: the layer on its engines and ops, the objective, the
// optimiser and the batch source, advanced one step at a time. The scheduler calls Step between
// its checks (cancel, shutdown, serving traffic) and Save for checkpoints.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/engine.h"
#include "layers/attention_layer.h"
#include "layers/layer_ops.h"
#include "layers/objective.h"
#include "layers/optimizer.h"
#include "server/training/batch_source.h"
#include "server/training/training_spec.h"

namespace attnserve::training {

struct TrainerOptions {
  // kDevice: CUDA engines and ops on `device`; kHost: the CPU tiled engine and CPU ops.
  attn::MemorySpace space = attn::MemorySpace::kHost;
  int device = 0;
  int cpu_threads = 1;
  // Every job's backward passes run deterministic, whatever its spec says.
  bool deterministic_backward = false;
};

// Everything a checkpoint needs to continue the run exactly.
struct TrainerState {
  int64_t step = 0;            // steps done
  std::vector<float> weights;  // flat, as attn::layers::LayerParams lays them out
  attn::layers::OptimizerState optimizer;
};

struct StepStats {
  int64_t step = 0;
  double loss = 0;
  double metric = 0;
  float learning_rate = 0;
  float loss_scale = 1;  // the scale this step's backward pass ran with
  bool applied = true;   // false: a float16 overflow skipped the update
  double grad_norm = 0;
};

class Trainer {
 public:
  // `data` outlives the trainer.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const TrainingSpec& spec,
                                                         BatchSource* data,
                                                         const TrainerOptions& options);

  // Continue from a checkpoint instead of step 0.
  absl::Status Restore(const TrainerState& state);
  absl::StatusOr<TrainerState> Save() const;

  // Runs step step() + 1. INVALID_ARGUMENT naming the step when the loss or the gradients stop
  // being finite.
  absl::StatusOr<StepStats> Step();

  int64_t step() const { return step_; }
  int64_t tokens_per_step() const { return layer_->tokens(); }
  std::string_view metric_name() const { return objective_->metric_name(); }
  std::string_view forward_engine() const { return forward_->name(); }
  std::string_view backward_engine() const { return backward_->name(); }
  bool deterministic() const { return layer_->config().deterministic_backward; }

  // The named parameter tensors (host float32), at the current step.
  absl::StatusOr<std::vector<std::pair<attn::layers::ParamSlot, std::vector<float>>>> Weights()
      const;

 private:
  Trainer(const TrainingSpec& spec, BatchSource* data) : spec_(spec), data_(data) {}
  absl::Status Init(const TrainerOptions& options);

  const TrainingSpec spec_;
  BatchSource* const data_;
  std::unique_ptr<attn::layers::LayerOps> ops_;
  std::unique_ptr<attn::Engine> forward_owned_, backward_owned_;
  attn::Engine* forward_ = nullptr;
  attn::Engine* backward_ = nullptr;
  std::unique_ptr<attn::layers::AttentionLayer> layer_;
  std::unique_ptr<attn::layers::Objective> objective_;
  attn::layers::ClassificationObjective* classification_ = nullptr;
  attn::layers::RegressionObjective* regression_ = nullptr;
  std::unique_ptr<attn::layers::Optimizer> optimizer_;
  // Fills the host batch of `step` (a row batch where the source has a row table).
  void Prepare(int64_t step);

  attn::layers::Buffer inputs_;  // the batch's inputs in the compute dtype
  // Sources with a row table (the synthetic tasks): the table on the device and each step's row
  // ids, from which the device sums the inputs; the others upload float32 inputs to inputs_f32_.
  const std::vector<float>* row_table_host_ = nullptr;
  attn::layers::Buffer row_table_, row_ids_;
  attn::layers::Buffer inputs_f32_;
  HostBatch batch_;
  RowBatch rows_;
  // The step whose batch batch_ / rows_ hold (0: none). Step fills the next step's while the
  // device runs the backward pass.
  int64_t prepared_step_ = 0;
  int64_t step_ = 0;
};

}  // namespace attnserve::training
