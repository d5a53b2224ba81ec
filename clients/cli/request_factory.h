// Builds AttendRequests filled with fresh random values for the client, the load generator and
// the integration tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attn/dtype.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve::client {

struct ShapeSpec {
  attn::DType dtype = attn::DType::kF32;
  int batch = 1;
  int64_t seqlen_q = 128;
  int64_t seqlen_k = 128;
  int num_heads = 8;
  int num_kv_heads = 8;
  int head_dim = 64;
  bool causal = false;
  // Variable-length layout: sequence lengths drawn in [1, seqlen] (3-D tensors + cu_seqlens).
  bool varlen = false;
  bool return_lse = false;
  v1::Path path = v1::PATH_AUTO;
};

// Values uniform in [-1, 1], rounded to the dtype, from a generator seeded with `seed`.
v1::AttendRequest MakeRandomRequest(const ShapeSpec& spec, uint64_t seed,
                                    const std::string& request_id = "");

// A training step's backward request: the forward part as MakeRandomRequest, dO random like q.
v1::AttendBackwardRequest MakeRandomBackwardRequest(const ShapeSpec& spec, uint64_t seed,
                                                    const std::string& request_id = "");

}  // namespace attnserve::client
