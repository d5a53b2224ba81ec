#include "server/training/training_spec.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"

namespace attnserve::training {

std::string_view TaskName(TaskKind kind) {
  return kind == TaskKind::kCopy ? "copy" : "associative_recall";
}

std::string_view EnginePathName(EnginePath path) {
  switch (path) {
    case EnginePath::kAuto:
      return "auto";
    case EnginePath::kFused:
      return "fused";
    case EnginePath::kNaive:
      return "naive";
    case EnginePath::kCpu:
      return "cpu";
  }
  return "auto";
}

absl::Status ValidateSpec(const TrainingSpec& spec) {
  if (spec.steps < 1 || spec.steps > kMaxSteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("steps: ", spec.steps, " (expected 1 to 2^40; a job trains at least once)"));
  }
  ATTN_RETURN_IF_ERROR(attn::layers::ValidateLayer(spec.layer, spec.batch_size, spec.seqlen));
  ATTN_RETURN_IF_ERROR(attn::layers::ValidateOptimizer(spec.optimizer));
  if (spec.checkpoint_every < 0) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint_every: ", spec.checkpoint_every));
  }
  if (spec.source == DataSource::kSynthetic) {
    const SyntheticTaskSpec& t = spec.synthetic;
    if (t.vocab_size < 2 || t.vocab_size > kMaxVocab) {
      return absl::InvalidArgumentError(absl::StrCat("data.synthetic.vocab_size: ", t.vocab_size,
                                                     " (expected 2 to ", kMaxVocab, ")"));
    }
    if (spec.seqlen < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "seqlen: ", spec.seqlen, " (a synthetic task needs at least one prompt and one answer)"));
    }
    if (t.kind == TaskKind::kAssociativeRecall && spec.seqlen / 2 > t.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data.synthetic.vocab_size: ", t.vocab_size, " keys cannot fill ", spec.seqlen / 2,
          " pairs with distinct keys (seqlen ", spec.seqlen, "); use vocab_size >= seqlen / 2"));
    }
  } else if (spec.upload.num_sequences < 1) {
    return absl::InvalidArgumentError("data.uploaded.inputs.shape: no sequences");
  }
  int64_t total = 0;
  for (const attn::layers::ParamSlot& slot : attn::layers::LayerParams(spec.layer, &total)) {
    auto it = spec.initial_weights.find(slot.name);
    if (it == spec.initial_weights.end()) continue;
    if (static_cast<int64_t>(it->second.size()) != slot.size()) {
      return absl::InvalidArgumentError(absl::StrCat("initial_weights[", slot.name,
                                                     "]: ", it->second.size(), " values for [",
                                                     slot.rows, ", ", slot.cols, "]"));
    }
  }
  for (const auto& [name, values] : spec.initial_weights) {
    bool known = false;
    for (const attn::layers::ParamSlot& slot : attn::layers::LayerParams(spec.layer)) {
      known = known || slot.name == name;
    }
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat(
          "initial_weights: '", name, "' is not a weight of this layer (w_q, w_k, w_v, w_o",
          spec.layer.layer_norm ? ", ln_gain, ln_bias)" : ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve::training
