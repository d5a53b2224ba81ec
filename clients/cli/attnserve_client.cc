// attnserve_client: the command-line client of the attnserve server.
//
//   attnserve_client info   [--target=host:port] [--json]
//   attnserve_client health [--service=attnserve.v1.AttentionService]
//   attnserve_client attend [shape flags] [--check] [--count=N] [--json] [--shared_memory]
//                           [--q_npy=q.npy --k_npy=k.npy --v_npy=v.npy] [--o_npy=o.npy]
//   attnserve_client bench  [shape flags] [--concurrency=1,4,16] [--rates=100,200]
//                           [--rpc=unary|stream --streams=4] [--duration=5s] [--json]
//                           [--shared_memory]
//   attnserve_client backward [shape flags] [--send_forward] [--check] [--count=N] [--json]
//   attnserve_client session {create|append|attend|get|list|delete} [flags]
//   attnserve_client bench --sessions=N --context=L [--stateless] [--check]  (session_command.h)
//   attnserve_client train {submit|watch|status|cancel|result} [flags]  (train_command.h)
//   attnserve_client explain [--q_block=4] [--kv_tile=16] [--seqlen=32] [--head_dim=64]
//                            [--causal] [--seed=1] [--json]  (explain_command.h; no server)
//
// Exit status: 0 success, 1 an RPC failed or --check found a mismatch, 2 bad usage.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "clients/cli/channel_factory.h"
#include "clients/cli/explain_command.h"
#include "clients/cli/load_generator.h"
#include "clients/cli/npy_file.h"
#include "clients/cli/reference_check.h"
#include "clients/cli/request_factory.h"
#include "clients/cli/session_command.h"
#include "clients/cli/shared_memory_buffer.h"
#include "clients/cli/train_command.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/wire/process_tuning.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address");
ABSL_FLAG(std::string, tls_ca_file, "", "Use TLS, trusting this PEM CA certificate");
ABSL_FLAG(std::string, tls_server_name, "", "Name to check the server certificate against");
ABSL_FLAG(std::string, auth_token, "", "Bearer token to send");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30), "Deadline of each call");
ABSL_FLAG(bool, json, false, "Print JSON");
ABSL_FLAG(std::string, service, "", "health: the service to ask about (empty = the server)");

ABSL_FLAG(std::string, dtype, "float32", "float32, float16 or bfloat16");
ABSL_FLAG(int, batch, 1, "Sequences per request");
ABSL_FLAG(int64_t, seqlen_q, 128, "Query tokens per sequence (varlen: the maximum)");
ABSL_FLAG(int64_t, seqlen_k, 128, "Key tokens per sequence (varlen: the maximum)");
ABSL_FLAG(int, heads, 8, "Query heads");
ABSL_FLAG(int, kv_heads, 0, "Key/value heads (0 = --heads)");
ABSL_FLAG(int, head_dim, 64, "Head dimension");
ABSL_FLAG(bool, causal, false, "Causal mask");
ABSL_FLAG(bool, varlen, false, "Variable-length layout with random sequence lengths");
ABSL_FLAG(bool, lse, false, "Ask for the log-sum-exp");
ABSL_FLAG(std::string, path, "auto", "auto, fused, naive or cpu");
ABSL_FLAG(uint64_t, seed, 1, "Random seed of the tensors");

ABSL_FLAG(int, window_left, -1, "Sliding window: keys to the left (-1 = unbounded)");
ABSL_FLAG(int, window_right, -1, "Sliding window: keys to the right (-1 = unbounded)");
ABSL_FLAG(std::string, q_npy, "", "attend: read Q from this .npy (with --k_npy, --v_npy)");
ABSL_FLAG(std::string, k_npy, "", "attend: read K from this .npy");
ABSL_FLAG(std::string, v_npy, "", "attend: read V from this .npy");
ABSL_FLAG(std::vector<std::string>, cu_seqlens_q, {},
          "attend with .npy inputs: query prefix sums for the 3-D variable-length layout");
ABSL_FLAG(std::vector<std::string>, cu_seqlens_k, {}, "attend with .npy inputs: key prefix sums");
ABSL_FLAG(std::string, o_npy, "", "attend: write O to this .npy");
ABSL_FLAG(std::string, lse_npy, "", "attend: write the LSE to this .npy (implies --lse)");
ABSL_FLAG(bool, check, false, "attend: check O (and LSE) against the local CPU reference");
ABSL_FLAG(int, count, 1, "attend: requests to send, one after another, fresh tensors each");

ABSL_FLAG(std::vector<std::string>, concurrency, std::vector<std::string>({"1", "4", "16"}),
          "bench: closed-loop concurrency levels");
ABSL_FLAG(std::vector<std::string>, rates, {}, "bench: open-loop request rates (requests/s)");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(5), "bench: time per level");
ABSL_FLAG(int, pool, 8, "bench: distinct requests to cycle through");
ABSL_FLAG(int, channels, 4, "bench: gRPC channels (connections) the clients share round-robin");
ABSL_FLAG(std::string, rpc, "unary",
          "bench: closed loop over 'unary' Attend calls (one per client) or 'stream' (the "
          "concurrency pipelined over --streams AttendStream calls)");
ABSL_FLAG(bool, deterministic, false,
          "backward, train submit: bit-identical gradients across runs, at some cost in speed");
ABSL_FLAG(bool, send_forward, false,
          "backward: get O and the LSE from an Attend call first and send them along");
ABSL_FLAG(std::vector<std::string>, grpc_arg, {},
          "Extra gRPC channel arguments, name=value[,name=value...] (integers as integers)");
ABSL_FLAG(int, streams, 4, "bench --rpc=stream: AttendStream calls, spread over the channels");
ABSL_FLAG(absl::Duration, progress_every, absl::Seconds(1),
          "bench: while a level runs, a progress line on stderr this often (on a terminal one "
          "line, rewritten in place up to four times a second); 0 = none");
ABSL_FLAG(bool, shared_memory, false,
          "attend, bench: send Q, K, V by reference to a shared-memory region registered with "
          "the server, and get O back in it (same host only)");

namespace {

using attnserve::client::ChannelFactory;
using attnserve::client::ChannelOptions;
namespace v1 = attnserve::v1;

int Usage(const std::string& message) {
  std::fprintf(stderr, "%s\nRun with --help for the flags.\n", message.c_str());
  return 2;
}

int RpcFailed(const char* what, const grpc::Status& status) {
  std::fprintf(stderr, "%s failed: %s: %s\n", what,
               attnserve::client::StatusCodeName(status.error_code()).c_str(),
               status.error_message().c_str());
  return 1;
}

bool ShapeFromFlags(attnserve::client::ShapeSpec* s, std::string* error) {
  absl::StatusOr<attn::DType> dtype = attn::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) {
    *error = std::string(dtype.status().message());
    return false;
  }
  s->dtype = *dtype;
  s->batch = absl::GetFlag(FLAGS_batch);
  s->seqlen_q = absl::GetFlag(FLAGS_seqlen_q);
  s->seqlen_k = absl::GetFlag(FLAGS_seqlen_k);
  s->num_heads = absl::GetFlag(FLAGS_heads);
  s->num_kv_heads =
      absl::GetFlag(FLAGS_kv_heads) > 0 ? absl::GetFlag(FLAGS_kv_heads) : s->num_heads;
  s->head_dim = absl::GetFlag(FLAGS_head_dim);
  s->causal = absl::GetFlag(FLAGS_causal);
  s->varlen = absl::GetFlag(FLAGS_varlen);
  s->return_lse = absl::GetFlag(FLAGS_lse);
  const std::string path = absl::GetFlag(FLAGS_path);
  if (path == "auto") {
    s->path = v1::PATH_AUTO;
  } else if (path == "fused") {
    s->path = v1::PATH_FUSED;
  } else if (path == "naive") {
    s->path = v1::PATH_NAIVE;
  } else if (path == "cpu") {
    s->path = v1::PATH_CPU;
  } else {
    *error = absl::StrCat("--path: unknown '", path, "'");
    return false;
  }
  if (s->batch < 1 || s->seqlen_q < 1 || s->seqlen_k < 0 || s->num_heads < 1 ||
      s->num_kv_heads < 1 || s->head_dim < 1) {
    *error = "shape flags: batch, seqlen_q, heads, kv_heads, head_dim must be >= 1";
    return false;
  }
  return true;
}

int Info(const ChannelFactory& factory, std::shared_ptr<grpc::Channel> channel) {
  auto stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext context;
  factory.Prepare(&context, absl::GetFlag(FLAGS_timeout));
  v1::ServerInfo info;
  const grpc::Status status = stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
  if (!status.ok()) return RpcFailed("GetServerInfo", status);
  std::string out;
  if (absl::GetFlag(FLAGS_json)) {
    google::protobuf::util::JsonPrintOptions options;
    options.always_print_primitive_fields = true;
    (void)google::protobuf::util::MessageToJsonString(info, &out, options);
    out += "\n";
  } else {
    out = info.DebugString();
  }
  std::fputs(out.c_str(), stdout);
  return 0;
}

int Health(const ChannelFactory& factory, std::shared_ptr<grpc::Channel> channel) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  factory.Prepare(&context, absl::GetFlag(FLAGS_timeout));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return RpcFailed("Health.Check", status);
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()).c_str());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

// Builds the request from --q_npy/--k_npy/--v_npy (and cu_seqlens), or returns false.
bool RequestFromNpy(const attnserve::client::ShapeSpec& spec, v1::AttendRequest* request,
                    std::string* error) {
  const std::string q = absl::GetFlag(FLAGS_q_npy), k = absl::GetFlag(FLAGS_k_npy),
                    v = absl::GetFlag(FLAGS_v_npy);
  if (q.empty() || k.empty() || v.empty()) {
    *error = "--q_npy, --k_npy and --v_npy: give all three";
    return false;
  }
  const std::pair<const std::string*, v1::Tensor*> files[] = {
      {&q, request->mutable_q()}, {&k, request->mutable_k()}, {&v, request->mutable_v()}};
  for (const auto& [path, tensor] : files) {
    absl::StatusOr<v1::Tensor> t = attnserve::client::ReadNpy(*path);
    if (!t.ok()) {
      *error = std::string(t.status().message());
      return false;
    }
    *tensor = *std::move(t);
  }
  for (const auto& [flag, list] :
       {std::pair{&FLAGS_cu_seqlens_q, request->mutable_cu_seqlens_q()},
        std::pair{&FLAGS_cu_seqlens_k, request->mutable_cu_seqlens_k()}}) {
    for (const std::string& x : absl::GetFlag(*flag)) {
      int32_t n = 0;
      if (!absl::SimpleAtoi(x, &n)) {
        *error = absl::StrCat("--cu_seqlens: '", x, "' is not an integer");
        return false;
      }
      list->Add(n);
    }
  }
  request->set_request_id("cli-npy");
  request->set_causal(spec.causal);
  request->set_return_lse(spec.return_lse);
  request->set_path(spec.path);
  return true;
}

int Attend(const ChannelFactory& factory, std::shared_ptr<grpc::Channel> channel) {
  attnserve::client::ShapeSpec spec;
  std::string error;
  if (!ShapeFromFlags(&spec, &error)) return Usage(error);
  if (!absl::GetFlag(FLAGS_lse_npy).empty()) spec.return_lse = true;
  const bool from_npy = !absl::GetFlag(FLAGS_q_npy).empty() ||
                        !absl::GetFlag(FLAGS_k_npy).empty() || !absl::GetFlag(FLAGS_v_npy).empty();
  auto stub = v1::AttentionService::NewStub(channel);
  const bool shared_memory = absl::GetFlag(FLAGS_shared_memory);
  const std::string region = absl::StrCat("cli-", getpid());
  std::unique_ptr<attnserve::client::SharedMemoryBuffer> buffer;
  int failures = 0;
  for (int i = 0; i < (from_npy ? 1 : absl::GetFlag(FLAGS_count)); ++i) {
    v1::AttendRequest request;
    if (from_npy) {
      if (!RequestFromNpy(spec, &request, &error)) return Usage(error);
    } else {
      request = attnserve::client::MakeRandomRequest(spec, absl::GetFlag(FLAGS_seed) + i,
                                                     absl::StrCat("cli-", i));
    }
    if (absl::GetFlag(FLAGS_window_left) >= 0) {
      request.set_window_left(absl::GetFlag(FLAGS_window_left));
    }
    if (absl::GetFlag(FLAGS_window_right) >= 0) {
      request.set_window_right(absl::GetFlag(FLAGS_window_right));
    }
    // By reference: Q, K, V and a slot for O in a registered region, registered again only
    // when a request outgrows it (registration page-locks the region on a GPU server).
    v1::AttendRequest sent = request;
    if (shared_memory) {
      const int64_t o_bytes = static_cast<int64_t>(request.q().data().size());
      const int64_t bytes = attnserve::client::LoadGenerator::SharedMemoryBytes({request}, 1);
      if (buffer == nullptr || buffer->size() < bytes) {
        absl::StatusOr<std::unique_ptr<attnserve::client::SharedMemoryBuffer>> created =
            attnserve::client::SharedMemoryBuffer::Create(bytes);
        if (!created.ok()) {
          std::fprintf(stderr, "%s\n", std::string(created.status().message()).c_str());
          return 1;
        }
        if (buffer != nullptr)
          (void)attnserve::client::UnregisterSharedMemory(*stub, factory, region);
        buffer = *std::move(created);
        if (const grpc::Status s =
                attnserve::client::RegisterSharedMemory(*stub, factory, region, *buffer);
            !s.ok()) {
          return RpcFailed("RegisterSharedMemory", s);
        }
      }
      int64_t offset = 0;
      for (v1::Tensor* t : {sent.mutable_q(), sent.mutable_k(), sent.mutable_v()}) {
        if (absl::Status s = attnserve::client::MoveToSharedMemory(t, region, *buffer, &offset);
            !s.ok()) {
          std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
          return 1;
        }
      }
      v1::SharedMemoryRef& o_ref = *sent.mutable_o_shared_memory();
      o_ref.set_region(region);
      o_ref.set_offset(static_cast<uint64_t>(attnserve::client::SharedMemoryAlignUp(offset)));
      o_ref.set_byte_size(static_cast<uint64_t>(o_bytes));
    }
    grpc::ClientContext context;
    factory.Prepare(&context, absl::GetFlag(FLAGS_timeout));
    v1::AttendResponse response;
    const absl::Time t0 = absl::Now();
    const grpc::Status status = stub->Attend(&context, sent, &response);
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    if (!status.ok()) return RpcFailed("Attend", status);
    if (response.o().has_shared_memory()) {  // O is in the region: read it back for what follows
      absl::StatusOr<std::string> o =
          attnserve::client::ReadSharedMemory(response.o().shared_memory(), *buffer);
      if (!o.ok()) {
        std::fprintf(stderr, "%s\n", std::string(o.status().message()).c_str());
        return 1;
      }
      response.mutable_o()->clear_shared_memory();
      *response.mutable_o()->mutable_data() = *std::move(o);
    }
    for (const auto& [path, tensor] : {std::pair{absl::GetFlag(FLAGS_o_npy), &response.o()},
                                       std::pair{absl::GetFlag(FLAGS_lse_npy), &response.lse()}}) {
      if (path.empty()) continue;
      if (absl::Status s = attnserve::client::WriteNpy(path, *tensor); !s.ok()) {
        std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
        return 1;
      }
    }
    std::string check = "unchecked";
    double max_err = -1;
    if (absl::GetFlag(FLAGS_check)) {
      absl::StatusOr<attnserve::client::CheckResult> r =
          attnserve::client::CheckAgainstReference(request, response);
      if (r.ok()) {
        check = "ok";
        max_err = r->max_abs_error;
      } else {
        check = absl::StrCat("MISMATCH: ", r.status().message());
        ++failures;
      }
    }
    if (absl::GetFlag(FLAGS_json)) {
      std::printf(
          "{\"request_id\": \"%s\", \"engine\": \"%s\", \"latency_ms\": %.3f, \"queue_us\": %lld, "
          "\"compute_us\": %lld, \"batch_requests\": %d, \"check\": \"%s\", \"max_abs_error\": "
          "%g}\n",
          response.request_id().c_str(), response.engine().c_str(), ms,
          static_cast<long long>(response.timing().queue_us()),
          static_cast<long long>(response.timing().compute_us()), response.batch().requests(),
          check.c_str(), max_err);
    } else {
      std::printf(
          "%s: engine %s, %.2f ms (queue %lld us, compute %lld us), batch of %d, o %s, "
          "check %s%s\n",
          response.request_id().c_str(), response.engine().c_str(), ms,
          static_cast<long long>(response.timing().queue_us()),
          static_cast<long long>(response.timing().compute_us()), response.batch().requests(),
          absl::StrJoin(response.o().shape(), "x").c_str(), check.c_str(),
          max_err >= 0 ? absl::StrFormat(" (max abs error %.3g)", max_err).c_str() : "");
    }
  }
  if (buffer != nullptr) {
    if (const grpc::Status s = attnserve::client::UnregisterSharedMemory(*stub, factory, region);
        !s.ok()) {
      return RpcFailed("UnregisterSharedMemory", s);
    }
  }
  return failures == 0 ? 0 : 1;
}

// Waits until `channel` is READY, reporting each failed attempt (gRPC retries with backoff).
bool WaitConnected(grpc::Channel& channel, int index, absl::Duration timeout) {
  const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
  grpc_connectivity_state state = channel.GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY) {
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE) {
      std::fprintf(stderr, "bench: channel %d: connection attempt failed, retrying\n", index);
    }
    if (!channel.WaitForStateChange(state, deadline)) return false;
    state = channel.GetState(/*try_to_connect=*/true);
  }
  return true;
}

// A training step's gradients: random Q, K, V and dO; with --send_forward the O and LSE of an
// Attend call go with the request (as a training loop keeps them), else the server recomputes.
int Backward(const ChannelFactory& factory, std::shared_ptr<grpc::Channel> channel) {
  attnserve::client::ShapeSpec spec;
  std::string error;
  if (!ShapeFromFlags(&spec, &error)) return Usage(error);
  auto stub = v1::AttentionService::NewStub(channel);
  int failures = 0;
  for (int i = 0; i < absl::GetFlag(FLAGS_count); ++i) {
    v1::AttendBackwardRequest request = attnserve::client::MakeRandomBackwardRequest(
        spec, absl::GetFlag(FLAGS_seed) + i, absl::StrCat("cli-backward-", i));
    request.set_deterministic(absl::GetFlag(FLAGS_deterministic));
    v1::AttendRequest& forward = *request.mutable_forward();
    if (absl::GetFlag(FLAGS_window_left) >= 0)
      forward.set_window_left(absl::GetFlag(FLAGS_window_left));
    if (absl::GetFlag(FLAGS_window_right) >= 0) {
      forward.set_window_right(absl::GetFlag(FLAGS_window_right));
    }
    if (absl::GetFlag(FLAGS_send_forward)) {
      grpc::ClientContext context;
      factory.Prepare(&context, absl::GetFlag(FLAGS_timeout));
      v1::AttendRequest with_lse = forward;
      with_lse.set_return_lse(true);
      v1::AttendResponse out;
      const grpc::Status status = stub->Attend(&context, with_lse, &out);
      if (!status.ok()) return RpcFailed("Attend", status);
      *request.mutable_o() = out.o();
      *request.mutable_lse() = out.lse();
    }
    grpc::ClientContext context;
    factory.Prepare(&context, absl::GetFlag(FLAGS_timeout));
    v1::AttendBackwardResponse response;
    const absl::Time t0 = absl::Now();
    const grpc::Status status = stub->AttendBackward(&context, request, &response);
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    if (!status.ok()) return RpcFailed("AttendBackward", status);
    std::string check = "unchecked";
    double max_err = -1;
    if (absl::GetFlag(FLAGS_check)) {
      absl::StatusOr<attnserve::client::BackwardCheckResult> r =
          attnserve::client::CheckBackwardAgainstReference(request, response);
      if (r.ok()) {
        check = "ok";
        max_err = std::max({r->max_abs_error[0], r->max_abs_error[1], r->max_abs_error[2]});
      } else {
        check = absl::StrCat("MISMATCH: ", r.status().message());
        ++failures;
      }
    }
    const v1::Timing& t = response.timing();
    if (absl::GetFlag(FLAGS_json)) {
      std::printf(
          "{\"request_id\": \"%s\", \"engine\": \"%s\", \"latency_ms\": %.3f, "
          "\"compute_us\": %lld, \"kernel_us\": %lld, \"sent_forward\": %s, "
          "\"deterministic\": %s, \"check\": \"%s\", \"max_abs_error\": %g}\n",
          response.request_id().c_str(), response.engine().c_str(), ms,
          static_cast<long long>(t.compute_us()), static_cast<long long>(t.kernel_us()),
          request.has_o() ? "true" : "false", response.deterministic() ? "true" : "false",
          check.c_str(), max_err);
    } else {
      std::printf(
          "%s: engine %s%s, %.2f ms (compute %lld us, kernel %lld us), d_q %s, %s, check %s%s\n",
          response.request_id().c_str(), response.engine().c_str(),
          response.deterministic() ? " (deterministic)" : "", ms,
          static_cast<long long>(t.compute_us()), static_cast<long long>(t.kernel_us()),
          absl::StrJoin(response.d_q().shape(), "x").c_str(),
          request.has_o() ? "O and LSE sent" : "forward rerun by the server", check.c_str(),
          max_err >= 0 ? absl::StrFormat(" (max abs error %.3g)", max_err).c_str() : "");
    }
  }
  return failures == 0 ? 0 : 1;
}

int Bench(const ChannelFactory& factory, std::shared_ptr<grpc::Channel> channel) {
  attnserve::client::ShapeSpec spec;
  std::string error;
  if (!ShapeFromFlags(&spec, &error)) return Usage(error);
  std::vector<v1::AttendRequest> pool;
  for (int i = 0; i < std::max(1, absl::GetFlag(FLAGS_pool)); ++i) {
    pool.push_back(attnserve::client::MakeRandomRequest(spec, absl::GetFlag(FLAGS_seed) + i,
                                                        absl::StrCat("bench-", i)));
  }
  std::vector<std::shared_ptr<grpc::Channel>> channels = {channel};
  for (int i = 1; i < absl::GetFlag(FLAGS_channels); ++i) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> another = factory.Connect();
    if (!another.ok()) return Usage(std::string(another.status().message()));
    channels.push_back(*std::move(another));
  }
  // Connect every channel before measuring: a channel whose first connection attempt fails
  // would otherwise fail its share of calls at once (UNAVAILABLE) until its reconnect backoff
  // ends, and the level would measure that instead of the server.
  for (size_t i = 0; i < channels.size(); ++i) {
    if (!WaitConnected(*channels[i], static_cast<int>(i), absl::GetFlag(FLAGS_timeout))) {
      std::fprintf(stderr, "bench: channel %zu did not connect to %s within --timeout\n", i,
                   absl::GetFlag(FLAGS_target).c_str());
      return 1;
    }
  }
  if (attnserve::client::SessionBenchRequested()) {
    return attnserve::client::RunSessionBench(factory, channels);
  }
  // By reference: the pool's tensors and one O slot per request in flight in one region.
  std::unique_ptr<attnserve::client::SharedMemoryBuffer> buffer;
  attnserve::client::SharedMemoryTensors shared_memory;
  auto stub = v1::AttentionService::NewStub(channel);
  if (absl::GetFlag(FLAGS_shared_memory)) {
    int slots = 1;
    for (const std::string& level : absl::GetFlag(FLAGS_concurrency)) {
      int n = 0;
      if (absl::SimpleAtoi(level, &n)) slots = std::max(slots, n);
    }
    absl::StatusOr<std::unique_ptr<attnserve::client::SharedMemoryBuffer>> created =
        attnserve::client::SharedMemoryBuffer::Create(
            attnserve::client::LoadGenerator::SharedMemoryBytes(pool, slots));
    if (!created.ok()) {
      std::fprintf(stderr, "bench: %s\n", std::string(created.status().message()).c_str());
      return 1;
    }
    buffer = *std::move(created);
    shared_memory.region = absl::StrCat("bench-", getpid());
    shared_memory.buffer = buffer.get();
    shared_memory.output_slots = slots;
    if (const grpc::Status s =
            attnserve::client::RegisterSharedMemory(*stub, factory, shared_memory.region, *buffer);
        !s.ok()) {
      return RpcFailed("RegisterSharedMemory", s);
    }
  }
  attnserve::client::LoadGenerator generator(&factory, channels, std::move(pool),
                                             absl::GetFlag(FLAGS_timeout),
                                             buffer != nullptr ? &shared_memory : nullptr);
  generator.ShowProgress(stderr, absl::GetFlag(FLAGS_progress_every));
  std::vector<attnserve::client::LoadResult> results;
  const bool json = absl::GetFlag(FLAGS_json);
  const std::string rpc = absl::GetFlag(FLAGS_rpc);
  if (rpc != "unary" && rpc != "stream") return Usage("--rpc: 'unary' or 'stream'");
  if (absl::GetFlag(FLAGS_streams) < 1) return Usage("--streams: at least 1");
  if (rpc == "stream" && !absl::GetFlag(FLAGS_rates).empty()) {
    return Usage("--rates: the open loop runs over unary calls only (leave --rpc=unary)");
  }
  for (const std::string& level : absl::GetFlag(FLAGS_concurrency)) {
    int n = 0;
    if (!absl::SimpleAtoi(level, &n) || n < 1) return Usage("--concurrency: positive integers");
    const absl::Duration duration = absl::GetFlag(FLAGS_duration);
    results.push_back(rpc == "stream"
                          ? generator.RunClosedLoopStream(n, absl::GetFlag(FLAGS_streams), duration)
                          : generator.RunClosedLoop(n, duration));
    if (!json) std::printf("%s\n", results.back().ToText().c_str());
  }
  for (const std::string& level : absl::GetFlag(FLAGS_rates)) {
    double rate = 0;
    if (!absl::SimpleAtod(level, &rate) || rate <= 0) return Usage("--rates: positive numbers");
    results.push_back(generator.RunOpenLoop(rate, absl::GetFlag(FLAGS_duration)));
    if (!json) std::printf("%s\n", results.back().ToText().c_str());
  }
  if (json) {
    std::vector<std::string> items;
    for (const auto& r : results) items.push_back(r.ToJson());
    std::printf("[\n  %s\n]\n", absl::StrJoin(items, ",\n  ").c_str());
  }
  if (buffer != nullptr) {
    if (const grpc::Status s =
            attnserve::client::UnregisterSharedMemory(*stub, factory, shared_memory.region);
        !s.ok()) {
      return RpcFailed("UnregisterSharedMemory", s);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  attnserve::KeepFreedMemoryInTheHeap();  // responses of tens of MiB, one after another
  attnserve::SkipMutexDeadlockDetectionInOptimizedBuilds();  // the load generator's locks
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "clients/cli/");  // every command's flags
  };
  usage.version_string = [] {
    return absl::StrCat("attnserve_client ", ATTN_VERSION, " (", ATTN_BUILD_TYPE, " build)\n");
  };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "attnserve_client {info|health|attend|bench|backward|session|train|explain} [flags]: talk "
      "to an attnserve server (explain: the online softmax step by step, locally).");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  // train <command> and session <command> take one more word.
  const bool train = args.size() >= 2 && std::string(args[1]) == "train";
  const bool session = args.size() >= 2 && std::string(args[1]) == "session";
  if (args.size() != 2 && !train && !session) {
    return Usage(
        "expected one command: info, health, attend, bench, backward, session, train or explain");
  }
  const std::string command = args[1];
  if (command == "explain") return attnserve::client::RunExplainCommand();

  ChannelOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options.auth_token = absl::GetFlag(FLAGS_auth_token);
  options.grpc_args = absl::GetFlag(FLAGS_grpc_arg);
  const ChannelFactory factory(options);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = factory.Connect();
  if (!channel.ok()) return Usage(std::string(channel.status().message()));

  if (command == "info") return Info(factory, *channel);
  if (command == "health") return Health(factory, *channel);
  if (command == "attend") return Attend(factory, *channel);
  if (command == "bench") return Bench(factory, *channel);
  if (command == "backward") return Backward(factory, *channel);
  if (train) {
    return attnserve::client::RunTrainCommand({args.begin() + 2, args.end()}, factory, *channel);
  }
  if (command == "session") {
    return attnserve::client::RunSessionCommand(
        factory, *channel, std::vector<std::string>(args.begin() + 2, args.end()));
  }
  return Usage(absl::StrCat("unknown command '", command, "'"));
}
