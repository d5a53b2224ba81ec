// Turns an AttendRequest (or an AttendBackwardRequest) into a validated attention problem whose
// tensors point into the request's own bytes or the shared-memory regions it names. Everything a
// request can get wrong is caught here, before it is queued, and the message names the field.
// Both ends use it: the server at its door, the clients to check answers against the reference.
// The libFuzzer target (tests/server) drives this file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/problem.h"
#include "attnserve/v1/attention.pb.h"
#include "proto/wire/memory_region.h"

namespace attnserve {

// What one request may ask of the server. Every count a client names is bounded here, so the
// work a request causes is proportional to the bytes it carries, never to a number it names.
struct DecodeLimits {
  // One request's working set (Q, K, V, O, the LSE and its sequence index) must fit in this
  // many bytes.
  int64_t memory_limit_bytes = int64_t{2} << 30;
  int max_heads = 1024;       // query heads (KV heads are at most as many)
  int max_sequences = 65536;  // the dense batch, or cu_seqlens entries - 1
};

// A validated forward request. The tensor pointers alias the request's bytes or the
// shared-memory regions it refers to (kept alive by `regions`): the request must outlive this
// object.
struct DecodedForward {
  attn::AttentionProblem problem;
  const char* q = nullptr;  // [total_q, num_heads, head_dim], packed
  const char* k = nullptr;  // [total_k, num_kv_heads, head_dim], packed
  const char* v = nullptr;
  std::vector<int64_t> o_shape;  // the shape of q, which O takes
  bool return_lse = false;
  v1::Path path = v1::PATH_AUTO;
  // o_shared_memory: O goes here instead of into the response, which echoes the reference.
  std::byte* o_out = nullptr;
  const v1::SharedMemoryRef* o_out_ref = nullptr;
  std::vector<std::shared_ptr<const MemoryRegion>> regions;

  int64_t tokens() const { return problem.total_q() + problem.total_k(); }
  // Whether [p, p + bytes) lies in one of the request's page-locked shared-memory regions, so
  // that a device copy can DMA it directly.
  bool InPinnedRegion(const void* p, int64_t bytes) const {
    for (const auto& region : regions) {
      if (region->pinned() && region->Contains(p, bytes)) return true;
    }
    return false;
  }
};

// A validated AttendBackward request: the forward it differentiates, dO, and the forward's
// outputs when the client kept them.
struct DecodedBackward {
  DecodedForward forward;        // return_lse is false; o_out unused
  const char* d_o = nullptr;     // like q
  const char* o = nullptr;       // the forward's O, like q; null: the server runs the forward
  const char* lse = nullptr;     // float32 [num_heads, total_q]; set exactly when o is
  std::vector<int64_t> k_shape;  // the shape of k, which dK and dV take
  bool deterministic = false;    // the request asks for bit-identical gradients

  const attn::AttentionProblem& problem() const { return forward.problem; }
};

// Bytes of one of a problem's tensors: Q (and O, dO, dQ), K (and V, dK, dV), the float32 LSE.
struct TensorSizes {
  int64_t q = 0, kv = 0, lse = 0;
};
TensorSizes TensorSizesOf(const attn::AttentionProblem& p);
// Bytes of Q, K, V, O (problem dtype), the float32 LSE of a problem and its sequence index.
int64_t WorkingSetBytes(const attn::AttentionProblem& p);
// The backward pass's: Q, K, V, O, dO, dQ, dK, dV and the LSE.
int64_t BackwardWorkingSetBytes(const attn::AttentionProblem& p);

absl::StatusOr<attn::DType> FromProtoDType(v1::DType dtype);
v1::DType ToProtoDType(attn::DType dtype);

// INVALID_ARGUMENT naming the field, NOT_FOUND for a shared-memory region the caller cannot
// name, or RESOURCE_EXHAUSTED when the request is too large. `shared_memory` resolves
// references (null: shared memory is off, and a reference is invalid).
absl::StatusOr<DecodedForward> DecodeAttendRequest(
    const v1::AttendRequest& request, const DecodeLimits& limits,
    const SharedMemoryResolver* shared_memory = nullptr);
// What a KV session holds keys and values as: a step's tensors must match it.
struct KvGeometry {
  attn::DType dtype = attn::DType::kBF16;
  int num_kv_heads = 1;
  int head_dim = 64;
};

// An Attend with session_id: q [tokens, num_heads, head_dim] in the session's dtype and
// head_dim, and with `append` the rows to append in k and v [tokens, num_kv_heads, head_dim].
// The problem is one sequence whose keys the caller completes: cu_seqlens_k starts as {0, m}
// (the appended tokens), and the lane adds the session's committed tokens when it runs.
absl::StatusOr<DecodedForward> DecodeSessionAttendRequest(
    const v1::AttendRequest& request, const KvGeometry& session, const DecodeLimits& limits,
    const SharedMemoryResolver* shared_memory = nullptr);

// One AppendKV chunk: k and v [tokens, num_kv_heads, head_dim] in the session's dtype.
struct DecodedKvRows {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t rows = 0;
  std::vector<std::shared_ptr<const MemoryRegion>> regions;
};
absl::StatusOr<DecodedKvRows> DecodeKvRows(const v1::Tensor& k, const v1::Tensor& v,
                                           const KvGeometry& session, const DecodeLimits& limits,
                                           const SharedMemoryResolver* shared_memory = nullptr);

// The forward part as DecodeAttendRequest (fields named "forward.q", ...), then d_o, o, lse.
absl::StatusOr<DecodedBackward> DecodeAttendBackwardRequest(
    const v1::AttendBackwardRequest& request, const DecodeLimits& limits,
    const SharedMemoryResolver* shared_memory = nullptr);

}  // namespace attnserve
