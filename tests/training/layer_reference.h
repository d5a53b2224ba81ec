// A float64 reference of the trained layer and its loss, straight from the formulas of
// training.proto (materialised attention, two-pass layer norm), for finite differences: the
// gradients the library (and the server) compute must match the slopes of this function.
#pragma once

#include <cstdint>
#include <vector>

#include "layers/attention_layer.h"

namespace attnserve::training::testing {

struct ReferenceProblem {
  attn::layers::LayerConfig layer;
  int batch = 1;
  int seqlen = 1;
  std::vector<double> inputs;            // [tokens, model_dim]
  std::vector<int32_t> labels;           // classification: per token, -1 = not scored
  std::vector<double> class_embeddings;  // classification: [classes, model_dim]
  std::vector<double> targets;           // regression: [tokens, model_dim]
};

// The mean loss for flat weights laid out as attn::layers::LayerParams says.
double ReferenceLoss(const ReferenceProblem& problem, const std::vector<double>& weights);

// d loss / d weights[i] by central differences of step h, for every i in `indices`.
std::vector<double> FiniteDifferences(const ReferenceProblem& problem,
                                      const std::vector<double>& weights,
                                      const std::vector<int64_t>& indices, double h = 1e-5);

// Every parameter index of the layer, skipping the padding between slots.
std::vector<int64_t> ParameterIndices(const attn::layers::LayerConfig& layer);

}  // namespace attnserve::training::testing
