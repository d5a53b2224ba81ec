#include "clients/cli/request_factory.h"

#include <random>

#include "proto/wire/request_decoder.h"

namespace attnserve::client {
namespace {

void FillTensor(v1::Tensor* t, attn::DType dtype, const std::vector<int64_t>& shape,
                std::mt19937_64& rng) {
  t->set_dtype(ToProtoDType(dtype));
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  std::string* data = t->mutable_data();
  data->resize(static_cast<size_t>(n * attn::DTypeSize(dtype)));
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (int64_t i = 0; i < n; ++i) attn::StoreFromFloat(data->data(), dtype, i, uniform(rng));
}

}  // namespace

v1::AttendRequest MakeRandomRequest(const ShapeSpec& s, uint64_t seed,
                                    const std::string& request_id) {
  std::mt19937_64 rng(seed);
  v1::AttendRequest r;
  r.set_request_id(request_id);
  r.set_causal(s.causal);
  r.set_return_lse(s.return_lse);
  r.set_path(s.path);
  if (!s.varlen) {
    FillTensor(r.mutable_q(), s.dtype, {s.batch, s.seqlen_q, s.num_heads, s.head_dim}, rng);
    FillTensor(r.mutable_k(), s.dtype, {s.batch, s.seqlen_k, s.num_kv_heads, s.head_dim}, rng);
    FillTensor(r.mutable_v(), s.dtype, {s.batch, s.seqlen_k, s.num_kv_heads, s.head_dim}, rng);
    return r;
  }
  r.add_cu_seqlens_q(0);
  r.add_cu_seqlens_k(0);
  for (int b = 0; b < s.batch; ++b) {
    const int64_t lq = std::uniform_int_distribution<int64_t>(1, s.seqlen_q)(rng);
    // Causal rows need at least as many keys as queries to see anything of their own.
    const int64_t lk_min = s.causal ? std::min(lq, s.seqlen_k) : 1;
    const int64_t lk = std::uniform_int_distribution<int64_t>(lk_min, s.seqlen_k)(rng);
    r.add_cu_seqlens_q(static_cast<int32_t>(r.cu_seqlens_q(b) + lq));
    r.add_cu_seqlens_k(static_cast<int32_t>(r.cu_seqlens_k(b) + lk));
  }
  const int64_t tq = r.cu_seqlens_q(s.batch), tk = r.cu_seqlens_k(s.batch);
  FillTensor(r.mutable_q(), s.dtype, {tq, s.num_heads, s.head_dim}, rng);
  FillTensor(r.mutable_k(), s.dtype, {tk, s.num_kv_heads, s.head_dim}, rng);
  FillTensor(r.mutable_v(), s.dtype, {tk, s.num_kv_heads, s.head_dim}, rng);
  return r;
}

v1::AttendBackwardRequest MakeRandomBackwardRequest(const ShapeSpec& spec, uint64_t seed,
                                                    const std::string& request_id) {
  v1::AttendBackwardRequest r;
  *r.mutable_forward() = MakeRandomRequest(spec, seed, request_id);
  r.mutable_forward()->set_return_lse(false);
  const v1::Tensor& q = r.forward().q();
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);  // independent of the forward's values
  FillTensor(r.mutable_d_o(), spec.dtype, {q.shape().begin(), q.shape().end()}, rng);
  return r;
}

}  // namespace attnserve::client
