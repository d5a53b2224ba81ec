#include "layers/attention_layer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"
#include "attn/tensor.h"
#include "layers/random.h"

namespace attn::layers {
namespace {

constexpr int64_t kSlotAlignment = 64;  // floats: every slot (and its 16-bit copy) 128-byte aligned

enum Slot { kWq = 0, kWk, kWv, kWo, kGain, kBias };

int64_t AlignUp(int64_t n) { return (n + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment; }

}  // namespace

AttentionProblem LayerProblem(const LayerConfig& c, int batch, int seqlen) {
  AttentionProblem p = DenseProblem(c.dtype, batch, seqlen, seqlen, c.num_heads, c.num_kv_heads,
                                    c.head_dim, c.causal);
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  return p;
}

absl::Status ValidateLayer(const LayerConfig& c, int batch, int seqlen) {
  if (c.model_dim < 1 || c.model_dim > kMaxModelDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.model_dim: ", c.model_dim, " (expected 1 to ", kMaxModelDim, ")"));
  }
  if (c.num_heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("model.num_heads: ", c.num_heads));
  }
  if (c.num_kv_heads < 1 || c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model.num_kv_heads: ", c.num_kv_heads,
                                                   " does not divide num_heads ", c.num_heads));
  }
  if (c.head_dim < 1 || c.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.head_dim: ", c.head_dim, " (expected 1 to ", kMaxHeadDim, ")"));
  }
  if (batch < 1) return absl::InvalidArgumentError(absl::StrCat("batch_size: ", batch));
  if (seqlen < 1) return absl::InvalidArgumentError(absl::StrCat("seqlen: ", seqlen));
  if (static_cast<int64_t>(batch) * seqlen > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size x seqlen: ", static_cast<int64_t>(batch) * seqlen,
                     " tokens per step (at most 2^30)"));
  }
  absl::Status problem = ValidateProblem(LayerProblem(c, batch, seqlen));
  if (!problem.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model: ", problem.message()));
  }
  return absl::OkStatus();
}

std::vector<ParamSlot> LayerParams(const LayerConfig& c, int64_t* total) {
  const int64_t d = c.model_dim, q = int64_t{c.num_heads} * c.head_dim,
                kv = int64_t{c.num_kv_heads} * c.head_dim;
  std::vector<ParamSlot> slots = {{"w_q", 0, d, q, true},
                                  {"w_k", 0, d, kv, true},
                                  {"w_v", 0, d, kv, true},
                                  {"w_o", 0, q, d, true}};
  if (c.layer_norm) {
    slots.push_back({"ln_gain", 0, 1, d, false});
    slots.push_back({"ln_bias", 0, 1, d, false});
  }
  int64_t offset = 0;
  for (ParamSlot& s : slots) {
    s.offset = offset;
    offset += AlignUp(s.size());
  }
  if (total != nullptr) *total = offset;
  return slots;
}

std::vector<float> InitialWeights(const LayerConfig& c, uint64_t seed) {
  int64_t total = 0;
  const std::vector<ParamSlot> slots = LayerParams(c, &total);
  std::vector<float> w(total, 0.f);
  for (size_t i = 0; i < slots.size(); ++i) {
    const ParamSlot& s = slots[i];
    Random random(seed, i);
    if (s.name == "ln_gain") {
      std::fill(w.begin() + s.offset, w.begin() + s.offset + s.size(), 1.f);
    } else if (s.name != "ln_bias") {
      const double std = 1.0 / std::sqrt(static_cast<double>(s.rows));  // rows = fan-in
      for (int64_t j = 0; j < s.size(); ++j) {
        w[s.offset + j] = static_cast<float>(std * random.Normal());
      }
    }
  }
  return w;
}

AttentionLayer::AttentionLayer(const LayerConfig& config, int batch, int seqlen, LayerOps* ops,
                               Engine* forward_engine, Engine* backward_engine)
    : config_(config),
      problem_(LayerProblem(config, batch, seqlen)),
      tokens_(static_cast<int64_t>(batch) * seqlen),
      ops_(ops),
      forward_engine_(forward_engine),
      backward_engine_(backward_engine) {
  params_ = LayerParams(config, &num_weights_);
}

absl::StatusOr<std::unique_ptr<AttentionLayer>> AttentionLayer::Create(const LayerConfig& config,
                                                                       int batch, int seqlen,
                                                                       LayerOps* ops,
                                                                       Engine* forward_engine,
                                                                       Engine* backward_engine) {
  ATTN_RETURN_IF_ERROR(ValidateLayer(config, batch, seqlen));
  for (const Engine* engine : {forward_engine, backward_engine}) {
    if (engine->memory_space() != ops->memory_space()) {
      return absl::InvalidArgumentError(absl::StrCat("layer: engine ", std::string(engine->name()),
                                                     " and ops ", std::string(ops->name()),
                                                     " use different memory"));
    }
  }
  std::unique_ptr<AttentionLayer> layer(
      new AttentionLayer(config, batch, seqlen, ops, forward_engine, backward_engine));
  ATTN_RETURN_IF_ERROR(layer->Allocate());
  return layer;
}

absl::Status AttentionLayer::Allocate() {
  const int64_t t = tokens_, d = config_.model_dim;
  const int64_t q = int64_t{config_.num_heads} * config_.head_dim;
  const int64_t kv = int64_t{config_.num_kv_heads} * config_.head_dim;
  const int64_t e = DTypeSize(config_.dtype);
  const bool low_precision = config_.dtype != DType::kF32;
  ATTN_ASSIGN_OR_RETURN(weights_, ops_->Allocate(num_weights_ * 4));
  ATTN_ASSIGN_OR_RETURN(gradients_, ops_->Allocate(num_weights_ * 4));
  if (low_precision) {
    ATTN_ASSIGN_OR_RETURN(compute_weights_, ops_->Allocate(params_[kWo].offset * e +
                                                           AlignUp(params_[kWo].size()) * e));
    ATTN_ASSIGN_OR_RETURN(d_sum_compute_, ops_->Allocate(t * d * e));
  }
  ATTN_ASSIGN_OR_RETURN(q_, ops_->Allocate(t * q * e));
  ATTN_ASSIGN_OR_RETURN(k_, ops_->Allocate(t * kv * e));
  ATTN_ASSIGN_OR_RETURN(v_, ops_->Allocate(t * kv * e));
  ATTN_ASSIGN_OR_RETURN(o_, ops_->Allocate(t * q * e));
  ATTN_ASSIGN_OR_RETURN(lse_, ops_->Allocate(t * config_.num_heads * 4));
  ATTN_ASSIGN_OR_RETURN(sum_, ops_->Allocate(t * d * 4));
  if (config_.layer_norm) {
    ATTN_ASSIGN_OR_RETURN(out_, ops_->Allocate(t * d * 4));
    ATTN_ASSIGN_OR_RETURN(mean_, ops_->Allocate(t * 4));
    ATTN_ASSIGN_OR_RETURN(rstd_, ops_->Allocate(t * 4));
    ATTN_ASSIGN_OR_RETURN(d_sum_, ops_->Allocate(t * d * 4));
  }
  ATTN_ASSIGN_OR_RETURN(d_o_, ops_->Allocate(t * q * e));
  ATTN_ASSIGN_OR_RETURN(d_q_, ops_->Allocate(t * q * e));
  ATTN_ASSIGN_OR_RETURN(d_k_, ops_->Allocate(t * kv * e));
  ATTN_ASSIGN_OR_RETURN(d_v_, ops_->Allocate(t * kv * e));
  return absl::OkStatus();
}

const void* AttentionLayer::Compute(int slot) const {
  if (config_.dtype == DType::kF32) return weights() + params_[slot].offset;
  return static_cast<const char*>(compute_weights_.data()) +
         params_[slot].offset * DTypeSize(config_.dtype);
}

const float* AttentionLayer::output() const {
  return config_.layer_norm ? out_.as<const float>() : sum_.as<const float>();
}

absl::Status AttentionLayer::Forward(const void* x) {
  const DType dt = config_.dtype;
  const int64_t t = tokens_, d = config_.model_dim;
  const int h = config_.num_heads, hkv = config_.num_kv_heads, hd = config_.head_dim;
  x_ = x;
  if (dt != DType::kF32) {
    // The four matrices are the first slots, so one conversion covers them (padding included).
    ATTN_RETURN_IF_ERROR(ops_->Convert(weights(), DType::kF32, compute_weights_.data(), dt,
                                       params_[kWo].offset + params_[kWo].size()));
  }
  const ConstMatrix xm{x, dt, t, d};
  auto weight = [&](int slot) {
    return ConstMatrix{Compute(slot), dt, params_[slot].rows, params_[slot].cols};
  };
  ATTN_RETURN_IF_ERROR(
      ops_->Gemm(false, false, 1.f, xm, weight(kWq), 0.f, {q_.data(), dt, t, int64_t{h} * hd}));
  ATTN_RETURN_IF_ERROR(
      ops_->Gemm(false, false, 1.f, xm, weight(kWk), 0.f, {k_.data(), dt, t, int64_t{hkv} * hd}));
  ATTN_RETURN_IF_ERROR(
      ops_->Gemm(false, false, 1.f, xm, weight(kWv), 0.f, {v_.data(), dt, t, int64_t{hkv} * hd}));

  ForwardArgs args;
  args.q = Packed<const void*>(q_.data(), h, hd);
  args.k = Packed<const void*>(k_.data(), hkv, hd);
  args.v = Packed<const void*>(v_.data(), hkv, hd);
  args.o = Packed<void*>(o_.data(), h, hd);
  args.lse = lse_.as<float>();
  args.stream = ops_->stream();
  ATTN_RETURN_IF_ERROR(forward_engine_->Forward(problem_, args));

  ATTN_RETURN_IF_ERROR(ops_->Gemm(false, false, 1.f, {o_.data(), dt, t, int64_t{h} * hd},
                                  weight(kWo), 0.f, {sum_.data(), DType::kF32, t, d}));
  if (config_.residual) ATTN_RETURN_IF_ERROR(ops_->AddTo(x, dt, sum_.as<float>(), t * d));
  if (config_.layer_norm) {
    ATTN_RETURN_IF_ERROR(ops_->LayerNormForward(
        sum_.as<float>(), weights() + params_[kGain].offset, weights() + params_[kBias].offset, t,
        d, config_.layer_norm_epsilon, out_.as<float>(), mean_.as<float>(), rstd_.as<float>()));
  }
  return absl::OkStatus();
}

absl::Status AttentionLayer::Backward(const float* d_out) {
  if (x_ == nullptr) return absl::FailedPreconditionError("layer: Backward before Forward");
  const DType dt = config_.dtype;
  const int64_t t = tokens_, d = config_.model_dim;
  const int h = config_.num_heads, hkv = config_.num_kv_heads, hd = config_.head_dim;
  float* grads = gradients();
  auto grad = [&](int slot) {
    return Matrix{grads + params_[slot].offset, DType::kF32, params_[slot].rows,
                  params_[slot].cols};
  };

  const float* d_sum = d_out;
  if (config_.layer_norm) {
    ATTN_RETURN_IF_ERROR(
        ops_->LayerNormBackward(d_out, sum_.as<float>(), weights() + params_[kGain].offset,
                                mean_.as<float>(), rstd_.as<float>(), t, d, d_sum_.as<float>(),
                                grads + params_[kGain].offset, grads + params_[kBias].offset));
    d_sum = d_sum_.as<float>();
  }
  const void* d_sum_compute = d_sum;
  if (dt != DType::kF32) {
    ATTN_RETURN_IF_ERROR(ops_->Convert(d_sum, DType::kF32, d_sum_compute_.data(), dt, t * d));
    d_sum_compute = d_sum_compute_.data();
  }
  const ConstMatrix ds{d_sum_compute, dt, t, d};
  // d w_o = a^T ds, d a = ds w_o^T.
  ATTN_RETURN_IF_ERROR(
      ops_->Gemm(true, false, 1.f, {o_.data(), dt, t, int64_t{h} * hd}, ds, 0.f, grad(kWo)));
  ATTN_RETURN_IF_ERROR(ops_->Gemm(false, true, 1.f, ds,
                                  {Compute(kWo), dt, params_[kWo].rows, params_[kWo].cols}, 0.f,
                                  {d_o_.data(), dt, t, int64_t{h} * hd}));

  BackwardArgs args;
  args.q = Packed<const void*>(q_.data(), h, hd);
  args.k = Packed<const void*>(k_.data(), hkv, hd);
  args.v = Packed<const void*>(v_.data(), hkv, hd);
  args.o = Packed<const void*>(o_.data(), h, hd);
  args.d_o = Packed<const void*>(d_o_.data(), h, hd);
  args.lse = lse_.as<const float>();
  args.dq = Packed<void*>(d_q_.data(), h, hd);
  args.dk = Packed<void*>(d_k_.data(), hkv, hd);
  args.dv = Packed<void*>(d_v_.data(), hkv, hd);
  args.stream = ops_->stream();
  args.deterministic = config_.deterministic_backward;
  ATTN_RETURN_IF_ERROR(backward_engine_->Backward(problem_, args));

  const ConstMatrix xm{x_, dt, t, d};
  ATTN_RETURN_IF_ERROR(
      ops_->Gemm(true, false, 1.f, xm, {d_q_.data(), dt, t, int64_t{h} * hd}, 0.f, grad(kWq)));
  ATTN_RETURN_IF_ERROR(
      ops_->Gemm(true, false, 1.f, xm, {d_k_.data(), dt, t, int64_t{hkv} * hd}, 0.f, grad(kWk)));
  ATTN_RETURN_IF_ERROR(
      ops_->Gemm(true, false, 1.f, xm, {d_v_.data(), dt, t, int64_t{hkv} * hd}, 0.f, grad(kWv)));
  return absl::OkStatus();
}

}  // namespace attn::layers
