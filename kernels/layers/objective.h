// What the layer's output is scored against: the loss, an evaluation metric, and d out for the
// backward pass.
//   Classification: logits = out E^T against fixed class embeddings E [classes, model_dim] (not
//   trained), softmax cross-entropy averaged over the scored tokens; metric: their accuracy.
//   Regression: mean squared error against float32 targets over every element; metric: its root.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layers/layer_ops.h"

namespace attn::layers {

struct ObjectiveValue {
  double loss = 0;    // mean
  double metric = 0;  // accuracy or root mean squared error
};

class Objective {
 public:
  virtual ~Objective() = default;
  virtual std::string_view metric_name() const = 0;
  // Scores out [tokens, model_dim] and writes d out = grad_scale * d loss / d out.
  virtual absl::StatusOr<ObjectiveValue> Evaluate(const float* out, float grad_scale) = 0;
  virtual const float* d_out() const = 0;
};

class ClassificationObjective final : public Objective {
 public:
  // class_embeddings: host, [classes, model_dim].
  static absl::StatusOr<std::unique_ptr<ClassificationObjective>> Create(
      LayerOps* ops, int64_t tokens, int model_dim, const std::vector<float>& class_embeddings);

  // One label per token (host): the class it must output, or -1 where it is not scored.
  absl::Status SetLabels(const int32_t* labels);

  std::string_view metric_name() const override { return "accuracy"; }
  absl::StatusOr<ObjectiveValue> Evaluate(const float* out, float grad_scale) override;
  const float* d_out() const override { return d_out_.as<const float>(); }

 private:
  ClassificationObjective(LayerOps* ops, int64_t tokens, int model_dim, int64_t classes)
      : ops_(ops), tokens_(tokens), model_dim_(model_dim), classes_(classes) {}

  LayerOps* const ops_;
  const int64_t tokens_;
  const int model_dim_;
  const int64_t classes_;
  int64_t scored_ = 0;
  Buffer embeddings_, labels_, logits_, d_logits_, d_out_;
};

class RegressionObjective final : public Objective {
 public:
  static absl::StatusOr<std::unique_ptr<RegressionObjective>> Create(LayerOps* ops, int64_t tokens,
                                                                     int model_dim);

  // Host, [tokens, model_dim] float32.
  absl::Status SetTargets(const float* targets);

  std::string_view metric_name() const override { return "rmse"; }
  absl::StatusOr<ObjectiveValue> Evaluate(const float* out, float grad_scale) override;
  const float* d_out() const override { return d_out_.as<const float>(); }

 private:
  RegressionObjective(LayerOps* ops, int64_t elements) : ops_(ops), elements_(elements) {}

  LayerOps* const ops_;
  const int64_t elements_;
  Buffer targets_, d_out_;
};

}  // namespace attn::layers
