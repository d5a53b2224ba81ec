// One multi-head attention layer, trainable: projections, attention through an attn::Engine
// (forward with the LSE, the recompute backward), output projection, optional residual and
// layer norm. For x [tokens, model_dim] (tokens = batch * seqlen):
//   q = x w_q, k = x w_k, v = x w_v        (stored in the compute dtype, [tokens, heads, d])
//   a = attention(q, k, v)                  (engine Forward; keeps O and the LSE)
//   s = a w_o  (+ x with residual)          (float32)
//   out = s, or LayerNorm(s) * gain + bias  (float32)
// Backward takes d out and fills the float32 gradients of every parameter (not of x: inputs are
// data). Master weights are float32; with a float16 / bfloat16 compute dtype each Forward first
// rounds the four matrices into a compute copy, and the GEMMs read compute-dtype operands and
// accumulate in float32.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/engine.h"
#include "attn/problem.h"
#include "layers/layer_ops.h"

namespace attn::layers {

struct LayerConfig {
  int model_dim = 64;
  int num_heads = 4;
  int num_kv_heads = 4;
  int head_dim = 16;
  bool causal = false;
  int window_left = -1;  // keys; negative = unbounded
  int window_right = -1;
  bool residual = false;
  bool layer_norm = false;
  DType dtype = DType::kF32;  // compute dtype
  float layer_norm_epsilon = 1e-5f;
  // The attention backward adds its partial sums in a fixed order (BackwardArgs::deterministic).
  bool deterministic_backward = false;
};

// Sizes the layer accepts beyond what attention itself validates.
inline constexpr int kMaxModelDim = 8192;

// The attention problem of `batch` sequences of `seqlen` tokens.
AttentionProblem LayerProblem(const LayerConfig& config, int batch, int seqlen);

// Names the first field that is wrong (model_dim, heads, head_dim, window, batch, seqlen).
absl::Status ValidateLayer(const LayerConfig& config, int batch, int seqlen);

// Where one parameter tensor lives in the flat parameter (and gradient) buffer.
struct ParamSlot {
  std::string name;  // w_q, w_k, w_v, w_o, ln_gain, ln_bias
  int64_t offset = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  bool decay = true;  // weight decay applies (the matrices, not the layer norm's gain and bias)
  int64_t size() const { return rows * cols; }
};

// The layer's parameters in order, and the flat buffer's size (slots start 64 floats apart).
std::vector<ParamSlot> LayerParams(const LayerConfig& config, int64_t* total = nullptr);

// The seeded initialisation: matrices N(0, 1 / fan_in), gain 1, bias 0, as a flat host vector.
std::vector<float> InitialWeights(const LayerConfig& config, uint64_t seed);

class AttentionLayer {
 public:
  // The engines are not owned and may be the same object; `forward_engine` runs Forward,
  // `backward_engine` Backward, both in ops' memory space.
  static absl::StatusOr<std::unique_ptr<AttentionLayer>> Create(const LayerConfig& config,
                                                                int batch, int seqlen,
                                                                LayerOps* ops,
                                                                Engine* forward_engine,
                                                                Engine* backward_engine);

  const LayerConfig& config() const { return config_; }
  int64_t tokens() const { return tokens_; }
  const std::vector<ParamSlot>& params() const { return params_; }
  int64_t num_weights() const { return num_weights_; }
  float* weights() const { return weights_.as<float>(); }
  float* gradients() const { return gradients_.as<float>(); }

  // x: [tokens, model_dim] in the compute dtype. Keeps what Backward needs.
  absl::Status Forward(const void* x);
  // out of the last Forward, [tokens, model_dim] float32.
  const float* output() const;
  // d_out: [tokens, model_dim] float32, for the last Forward. Overwrites gradients().
  absl::Status Backward(const float* d_out);

 private:
  AttentionLayer(const LayerConfig& config, int batch, int seqlen, LayerOps* ops,
                 Engine* forward_engine, Engine* backward_engine);
  absl::Status Allocate();
  // The compute-dtype copy of matrix `slot` (the master itself for float32).
  const void* Compute(int slot) const;

  const LayerConfig config_;
  const AttentionProblem problem_;
  const int64_t tokens_;
  LayerOps* const ops_;
  Engine* const forward_engine_;
  Engine* const backward_engine_;
  std::vector<ParamSlot> params_;
  int64_t num_weights_ = 0;
  const void* x_ = nullptr;  // the last Forward's input (the caller keeps it)

  Buffer weights_, gradients_;
  Buffer compute_weights_;  // the four matrices in the compute dtype (16-bit dtypes only)
  Buffer q_, k_, v_, o_, lse_;
  Buffer sum_;            // s, float32
  Buffer out_;            // LayerNorm(s) (layer_norm only; otherwise out is s)
  Buffer mean_, rstd_;    // layer norm statistics per token
  Buffer d_sum_;          // d s (layer_norm only; otherwise d out itself)
  Buffer d_sum_compute_;  // d s in the compute dtype (16-bit dtypes only)
  Buffer d_o_, d_q_, d_k_, d_v_;
};

}  // namespace attn::layers
