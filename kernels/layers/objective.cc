#include "layers/objective.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"

namespace attn::layers {

absl::StatusOr<std::unique_ptr<ClassificationObjective>> ClassificationObjective::Create(
    LayerOps* ops, int64_t tokens, int model_dim, const std::vector<float>& class_embeddings) {
  if (model_dim < 1 || class_embeddings.empty() || class_embeddings.size() % model_dim != 0) {
    return absl::InvalidArgumentError(absl::StrCat("objective: ", class_embeddings.size(),
                                                   " embedding values for model_dim ", model_dim));
  }
  const int64_t classes = static_cast<int64_t>(class_embeddings.size()) / model_dim;
  std::unique_ptr<ClassificationObjective> o(
      new ClassificationObjective(ops, tokens, model_dim, classes));
  ATTN_ASSIGN_OR_RETURN(o->embeddings_, ops->Allocate(classes * model_dim * 4));
  ATTN_RETURN_IF_ERROR(
      ops->Upload(o->embeddings_.data(), class_embeddings.data(), classes * model_dim * 4));
  ATTN_ASSIGN_OR_RETURN(o->labels_, ops->Allocate(tokens * 4));
  ATTN_ASSIGN_OR_RETURN(o->logits_, ops->Allocate(tokens * classes * 4));
  ATTN_ASSIGN_OR_RETURN(o->d_logits_, ops->Allocate(tokens * classes * 4));
  ATTN_ASSIGN_OR_RETURN(o->d_out_, ops->Allocate(tokens * model_dim * 4));
  return o;
}

absl::Status ClassificationObjective::SetLabels(const int32_t* labels) {
  scored_ = 0;
  for (int64_t i = 0; i < tokens_; ++i) {
    if (labels[i] >= classes_) {
      return absl::InvalidArgumentError(absl::StrCat("objective: label ", labels[i], " of token ",
                                                     i, " (", classes_, " classes)"));
    }
    scored_ += labels[i] >= 0 ? 1 : 0;
  }
  return ops_->Upload(labels_.data(), labels, tokens_ * 4);
}

absl::StatusOr<ObjectiveValue> ClassificationObjective::Evaluate(const float* out,
                                                                 float grad_scale) {
  if (scored_ == 0) return absl::FailedPreconditionError("objective: no token is scored");
  const ConstMatrix embeddings{embeddings_.data(), DType::kF32, classes_, model_dim_};
  const Matrix logits{logits_.data(), DType::kF32, tokens_, classes_};
  ATTN_RETURN_IF_ERROR(ops_->Gemm(false, true, 1.f, {out, DType::kF32, tokens_, model_dim_},
                                  embeddings, 0.f, logits));
  ATTN_ASSIGN_OR_RETURN(
      const LossSums sums,
      ops_->SoftmaxCrossEntropy(logits_.as<float>(), labels_.as<int32_t>(), tokens_, classes_,
                                grad_scale / static_cast<float>(scored_), d_logits_.as<float>()));
  ATTN_RETURN_IF_ERROR(ops_->Gemm(false, false, 1.f,
                                  {d_logits_.data(), DType::kF32, tokens_, classes_}, embeddings,
                                  0.f, {d_out_.data(), DType::kF32, tokens_, model_dim_}));
  return ObjectiveValue{sums.loss / scored_, static_cast<double>(sums.correct) / scored_};
}

absl::StatusOr<std::unique_ptr<RegressionObjective>> RegressionObjective::Create(LayerOps* ops,
                                                                                 int64_t tokens,
                                                                                 int model_dim) {
  std::unique_ptr<RegressionObjective> o(new RegressionObjective(ops, tokens * model_dim));
  ATTN_ASSIGN_OR_RETURN(o->targets_, ops->Allocate(o->elements_ * 4));
  ATTN_ASSIGN_OR_RETURN(o->d_out_, ops->Allocate(o->elements_ * 4));
  return o;
}

absl::Status RegressionObjective::SetTargets(const float* targets) {
  return ops_->Upload(targets_.data(), targets, elements_ * 4);
}

absl::StatusOr<ObjectiveValue> RegressionObjective::Evaluate(const float* out, float grad_scale) {
  ATTN_ASSIGN_OR_RETURN(
      const LossSums sums,
      ops_->SquaredError(out, targets_.as<float>(), elements_,
                         grad_scale / static_cast<float>(elements_), d_out_.as<float>()));
  const double mse = sums.loss / elements_;
  return ObjectiveValue{mse, std::sqrt(mse)};
}

}  // namespace attn::layers
