// libFuzzer target: arbitrary bytes into the AttendRequest decoder/validator. Half the inputs
// are parsed as a serialized request (the wire path); the other half build a request field by
// field, which reaches the shape and cu_seqlens checks far more often than random protobuf does.
// Every accepted request then also goes through the AttendBackward decoder with fuzzed d_o, o
// and lse. Whatever a decoder accepts must describe exactly the bytes it was given.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>

#include "attnserve/v1/attention.pb.h"
#include "server/request_decoder.h"

namespace {

void FillTensor(FuzzedDataProvider& in, attnserve::v1::Tensor* t) {
  t->set_dtype(static_cast<attnserve::v1::DType>(in.ConsumeIntegralInRange<int>(0, 4)));
  const int rank = in.ConsumeIntegralInRange<int>(0, 5);
  int64_t elements = 1;
  for (int i = 0; i < rank; ++i) {
    const int64_t d = in.ConsumeIntegralInRange<int64_t>(-2, 40);
    t->add_shape(d);
    elements *= d > 0 ? d : 1;
  }
  // Usually the right length for float32/16, sometimes off by a little.
  const int64_t size =
      elements * (in.ConsumeBool() ? 4 : 2) + in.ConsumeIntegralInRange<int>(-1, 1);
  if (size > 0 && size < (1 << 20)) t->mutable_data()->resize(static_cast<size_t>(size), '\x3c');
}

// The backward decoder on an accepted forward request: d_o usually like q, o/lse sometimes.
void CheckBackward(const attnserve::v1::AttendRequest& forward,
                   const attnserve::DecodeLimits& limits, const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  attnserve::v1::AttendBackwardRequest r;
  *r.mutable_forward() = forward;
  if (in.ConsumeBool()) {
    *r.mutable_d_o() = forward.q();
  } else {
    FillTensor(in, r.mutable_d_o());
  }
  if (in.ConsumeBool()) *r.mutable_o() = forward.q();
  if (in.ConsumeBool()) FillTensor(in, r.mutable_lse());
  const auto decoded = attnserve::DecodeAttendBackwardRequest(r, limits);
  if (!decoded.ok()) return;
  const attn::AttentionProblem& p = decoded->problem;
  const int64_t q_bytes = p.total_q() * p.num_heads * p.head_dim * attn::DTypeSize(p.dtype);
  const int64_t lse_bytes = p.total_q() * p.num_heads * 4;
  const bool with_forward = decoded->o != nullptr;
  if (q_bytes != static_cast<int64_t>(r.d_o().data().size()) ||
      with_forward != (decoded->lse != nullptr) ||
      (with_forward && (q_bytes != static_cast<int64_t>(r.o().data().size()) ||
                        lse_bytes != static_cast<int64_t>(r.lse().data().size()))) ||
      attnserve::BackwardWorkingSetBytes(p) > limits.memory_limit_bytes) {
    std::abort();  // accepted a backward request whose tensors do not match its problem
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  attnserve::v1::AttendRequest request;
  if (data[0] & 1) {
    if (!request.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  } else {
    FuzzedDataProvider in(data + 1, size - 1);
    FillTensor(in, request.mutable_q());
    FillTensor(in, request.mutable_k());
    if (in.ConsumeBool()) {
      *request.mutable_v() = request.k();
    } else {
      FillTensor(in, request.mutable_v());
    }
    const int n = in.ConsumeIntegralInRange<int>(0, 6);
    for (int i = 0; i < n; ++i) request.add_cu_seqlens_q(in.ConsumeIntegralInRange<int>(-1, 64));
    const int m = in.ConsumeIntegralInRange<int>(0, 6);
    for (int i = 0; i < m; ++i) request.add_cu_seqlens_k(in.ConsumeIntegralInRange<int>(-1, 64));
    request.set_causal(in.ConsumeBool());
    if (in.ConsumeBool()) request.set_window_left(in.ConsumeIntegralInRange<int>(-3, 50));
    if (in.ConsumeBool()) request.set_window_right(in.ConsumeIntegralInRange<int>(-3, 50));
    request.set_softmax_scale(in.ConsumeFloatingPoint<float>());
    request.set_path(static_cast<attnserve::v1::Path>(in.ConsumeIntegralInRange<int>(-1, 5)));
  }
  attnserve::DecodeLimits limits;
  limits.memory_limit_bytes = int64_t{64} << 20;
  const auto decoded = attnserve::DecodeAttendRequest(request, limits);
  if (!decoded.ok()) return 0;
  CheckBackward(request, limits, data, size);
  const attn::AttentionProblem& p = decoded->problem;
  const int64_t es = attn::DTypeSize(p.dtype);
  const int64_t q_bytes = p.total_q() * p.num_heads * p.head_dim * es;
  const int64_t kv_bytes = p.total_k() * p.num_kv_heads * p.head_dim * es;
  if (q_bytes != static_cast<int64_t>(request.q().data().size()) ||
      kv_bytes != static_cast<int64_t>(request.k().data().size()) ||
      kv_bytes != static_cast<int64_t>(request.v().data().size()) ||
      attnserve::WorkingSetBytes(p) > limits.memory_limit_bytes || !attn::ValidateProblem(p).ok()) {
    std::abort();  // accepted a request whose tensors do not match its problem
  }
  return 0;
}
