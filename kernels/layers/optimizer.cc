#include "layers/optimizer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"

namespace attn::layers {
namespace {

// torch.cuda.amp.GradScaler's defaults.
constexpr float kInitialLossScale = 65536.f;
constexpr int64_t kLossScaleGrowthInterval = 2000;
constexpr float kMaxLossScale = 16777216.f;  // 2^24

bool Finite(float x) { return std::isfinite(x); }

}  // namespace

absl::Status ValidateOptimizer(const OptimizerConfig& c) {
  if (!Finite(c.learning_rate) || c.learning_rate <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.learning_rate: ", c.learning_rate, " (must be > 0)"));
  }
  if (!Finite(c.min_learning_rate) || c.min_learning_rate < 0 ||
      c.min_learning_rate > c.learning_rate) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.min_learning_rate: ", c.min_learning_rate, " (0 to learning_rate)"));
  }
  if (c.warmup_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.warmup_steps: ", c.warmup_steps));
  }
  if (!(c.beta1 >= 0 && c.beta1 < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.beta1: ", c.beta1, " ([0, 1))"));
  }
  if (!(c.beta2 >= 0 && c.beta2 < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.beta2: ", c.beta2, " ([0, 1))"));
  }
  if (!Finite(c.epsilon) || c.epsilon <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.epsilon: ", c.epsilon));
  }
  if (!Finite(c.weight_decay) || c.weight_decay < 0) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.weight_decay: ", c.weight_decay));
  }
  if (!Finite(c.max_grad_norm) || c.max_grad_norm < 0) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.max_grad_norm: ", c.max_grad_norm));
  }
  return absl::OkStatus();
}

float LearningRateAt(const OptimizerConfig& c, int64_t step) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps) {
    return c.learning_rate * static_cast<float>(step) / static_cast<float>(c.warmup_steps);
  }
  if (c.schedule == Schedule::kConstant) return c.learning_rate;
  const int64_t span = std::max<int64_t>(c.total_steps - c.warmup_steps, 1);
  const double progress = std::clamp(static_cast<double>(step - c.warmup_steps) / span, 0.0, 1.0);
  const double fraction = c.schedule == Schedule::kCosine
                              ? 0.5 * (1.0 + std::cos(3.141592653589793 * progress))
                              : 1.0 - progress;
  return static_cast<float>(c.min_learning_rate +
                            (c.learning_rate - c.min_learning_rate) * fraction);
}

Optimizer::Optimizer(const OptimizerConfig& config, LayerOps* ops, std::vector<ParamSlot> params,
                     int64_t num_weights)
    : config_(config),
      ops_(ops),
      params_(std::move(params)),
      num_weights_(num_weights),
      loss_scale_(config.dynamic_loss_scale ? kInitialLossScale : 1.f) {}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(const OptimizerConfig& config,
                                                             LayerOps* ops,
                                                             const std::vector<ParamSlot>& params,
                                                             int64_t num_weights) {
  ATTN_RETURN_IF_ERROR(ValidateOptimizer(config));
  std::unique_ptr<Optimizer> o(new Optimizer(config, ops, params, num_weights));
  if (config.kind == OptimizerKind::kAdamW) {
    ATTN_ASSIGN_OR_RETURN(o->m_, ops->Allocate(num_weights * 4));
    ATTN_ASSIGN_OR_RETURN(o->v_, ops->Allocate(num_weights * 4));
  }
  return o;
}

absl::StatusOr<UpdateOutcome> Optimizer::Apply(int64_t step, float* weights,
                                               const float* gradients) {
  UpdateOutcome outcome;
  outcome.learning_rate = LearningRateAt(config_, step);
  // The padding between slots holds zeros in both buffers, so one reduction covers them all.
  ATTN_ASSIGN_OR_RETURN(const double sum_sq, ops_->SumOfSquares(gradients, num_weights_));
  if (!std::isfinite(sum_sq)) {
    if (!config_.dynamic_loss_scale) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", step, ": the gradient is not finite; training stopped"));
    }
    if (loss_scale_ <= 1.f) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", step,
                       ": the gradient overflows float16 even at loss scale 1; training stopped"));
    }
    outcome.applied = false;
    loss_scale_ = std::max(loss_scale_ / 2.f, 1.f);
    clean_steps_ = 0;
    return outcome;
  }
  outcome.grad_norm = std::sqrt(sum_sq) / loss_scale_;
  float clip = 1.f;
  if (config_.max_grad_norm > 0 && outcome.grad_norm > config_.max_grad_norm) {
    clip = static_cast<float>(config_.max_grad_norm / (outcome.grad_norm + 1e-6));
  }
  ++updates_;
  UpdateStep s;
  s.learning_rate = outcome.learning_rate;
  s.beta1 = config_.beta1;
  s.beta2 = config_.beta2;
  s.epsilon = config_.epsilon;
  s.bias_correction1 = 1.f - static_cast<float>(std::pow(config_.beta1, updates_));
  s.bias_correction2 = 1.f - static_cast<float>(std::pow(config_.beta2, updates_));
  s.grad_scale = clip / loss_scale_;
  for (const ParamSlot& slot : params_) {
    s.weight_decay = slot.decay ? config_.weight_decay : 0.f;
    float* w = weights + slot.offset;
    const float* g = gradients + slot.offset;
    if (config_.kind == OptimizerKind::kAdamW) {
      ATTN_RETURN_IF_ERROR(ops_->AdamW(s, slot.size(), w, g, m_.as<float>() + slot.offset,
                                       v_.as<float>() + slot.offset));
    } else {
      ATTN_RETURN_IF_ERROR(ops_->Sgd(s, slot.size(), w, g));
    }
  }
  if (config_.dynamic_loss_scale && ++clean_steps_ >= kLossScaleGrowthInterval) {
    loss_scale_ = std::min(loss_scale_ * 2.f, kMaxLossScale);
    clean_steps_ = 0;
  }
  return outcome;
}

absl::StatusOr<OptimizerState> Optimizer::Save() const {
  OptimizerState state;
  state.updates = updates_;
  state.loss_scale = loss_scale_;
  state.clean_steps = clean_steps_;
  if (config_.kind == OptimizerKind::kAdamW) {
    state.m.resize(num_weights_);
    state.v.resize(num_weights_);
    ATTN_RETURN_IF_ERROR(ops_->Download(state.m.data(), m_.data(), num_weights_ * 4));
    ATTN_RETURN_IF_ERROR(ops_->Download(state.v.data(), v_.data(), num_weights_ * 4));
  }
  return state;
}

absl::Status Optimizer::Restore(const OptimizerState& state) {
  if (config_.kind == OptimizerKind::kAdamW) {
    if (static_cast<int64_t>(state.m.size()) != num_weights_ ||
        static_cast<int64_t>(state.v.size()) != num_weights_) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state: ", state.m.size(), " and ",
                                                     state.v.size(), " moments for ", num_weights_,
                                                     " weights"));
    }
    ATTN_RETURN_IF_ERROR(ops_->Upload(m_.data(), state.m.data(), num_weights_ * 4));
    ATTN_RETURN_IF_ERROR(ops_->Upload(v_.data(), state.v.data(), num_weights_ * 4));
  }
  updates_ = state.updates;
  loss_scale_ = config_.dynamic_loss_scale ? state.loss_scale : 1.f;
  clean_steps_ = state.clean_steps;
  return absl::OkStatus();
}

}  // namespace attn::layers
