#include "server/training/trainer.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attn/status_macros.h"

namespace attnserve::training {
namespace {

using attn::Engine;
using attn::EngineKind;

absl::StatusOr<std::unique_ptr<Engine>> Make(EngineKind kind, const TrainerOptions& options) {
  attn::EngineOptions engine_options;
  engine_options.device = options.device;
  engine_options.num_threads = options.cpu_threads;
  return attn::CreateEngine(kind, engine_options);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainingSpec& spec,
                                                         BatchSource* data,
                                                         const TrainerOptions& options) {
  ATTN_RETURN_IF_ERROR(ValidateSpec(spec));
  std::unique_ptr<Trainer> trainer(new Trainer(spec, data));
  ATTN_RETURN_IF_ERROR(trainer->Init(options));
  return trainer;
}

absl::Status Trainer::Init(const TrainerOptions& options_in) {
  TrainerOptions options = options_in;
  if (spec_.path == EnginePath::kCpu) options.space = attn::MemorySpace::kHost;
  if (options.space == attn::MemorySpace::kHost &&
      (spec_.path == EnginePath::kFused || spec_.path == EnginePath::kNaive)) {
    return absl::FailedPreconditionError(
        absl::StrCat("path: ", std::string(EnginePathName(spec_.path)),
                     " needs a CUDA device and this server trains on the CPU (use AUTO or CPU)"));
  }
  attn::layers::LayerOpsOptions ops_options;
  ops_options.device = options.device;
  ops_options.num_threads = options.cpu_threads;
  ATTN_ASSIGN_OR_RETURN(ops_, attn::layers::CreateLayerOps(options.space, ops_options));

  const attn::AttentionProblem problem =
      attn::layers::LayerProblem(spec_.layer, spec_.batch_size, spec_.seqlen);
  if (options.space == attn::MemorySpace::kHost) {
    ATTN_ASSIGN_OR_RETURN(forward_owned_, Make(EngineKind::kCpuTiled, options));
    forward_ = backward_ = forward_owned_.get();
  } else if (spec_.path == EnginePath::kNaive) {
    ATTN_ASSIGN_OR_RETURN(forward_owned_, Make(EngineKind::kCudaNaive, options));
    forward_ = backward_ = forward_owned_.get();
  } else {
    // The fused kernels where they apply; AUTO falls back per pass to the naive path (which
    // runs every dtype and head_dim), FUSED lets the fused engine's own refusal fail the job.
    ATTN_ASSIGN_OR_RETURN(forward_owned_, Make(EngineKind::kCudaFused, options));
    forward_ = backward_ = forward_owned_.get();
    if (spec_.path == EnginePath::kAuto && (!forward_owned_->SupportsForward(problem).ok() ||
                                            !forward_owned_->SupportsBackward(problem).ok())) {
      ATTN_ASSIGN_OR_RETURN(backward_owned_, Make(EngineKind::kCudaNaive, options));
      if (!forward_owned_->SupportsForward(problem).ok()) forward_ = backward_owned_.get();
      if (!forward_owned_->SupportsBackward(problem).ok()) backward_ = backward_owned_.get();
    }
  }

  attn::layers::LayerConfig layer = spec_.layer;
  layer.deterministic_backward = spec_.deterministic || options.deterministic_backward;
  ATTN_ASSIGN_OR_RETURN(layer_,
                        attn::layers::AttentionLayer::Create(layer, spec_.batch_size, spec_.seqlen,
                                                             ops_.get(), forward_, backward_));
  const int64_t tokens = layer_->tokens();
  if (data_->classification()) {
    ATTN_ASSIGN_OR_RETURN(
        std::unique_ptr<attn::layers::ClassificationObjective> c,
        attn::layers::ClassificationObjective::Create(ops_.get(), tokens, spec_.layer.model_dim,
                                                      data_->class_embeddings()));
    classification_ = c.get();
    objective_ = std::move(c);
  } else {
    ATTN_ASSIGN_OR_RETURN(
        std::unique_ptr<attn::layers::RegressionObjective> r,
        attn::layers::RegressionObjective::Create(ops_.get(), tokens, spec_.layer.model_dim));
    regression_ = r.get();
    objective_ = std::move(r);
  }
  attn::layers::OptimizerConfig optimizer = spec_.optimizer;
  optimizer.total_steps = spec_.steps;
  optimizer.dynamic_loss_scale = spec_.layer.dtype == attn::DType::kF16;
  ATTN_ASSIGN_OR_RETURN(optimizer_,
                        attn::layers::Optimizer::Create(optimizer, ops_.get(), layer_->params(),
                                                        layer_->num_weights()));
  const int64_t values = tokens * spec_.layer.model_dim;
  ATTN_ASSIGN_OR_RETURN(inputs_, ops_->Allocate(values * attn::DTypeSize(spec_.layer.dtype)));
  row_table_host_ = data_->row_table();
  if (row_table_host_ != nullptr) {
    const int64_t table_bytes = static_cast<int64_t>(row_table_host_->size()) * 4;
    ATTN_ASSIGN_OR_RETURN(row_table_, ops_->Allocate(table_bytes));
    ATTN_RETURN_IF_ERROR(ops_->Upload(row_table_.data(), row_table_host_->data(), table_bytes));
    ATTN_ASSIGN_OR_RETURN(row_ids_, ops_->Allocate(tokens * kRowsPerToken * 4));
  } else {
    ATTN_ASSIGN_OR_RETURN(inputs_f32_, ops_->Allocate(values * 4));
  }

  std::vector<float> weights = attn::layers::InitialWeights(spec_.layer, spec_.seed);
  for (const attn::layers::ParamSlot& slot : layer_->params()) {
    auto it = spec_.initial_weights.find(slot.name);
    if (it != spec_.initial_weights.end()) {
      std::copy(it->second.begin(), it->second.end(), weights.begin() + slot.offset);
    }
  }
  return ops_->Upload(layer_->weights(), weights.data(), layer_->num_weights() * 4);
}

absl::Status Trainer::Restore(const TrainerState& state) {
  if (static_cast<int64_t>(state.weights.size()) != layer_->num_weights()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint: ", state.weights.size(), " weights for a layer of ", layer_->num_weights()));
  }
  if (state.step < 0 || state.step > spec_.steps) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint: step ", state.step, " of ", spec_.steps));
  }
  ATTN_RETURN_IF_ERROR(
      ops_->Upload(layer_->weights(), state.weights.data(), layer_->num_weights() * 4));
  ATTN_RETURN_IF_ERROR(optimizer_->Restore(state.optimizer));
  step_ = state.step;
  return absl::OkStatus();
}

absl::StatusOr<TrainerState> Trainer::Save() const {
  TrainerState state;
  state.step = step_;
  state.weights.resize(layer_->num_weights());
  ATTN_RETURN_IF_ERROR(
      ops_->Download(state.weights.data(), layer_->weights(), layer_->num_weights() * 4));
  ATTN_ASSIGN_OR_RETURN(state.optimizer, optimizer_->Save());
  return state;
}

void Trainer::Prepare(int64_t step) {
  if (row_table_host_ != nullptr) {
    data_->FillRows(step, &rows_);
  } else {
    data_->Fill(step, &batch_);
  }
  prepared_step_ = step;
}

absl::StatusOr<StepStats> Trainer::Step() {
  StepStats stats;
  stats.step = step_ + 1;
  if (prepared_step_ != stats.step) Prepare(stats.step);
  const int64_t tokens = layer_->tokens();
  const int64_t values = tokens * spec_.layer.model_dim;
  const std::vector<int32_t>* labels = &batch_.labels;
  if (row_table_host_ != nullptr) {
    // 8 bytes a token cross to the device, not 4 * model_dim: the device sums the rows.
    ATTN_RETURN_IF_ERROR(
        ops_->Upload(row_ids_.data(), rows_.row_ids.data(), tokens * kRowsPerToken * 4));
    ATTN_RETURN_IF_ERROR(
        ops_->SumRows(row_table_.as<const float>(),
                      static_cast<int64_t>(row_table_host_->size()) / spec_.layer.model_dim,
                      spec_.layer.model_dim, row_ids_.as<const int32_t>(), kRowsPerToken, tokens,
                      inputs_.data(), spec_.layer.dtype));
    labels = &rows_.labels;
  } else {
    ATTN_RETURN_IF_ERROR(ops_->Upload(inputs_f32_.data(), batch_.inputs.data(), values * 4));
    ATTN_RETURN_IF_ERROR(ops_->Convert(inputs_f32_.data(), attn::DType::kF32, inputs_.data(),
                                       spec_.layer.dtype, values));
  }
  if (classification_ != nullptr) {
    ATTN_RETURN_IF_ERROR(classification_->SetLabels(labels->data()));
  } else {
    ATTN_RETURN_IF_ERROR(regression_->SetTargets(batch_.targets.data()));
  }

  ATTN_RETURN_IF_ERROR(layer_->Forward(inputs_.data()));
  stats.loss_scale = optimizer_->loss_scale();
  ATTN_ASSIGN_OR_RETURN(const attn::layers::ObjectiveValue value,
                        objective_->Evaluate(layer_->output(), stats.loss_scale));
  stats.loss = value.loss;
  stats.metric = value.metric;
  if (!std::isfinite(stats.loss)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "step %d: the loss is %s; training stopped (learning rate %g: try a smaller one)",
        stats.step, std::isnan(stats.loss) ? "NaN" : "infinite",
        attn::layers::LearningRateAt(spec_.optimizer, stats.step)));
  }
  ATTN_RETURN_IF_ERROR(layer_->Backward(objective_->d_out()));
  // The uploads above have been read (the loss came back after them), and a batch depends on
  // its step alone: draw the next one while the device runs the backward pass.
  if (stats.step < spec_.steps) Prepare(stats.step + 1);
  ATTN_ASSIGN_OR_RETURN(const attn::layers::UpdateOutcome update,
                        optimizer_->Apply(stats.step, layer_->weights(), layer_->gradients()));
  stats.learning_rate = update.learning_rate;
  stats.applied = update.applied;
  stats.grad_norm = update.grad_norm;
  step_ = stats.step;
  return stats;
}

absl::StatusOr<std::vector<std::pair<attn::layers::ParamSlot, std::vector<float>>>>
Trainer::Weights() const {
  std::vector<float> flat(layer_->num_weights());
  ATTN_RETURN_IF_ERROR(ops_->Download(flat.data(), layer_->weights(), flat.size() * 4));
  std::vector<std::pair<attn::layers::ParamSlot, std::vector<float>>> named;
  for (const attn::layers::ParamSlot& slot : layer_->params()) {
    named.emplace_back(slot, std::vector<float>(flat.begin() + slot.offset,
                                                flat.begin() + slot.offset + slot.size()));
  }
  return named;
}

}  // namespace attnserve::training
