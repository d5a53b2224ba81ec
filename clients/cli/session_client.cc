#include "clients/cli/session_client.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/wire/request_decoder.h"

namespace attnserve::client {
namespace {

int64_t RowBytes(const v1::Tensor& t) {
  int64_t n = 1;
  for (int i = 1; i < t.shape_size(); ++i) n *= t.shape(i);
  absl::StatusOr<attn::DType> dtype = FromProtoDType(t.dtype());
  return n * (dtype.ok() ? attn::DTypeSize(*dtype) : 4);
}

}  // namespace

absl::StatusOr<v1::Session> CreateSession(v1::AttentionService::Stub& stub,
                                          const ChannelFactory& factory,
                                          const v1::CreateSessionRequest& request,
                                          absl::Duration timeout) {
  grpc::ClientContext context;
  factory.Prepare(&context, timeout);
  v1::Session session;
  const grpc::Status status = stub.CreateSession(&context, request, &session);
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  return session;
}

grpc::Status AppendKV(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                      const std::string& session_id, const v1::Tensor& k, const v1::Tensor& v,
                      int64_t chunk_tokens, v1::AppendKVResponse* response,
                      absl::Duration timeout) {
  grpc::ClientContext context;
  factory.Prepare(&context, timeout);
  std::unique_ptr<grpc::ClientWriter<v1::AppendKVRequest>> writer =
      stub.AppendKV(&context, response);
  const int64_t tokens = k.shape_size() > 0 ? k.shape(0) : 0;
  const int64_t step = std::max<int64_t>(1, chunk_tokens);
  for (int64_t at = 0; at < tokens || at == 0; at += step) {
    v1::AppendKVRequest chunk;
    if (at == 0) chunk.set_session_id(session_id);
    const int64_t end = std::min(tokens, at + step);
    *chunk.mutable_k() = SliceRows(k, at, end);
    *chunk.mutable_v() = SliceRows(v, at, end);
    if (!writer->Write(chunk)) break;  // the server ended the call: Finish says why
    if (tokens == 0) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

grpc::Status DeleteSession(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                           const std::string& session_id) {
  grpc::ClientContext context;
  factory.Prepare(&context, absl::Seconds(30));
  v1::DeleteSessionRequest request;
  request.set_session_id(session_id);
  v1::DeleteSessionResponse response;
  return stub.DeleteSession(&context, request, &response);
}

v1::Tensor SliceRows(const v1::Tensor& t, int64_t begin, int64_t end) {
  v1::Tensor out;
  out.set_dtype(t.dtype());
  out.add_shape(end - begin);
  for (int i = 1; i < t.shape_size(); ++i) out.add_shape(t.shape(i));
  const int64_t row = RowBytes(t);
  out.set_data(
      t.data().substr(static_cast<size_t>(begin * row), static_cast<size_t>((end - begin) * row)));
  return out;
}

v1::Tensor ConcatRows(const v1::Tensor& a, const v1::Tensor& b) {
  if (a.shape_size() == 0) return b;
  v1::Tensor out = a;
  out.set_shape(0, a.shape(0) + b.shape(0));
  out.mutable_data()->append(b.data());
  return out;
}

v1::AttendRequest SessionStep(const std::string& session_id, const v1::Tensor& q,
                              const v1::Tensor* append_k, const v1::Tensor* append_v, bool causal,
                              bool return_lse) {
  v1::AttendRequest r;
  r.set_session_id(session_id);
  *r.mutable_q() = q;
  if (append_k != nullptr && append_v != nullptr) {
    r.set_append(true);
    *r.mutable_k() = *append_k;
    *r.mutable_v() = *append_v;
  }
  r.set_causal(causal);
  r.set_return_lse(return_lse);
  return r;
}

v1::AttendRequest DenseEquivalent(const v1::AttendRequest& step, const v1::Tensor& k,
                                  const v1::Tensor& v) {
  v1::AttendRequest r = step;
  r.clear_session_id();
  r.clear_append();
  *r.mutable_k() = k;
  *r.mutable_v() = v;
  return r;
}

}  // namespace attnserve::client
