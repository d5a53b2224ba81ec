#include "server/staging.h"

#include "proto/wire/request_decoder.h"
#include "server/work.h"

namespace attnserve {
namespace {

int64_t AlignUp(int64_t n) { return (n + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

}  // namespace

BatchKey BatchKey::Of(int engine, const attn::AttentionProblem& p) {
  BatchKey key;
  key.engine = engine;
  key.dtype = p.dtype;
  key.num_heads = p.num_heads;
  key.num_kv_heads = p.num_kv_heads;
  key.head_dim = p.head_dim;
  key.causal = p.causal;
  key.window_left = p.effective_window_left();
  key.window_right = p.effective_window_right();
  key.scale = p.scale();
  return key;
}

attn::AttentionProblem PackProblems(const std::vector<const attn::AttentionProblem*>& problems) {
  attn::AttentionProblem p = *problems.front();
  p.cu_seqlens_q.assign(1, 0);
  p.cu_seqlens_k.assign(1, 0);
  for (const attn::AttentionProblem* r : problems) {
    const int32_t q0 = p.cu_seqlens_q.back(), k0 = p.cu_seqlens_k.back();
    for (int b = 0; b < r->batch(); ++b) {
      p.cu_seqlens_q.push_back(q0 + r->cu_seqlens_q[b + 1]);
      p.cu_seqlens_k.push_back(k0 + r->cu_seqlens_k[b + 1]);
    }
  }
  return p;
}

ForwardStaging ForwardStaging::For(const attn::AttentionProblem& p, bool lse, bool in_place) {
  const TensorSizes t = TensorSizesOf(p);
  ForwardStaging s;
  if (!in_place) {
    s.k = AlignUp(s.q + t.q);
    s.v = AlignUp(s.k + t.kv);
    s.o = AlignUp(s.v + t.kv);
    s.lse = AlignUp(s.o + t.q);
  }
  s.end = s.lse + (lse ? t.lse : 0);
  return s;
}

BackwardStaging BackwardStaging::For(const attn::AttentionProblem& p) {
  const TensorSizes t = TensorSizesOf(p);
  BackwardStaging s;
  s.k = AlignUp(s.q + t.q);
  s.v = AlignUp(s.k + t.kv);
  s.d_o = AlignUp(s.v + t.kv);
  s.o = AlignUp(s.d_o + t.q);
  s.lse = AlignUp(s.o + t.q);
  s.dq = AlignUp(s.lse + t.lse);
  s.dk = AlignUp(s.dq + t.q);
  s.dv = AlignUp(s.dk + t.kv);
  s.end = s.dv + t.kv;
  return s;
}

}  // namespace attnserve
