#include "common/host_tensor.h"

#include <cstdlib>
#include <cstring>
#include <random>

namespace attn::testing {

uint64_t FreshSeed() {
  if (const char* env = std::getenv("ATTN_TEST_SEED"); env != nullptr && *env != '\0') {
    return std::strtoull(env, nullptr, 0);
  }
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

HostTensor::HostTensor(DType dtype, int64_t tokens, int heads, int head_dim)
    : HostTensor(dtype, tokens, heads, head_dim, 0, 0) {}

HostTensor::HostTensor(DType dtype, int64_t tokens, int heads, int head_dim, int head_pad,
                       int token_pad)
    : dtype_(dtype),
      tokens_(tokens),
      heads_(heads),
      head_dim_(head_dim),
      head_stride_(head_dim + head_pad),
      token_stride_(static_cast<int64_t>(heads) * (head_dim + head_pad) + token_pad),
      bytes_(static_cast<size_t>(tokens * token_stride_ * DTypeSize(dtype))) {}

TensorRef HostTensor::ref() const {
  return {tokens_ > 0 ? data() : nullptr, token_stride_, head_stride_};
}

MutableTensorRef HostTensor::mutable_ref() {
  return {tokens_ > 0 ? data() : nullptr, token_stride_, head_stride_};
}

float HostTensor::Get(int64_t token, int head, int c) const {
  return LoadAsFloat(data(), dtype_, ElementIndex(token, head, c));
}

void HostTensor::Set(int64_t token, int head, int c, float v) {
  StoreFromFloat(data(), dtype_, ElementIndex(token, head, c), v);
}

void HostTensor::FillRandom(uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, stddev);
  for (int64_t t = 0; t < tokens_; ++t) {
    for (int h = 0; h < heads_; ++h) {
      for (int c = 0; c < head_dim_; ++c) Set(t, h, c, normal(rng));
    }
  }
}

void HostTensor::Poison() {
  const int64_t n = static_cast<int64_t>(bytes_.size()) / DTypeSize(dtype_);
  for (int64_t i = 0; i < n; ++i) {
    if (dtype_ == DType::kF32) {
      std::memcpy(&bytes_[i * 4], &kPoisonF32, 4);
    } else {
      const uint16_t pattern = dtype_ == DType::kF16 ? kPoisonF16 : kPoisonBF16;
      std::memcpy(&bytes_[i * 2], &pattern, 2);
    }
  }
}

bool HostTensor::IsPoison(int64_t element) const {
  if (dtype_ == DType::kF32) {
    uint32_t u;
    std::memcpy(&u, &bytes_[element * 4], 4);
    return u == kPoisonF32;
  }
  uint16_t u;
  std::memcpy(&u, &bytes_[element * 2], 2);
  return u == (dtype_ == DType::kF16 ? kPoisonF16 : kPoisonBF16);
}

int64_t HostTensor::CountPoisoned() const {
  int64_t n = 0;
  for (int64_t t = 0; t < tokens_; ++t) {
    for (int h = 0; h < heads_; ++h) {
      for (int c = 0; c < head_dim_; ++c) n += IsPoison(ElementIndex(t, h, c));
    }
  }
  return n;
}

int64_t HostTensor::CountPaddingWritten() const {
  const int64_t total = static_cast<int64_t>(bytes_.size()) / DTypeSize(dtype_);
  int64_t poisoned_total = 0;
  for (int64_t i = 0; i < total; ++i) poisoned_total += IsPoison(i);
  const int64_t padding = total - num_elements();
  return padding - (poisoned_total - CountPoisoned());
}

std::vector<double> HostTensor::ToDouble() const {
  std::vector<double> out(static_cast<size_t>(num_elements()));
  size_t i = 0;
  for (int64_t t = 0; t < tokens_; ++t) {
    for (int h = 0; h < heads_; ++h) {
      for (int c = 0; c < head_dim_; ++c) out[i++] = Get(t, h, c);
    }
  }
  return out;
}

HostTensor HostTensor::ConvertTo(DType dtype) const {
  HostTensor out(dtype, tokens_, heads_, head_dim_);
  for (int64_t t = 0; t < tokens_; ++t) {
    for (int h = 0; h < heads_; ++h) {
      for (int c = 0; c < head_dim_; ++c) out.Set(t, h, c, Get(t, h, c));
    }
  }
  return out;
}

void PoisonFloats(std::vector<float>& v) {
  for (float& x : v) std::memcpy(&x, &kPoisonF32, 4);
}

int64_t CountPoisonedFloats(const std::vector<float>& v) {
  int64_t n = 0;
  for (const float& x : v) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    n += u == kPoisonF32;
  }
  return n;
}

AttentionTensors AttentionTensors::Make(const AttentionProblem& p, uint64_t seed, bool padded) {
  const int hp = padded ? 3 : 0, tp = padded ? 5 : 0;
  const int d = p.head_dim;
  const int64_t tq = p.total_q(), tk = p.total_k();
  AttentionTensors t;
  t.q = HostTensor(p.dtype, tq, p.num_heads, d, hp, tp);
  t.k = HostTensor(p.dtype, tk, p.num_kv_heads, d, hp, tp);
  t.v = HostTensor(p.dtype, tk, p.num_kv_heads, d, hp, tp);
  t.o = HostTensor(p.dtype, tq, p.num_heads, d, hp, tp);
  t.d_o = HostTensor(p.dtype, tq, p.num_heads, d, hp, tp);
  t.dq = HostTensor(p.dtype, tq, p.num_heads, d, hp, tp);
  t.dk = HostTensor(p.dtype, tk, p.num_kv_heads, d, hp, tp);
  t.dv = HostTensor(p.dtype, tk, p.num_kv_heads, d, hp, tp);
  t.lse.assign(static_cast<size_t>(tq * p.num_heads), 0.f);
  t.q.FillRandom(seed);
  t.k.FillRandom(seed + 1);
  t.v.FillRandom(seed + 2);
  t.d_o.FillRandom(seed + 3);
  return t;
}

void AttentionTensors::PoisonOutputs() {
  o.Poison();
  dq.Poison();
  dk.Poison();
  dv.Poison();
  PoisonFloats(lse);
}

ForwardArgs AttentionTensors::forward_args() {
  ForwardArgs a;
  a.q = q.ref();
  a.k = k.ref();
  a.v = v.ref();
  a.o = o.mutable_ref();
  a.lse = lse.empty() ? nullptr : lse.data();
  return a;
}

BackwardArgs AttentionTensors::backward_args() {
  BackwardArgs a;
  a.q = q.ref();
  a.k = k.ref();
  a.v = v.ref();
  a.o = o.ref();
  a.d_o = d_o.ref();
  a.lse = lse.empty() ? nullptr : lse.data();
  a.dq = dq.mutable_ref();
  a.dk = dk.mutable_ref();
  a.dv = dv.mutable_ref();
  return a;
}

}  // namespace attn::testing
