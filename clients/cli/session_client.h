// The client side of KV sessions: creating one, appending K/V to it in chunks over one AppendKV
// call, building steps (Attend with session_id), and the tensor row slicing both need. The CLI
// (`attnserve_client session ...`, `bench --sessions`) and the tests use it.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "clients/cli/channel_factory.h"

namespace attnserve::client {

absl::StatusOr<v1::Session> CreateSession(v1::AttentionService::Stub& stub,
                                          const ChannelFactory& factory,
                                          const v1::CreateSessionRequest& request,
                                          absl::Duration timeout = absl::Seconds(30));

// Appends k and v ([tokens, num_kv_heads, head_dim]) in chunks of `chunk_tokens` rows on one
// AppendKV call; the session holds them all once it returns OK, none otherwise.
grpc::Status AppendKV(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                      const std::string& session_id, const v1::Tensor& k, const v1::Tensor& v,
                      int64_t chunk_tokens, v1::AppendKVResponse* response,
                      absl::Duration timeout = absl::Seconds(120));

grpc::Status DeleteSession(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                           const std::string& session_id);

// Rows [begin, end) of a tensor's first dimension.
v1::Tensor SliceRows(const v1::Tensor& t, int64_t begin, int64_t end);
// `b`'s rows after `a`'s (equal dtype and trailing dimensions).
v1::Tensor ConcatRows(const v1::Tensor& a, const v1::Tensor& b);

// A step over a session: q [tokens, heads, head_dim], and with `append_k`/`append_v` (non-null)
// the tokens' own K/V appended first.
v1::AttendRequest SessionStep(const std::string& session_id, const v1::Tensor& q,
                              const v1::Tensor* append_k, const v1::Tensor* append_v, bool causal,
                              bool return_lse);

// The dense request equivalent to a step over a session holding `k`, `v` (everything appended,
// the step's own rows included): what the float64 reference checks a session's answer against.
v1::AttendRequest DenseEquivalent(const v1::AttendRequest& step, const v1::Tensor& k,
                                  const v1::Tensor& v);

}  // namespace attnserve::client
