#include "common/reference.h"

#include "attn/engine.h"
#include "attn/status_macros.h"

namespace attn::testing {

absl::StatusOr<ReferenceResults> RunReference(const AttentionProblem& p, const AttentionTensors& t,
                                              bool backward) {
  AttentionProblem p32 = p;
  p32.dtype = DType::kF32;
  AttentionTensors t32;
  t32.q = t.q.ConvertTo(DType::kF32);
  t32.k = t.k.ConvertTo(DType::kF32);
  t32.v = t.v.ConvertTo(DType::kF32);
  t32.d_o = t.d_o.ConvertTo(DType::kF32);
  t32.o = HostTensor(DType::kF32, p.total_q(), p.num_heads, p.head_dim);
  t32.dq = HostTensor(DType::kF32, p.total_q(), p.num_heads, p.head_dim);
  t32.dk = HostTensor(DType::kF32, p.total_k(), p.num_kv_heads, p.head_dim);
  t32.dv = HostTensor(DType::kF32, p.total_k(), p.num_kv_heads, p.head_dim);
  t32.lse.assign(static_cast<size_t>(p.total_q() * p.num_heads), 0.f);

  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, CreateEngine(EngineKind::kCpuReference));
  ATTN_RETURN_IF_ERROR(engine->Forward(p32, t32.forward_args()));
  ReferenceResults r;
  r.o = t32.o.ToDouble();
  r.lse.assign(t32.lse.begin(), t32.lse.end());
  if (backward) {
    ATTN_RETURN_IF_ERROR(engine->Backward(p32, t32.backward_args()));
    r.dq = t32.dq.ToDouble();
    r.dk = t32.dk.ToDouble();
    r.dv = t32.dv.ToDouble();
  }
  return r;
}

}  // namespace attn::testing
