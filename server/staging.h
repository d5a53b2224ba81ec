// How a lane lays a batch out: the packed problem of many requests, and where each tensor sits
// in the lane's pool. Pure functions of the problems, so the fuzzer checks them beside the
// decoder.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/problem.h"

namespace attnserve {

inline constexpr int64_t kStagingAlign = 256;

// One variable-length problem of many compatible ones (equal BatchKeys): the scalars of the
// first, every problem's sequences in order.
attn::AttentionProblem PackProblems(const std::vector<const attn::AttentionProblem*>& problems);

// Where a packed forward batch lives in a lane's pool: Q, K, V, O and the LSE at aligned
// offsets. A lone request on a host engine is not staged (the engine reads and writes the
// request's own memory), and only the LSE takes pool memory.
struct ForwardStaging {
  int64_t q = 0, k = 0, v = 0, o = 0, lse = 0, end = 0;
  static ForwardStaging For(const attn::AttentionProblem& packed, bool lse, bool in_place);
};

// An AttendBackward's tensors in the pool: the inputs first (copied to the device in one go),
// then the gradients (copied back in one go).
struct BackwardStaging {
  int64_t q = 0, k = 0, v = 0, d_o = 0, o = 0, lse = 0, dq = 0, dk = 0, dv = 0, end = 0;
  static BackwardStaging For(const attn::AttentionProblem& p);
};

}  // namespace attnserve
