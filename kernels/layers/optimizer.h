// The optimiser of a layer's flat float32 parameters: AdamW (decoupled weight decay) or SGD,
// with a learning-rate schedule, global gradient-norm clipping and, for float16 compute, a
// dynamic loss scale (the loss is multiplied by it before the backward pass so that small
// gradients survive float16; a step whose gradients overflow is skipped and the scale halved,
// and it doubles after every 2000 clean steps, as torch.cuda.amp.GradScaler does).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layers/attention_layer.h"
#include "layers/layer_ops.h"

namespace attn::layers {

enum class OptimizerKind : uint8_t { kAdamW, kSgd };
enum class Schedule : uint8_t { kConstant, kCosine, kLinear };

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float learning_rate = 1e-3f;
  Schedule schedule = Schedule::kConstant;
  int64_t warmup_steps = 0;
  float min_learning_rate = 0;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float weight_decay = 0;
  float max_grad_norm = 0;  // 0: no clipping
  int64_t total_steps = 1;
  bool dynamic_loss_scale = false;
};

// Names the first field that is wrong.
absl::Status ValidateOptimizer(const OptimizerConfig& config);

// The learning rate of step `step` (1-based) of config.total_steps.
float LearningRateAt(const OptimizerConfig& config, int64_t step);

// What a checkpoint keeps besides the weights.
struct OptimizerState {
  int64_t updates = 0;  // applied updates (Adam's t)
  float loss_scale = 1;
  int64_t clean_steps = 0;  // since the loss scale last changed
  std::vector<float> m, v;  // AdamW moments, flat like the weights (empty for SGD)
};

struct UpdateOutcome {
  bool applied = true;   // false: float16 overflow, skipped
  double grad_norm = 0;  // of the unscaled gradients, before clipping
  float learning_rate = 0;
};

class Optimizer {
 public:
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(const OptimizerConfig& config,
                                                           LayerOps* ops,
                                                           const std::vector<ParamSlot>& params,
                                                           int64_t num_weights);

  // The factor the loss (and so every gradient) carries in the coming backward pass.
  float loss_scale() const { return loss_scale_; }

  // Step `step` (1-based): gradients are the layer's, carrying loss_scale(). INVALID_ARGUMENT
  // when they are not finite and no loss scale is in use, or still overflow at loss scale 1.
  absl::StatusOr<UpdateOutcome> Apply(int64_t step, float* weights, const float* gradients);

  absl::StatusOr<OptimizerState> Save() const;
  absl::Status Restore(const OptimizerState& state);

 private:
  Optimizer(const OptimizerConfig& config, LayerOps* ops, std::vector<ParamSlot> params,
            int64_t num_weights);

  const OptimizerConfig config_;
  LayerOps* const ops_;
  const std::vector<ParamSlot> params_;
  const int64_t num_weights_;
  Buffer m_, v_;
  int64_t updates_ = 0;
  float loss_scale_ = 1;
  int64_t clean_steps_ = 0;
};

}  // namespace attn::layers
