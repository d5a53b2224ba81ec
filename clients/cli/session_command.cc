#include "clients/cli/session_command.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <random>
#include <set>
#include <thread>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attn/dtype.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "clients/cli/load_generator.h"
#include "clients/cli/reference_check.h"
#include "clients/cli/session_client.h"
#include "proto/wire/request_decoder.h"

ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(int, heads);
ABSL_DECLARE_FLAG(int, kv_heads);
ABSL_DECLARE_FLAG(int, head_dim);
ABSL_DECLARE_FLAG(bool, causal);
ABSL_DECLARE_FLAG(bool, lse);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(bool, check);
ABSL_DECLARE_FLAG(absl::Duration, timeout);
ABSL_DECLARE_FLAG(absl::Duration, duration);
ABSL_DECLARE_FLAG(std::vector<std::string>, concurrency);

ABSL_FLAG(std::string, session_id, "", "session: the session to use");
ABSL_FLAG(int64_t, tokens, 1, "session append: tokens to append; session attend: query tokens");
ABSL_FLAG(int64_t, chunk_tokens, 4096, "session append, bench --sessions: rows per AppendKV chunk");
ABSL_FLAG(bool, append, false, "session attend: append the step's own K/V first");
ABSL_FLAG(int64_t, max_tokens, 0, "session create: most tokens (0 = the server's default)");
ABSL_FLAG(int64_t, ttl_seconds, 0, "session create: idle seconds before expiry (0 = default)");
ABSL_FLAG(std::string, route, "",
          "session, bench --sessions: x-attnserve-route header, for a proxy that routes a "
          "session's calls to its server (deploy/nginx)");
ABSL_FLAG(int, sessions, 0, "bench: KV sessions to create and step (0 = the stateless bench)");
ABSL_FLAG(int64_t, context, 4096, "bench --sessions: tokens appended to each session first");
ABSL_FLAG(bool, stateless, false,
          "bench --sessions: send the same decode steps as plain Attend calls carrying the "
          "whole K/V each time, for comparison");

namespace attnserve::client {
namespace {

constexpr char kRouteHeader[] = "x-attnserve-route";

void Prepare(const ChannelFactory& factory, grpc::ClientContext* context,
             const std::string& route = absl::GetFlag(FLAGS_route)) {
  factory.Prepare(context, absl::GetFlag(FLAGS_timeout));
  if (!route.empty()) context->AddMetadata(kRouteHeader, route);
}

int Failed(const char* what, const grpc::Status& status) {
  std::fprintf(stderr, "%s failed: %s: %s\n", what, StatusCodeName(status.error_code()).c_str(),
               status.error_message().c_str());
  return 1;
}

void Print(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  std::printf("%s", out.c_str());
}

v1::DType FlagDType() {
  absl::StatusOr<attn::DType> d = attn::ParseDType(absl::GetFlag(FLAGS_dtype));
  return d.ok() ? ToProtoDType(*d) : v1::DTYPE_UNSPECIFIED;
}

int KvHeads() {
  const int kv = absl::GetFlag(FLAGS_kv_heads);
  return kv > 0 ? kv : absl::GetFlag(FLAGS_heads);
}

v1::Tensor RandomRows(v1::DType dtype, int64_t tokens, int heads, int head_dim,
                      std::mt19937_64& rng) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : {tokens, int64_t{heads}, int64_t{head_dim}}) t.add_shape(d);
  const attn::DType dt = *FromProtoDType(dtype);
  const int64_t n = tokens * heads * head_dim;
  t.mutable_data()->resize(static_cast<size_t>(n * attn::DTypeSize(dt)));
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (int64_t i = 0; i < n; ++i) {
    attn::StoreFromFloat(t.mutable_data()->data(), dt, i, uniform(rng));
  }
  return t;
}

grpc::Status Append(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                    const std::string& id, const v1::Tensor& k, const v1::Tensor& v,
                    v1::AppendKVResponse* response, const std::string& route) {
  grpc::ClientContext context;
  Prepare(factory, &context, route);
  auto writer = stub.AppendKV(&context, response);
  const int64_t tokens = k.shape(0),
                chunk = std::max<int64_t>(1, absl::GetFlag(FLAGS_chunk_tokens));
  for (int64_t at = 0; at < tokens; at += chunk) {
    v1::AppendKVRequest m;
    if (at == 0) m.set_session_id(id);
    *m.mutable_k() = SliceRows(k, at, std::min(tokens, at + chunk));
    *m.mutable_v() = SliceRows(v, at, std::min(tokens, at + chunk));
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
  return v[i];
}

}  // namespace

bool SessionBenchRequested() { return absl::GetFlag(FLAGS_sessions) > 0; }

int RunSessionCommand(const ChannelFactory& factory, const std::shared_ptr<grpc::Channel>& channel,
                      const std::vector<std::string>& args) {
  if (args.size() != 1) {
    std::fprintf(stderr, "session: expected create, append, attend, get, list or delete\n");
    return 2;
  }
  auto stub = v1::AttentionService::NewStub(channel);
  const std::string& what = args[0];
  const std::string id = absl::GetFlag(FLAGS_session_id);
  if (what != "create" && what != "list" && id.empty()) {
    std::fprintf(stderr, "session %s: --session_id is required\n", what.c_str());
    return 2;
  }
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const int kv_heads = KvHeads(), head_dim = absl::GetFlag(FLAGS_head_dim);
  if (what == "create") {
    v1::CreateSessionRequest r;
    r.set_num_kv_heads(kv_heads);
    r.set_head_dim(head_dim);
    r.set_dtype(FlagDType());
    r.set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
    r.set_ttl_seconds(absl::GetFlag(FLAGS_ttl_seconds));
    grpc::ClientContext context;
    Prepare(factory, &context);
    v1::Session session;
    if (const grpc::Status s = stub->CreateSession(&context, r, &session); !s.ok()) {
      return Failed("CreateSession", s);
    }
    if (absl::GetFlag(FLAGS_json)) {
      Print(session);
    } else {
      std::printf("%s\n", session.session_id().c_str());
    }
    return 0;
  }
  if (what == "get" || what == "delete" || what == "list") {
    grpc::ClientContext context;
    Prepare(factory, &context);
    grpc::Status s;
    if (what == "get") {
      v1::GetSessionRequest r;
      r.set_session_id(id);
      v1::Session session;
      s = stub->GetSession(&context, r, &session);
      if (s.ok()) Print(session);
    } else if (what == "list") {
      v1::ListSessionsResponse list;
      s = stub->ListSessions(&context, {}, &list);
      if (s.ok()) Print(list);
    } else {
      v1::DeleteSessionRequest r;
      r.set_session_id(id);
      v1::DeleteSessionResponse response;
      s = stub->DeleteSession(&context, r, &response);
    }
    return s.ok() ? 0 : Failed(what.c_str(), s);
  }
  // The session's geometry, for random tensors of the right shape.
  v1::Session session;
  {
    grpc::ClientContext context;
    Prepare(factory, &context);
    v1::GetSessionRequest r;
    r.set_session_id(id);
    if (const grpc::Status s = stub->GetSession(&context, r, &session); !s.ok()) {
      return Failed("GetSession", s);
    }
  }
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  if (what == "append") {
    const v1::Tensor k =
        RandomRows(session.dtype(), tokens, session.num_kv_heads(), session.head_dim(), rng);
    const v1::Tensor v =
        RandomRows(session.dtype(), tokens, session.num_kv_heads(), session.head_dim(), rng);
    v1::AppendKVResponse response;
    const absl::Time t0 = absl::Now();
    if (const grpc::Status s =
            Append(*stub, factory, id, k, v, &response, absl::GetFlag(FLAGS_route));
        !s.ok()) {
      return Failed("AppendKV", s);
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    std::printf("appended %lld tokens (%.1f MB) in %.1f ms: %.2f GB/s; the session holds %lld\n",
                static_cast<long long>(tokens), 2.0 * k.data().size() / 1e6, seconds * 1e3,
                2.0 * k.data().size() / seconds / 1e9,
                static_cast<long long>(response.session().tokens()));
    return 0;
  }
  if (what == "attend") {
    const v1::Tensor q =
        RandomRows(session.dtype(), tokens, absl::GetFlag(FLAGS_heads), session.head_dim(), rng);
    const v1::Tensor k =
        RandomRows(session.dtype(), tokens, session.num_kv_heads(), session.head_dim(), rng);
    const v1::Tensor v =
        RandomRows(session.dtype(), tokens, session.num_kv_heads(), session.head_dim(), rng);
    const bool append = absl::GetFlag(FLAGS_append);
    const v1::AttendRequest r = SessionStep(id, q, append ? &k : nullptr, append ? &v : nullptr,
                                            absl::GetFlag(FLAGS_causal), absl::GetFlag(FLAGS_lse));
    grpc::ClientContext context;
    Prepare(factory, &context);
    v1::AttendResponse response;
    const absl::Time t0 = absl::Now();
    if (const grpc::Status s = stub->Attend(&context, r, &response); !s.ok()) {
      return Failed("Attend", s);
    }
    std::printf("%s: %.3f ms (kernel %lld us), batch of %d, o %s\n", response.engine().c_str(),
                absl::ToDoubleMilliseconds(absl::Now() - t0),
                static_cast<long long>(response.timing().kernel_us()), response.batch().requests(),
                absl::StrJoin(response.o().shape(), "x").c_str());
    return 0;
  }
  std::fprintf(stderr, "session: unknown command '%s'\n", what.c_str());
  return 2;
}

int RunSessionBench(const ChannelFactory& factory,
                    const std::vector<std::shared_ptr<grpc::Channel>>& channels) {
  const int n = absl::GetFlag(FLAGS_sessions);
  const int64_t context_tokens = absl::GetFlag(FLAGS_context);
  const v1::DType dtype = FlagDType();
  const int heads = absl::GetFlag(FLAGS_heads), kv_heads = KvHeads();
  const int head_dim = absl::GetFlag(FLAGS_head_dim);
  const bool stateless = absl::GetFlag(FLAGS_stateless), check = absl::GetFlag(FLAGS_check);
  const int64_t row_bytes = int64_t{kv_heads} * head_dim * attn::DTypeSize(*FromProtoDType(dtype));
  std::vector<std::unique_ptr<v1::AttentionService::Stub>> stubs;
  for (const auto& c : channels) stubs.push_back(v1::AttentionService::NewStub(c));

  // The sessions' contents: one random history each (also what stateless steps carry).
  struct Sequence {
    std::string id, route;
    v1::Tensor k, v;     // what it holds: the context, and with --check every step's rows
    int64_t tokens = 0;  // what it holds, for the KV bytes each step reads
    bool checked = false;
    v1::AttendRequest dense;  // --stateless: a step carrying the whole context
  };
  std::vector<Sequence> seqs(static_cast<size_t>(n));
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  for (int i = 0; i < n; ++i) {
    seqs[i].route = absl::StrCat(absl::GetFlag(FLAGS_route), "s", i);
    seqs[i].k = RandomRows(dtype, context_tokens, kv_heads, head_dim, rng);
    seqs[i].v = RandomRows(dtype, context_tokens, kv_heads, head_dim, rng);
    seqs[i].tokens = context_tokens;
    if (stateless) {
      seqs[i].dense = DenseEquivalent(SessionStep("", RandomRows(dtype, 1, heads, head_dim, rng),
                                                  nullptr, nullptr, true, false),
                                      seqs[i].k, seqs[i].v);
    }
  }
  double ingest_gbps = 0;
  if (!stateless) {
    for (int i = 0; i < n; ++i) {
      v1::CreateSessionRequest r;
      r.set_num_kv_heads(kv_heads);
      r.set_head_dim(head_dim);
      r.set_dtype(dtype);
      grpc::ClientContext context;
      Prepare(factory, &context, seqs[i].route);
      v1::Session session;
      if (const grpc::Status s = stubs[i % stubs.size()]->CreateSession(&context, r, &session);
          !s.ok()) {
        return Failed("CreateSession", s);
      }
      seqs[i].id = session.session_id();
    }
    // Ingest: every session's context appended at once, one AppendKV call per session.
    std::atomic<int> failed{0};
    const absl::Time t0 = absl::Now();
    std::vector<std::thread> threads;
    const int writers = std::min(n, 8);
    for (int w = 0; w < writers; ++w) {
      threads.emplace_back([&, w] {
        for (int i = w; i < n; i += writers) {
          v1::AppendKVResponse response;
          if (!Append(*stubs[i % stubs.size()], factory, seqs[i].id, seqs[i].k, seqs[i].v,
                      &response, seqs[i].route)
                   .ok()) {
            ++failed;
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    if (failed.load() > 0) {
      std::fprintf(stderr, "bench --sessions: %d AppendKV calls failed\n", failed.load());
      return 1;
    }
    ingest_gbps = 2.0 * n * context_tokens * row_bytes / seconds / 1e9;
  }

  int exit_status = 0;
  std::set<int> levels_run;
  for (const std::string& level : absl::GetFlag(FLAGS_concurrency)) {
    int clients = 0;
    if (!absl::SimpleAtoi(level, &clients) || clients < 1) continue;
    clients = std::min(clients, n);  // a client steps its own sessions, one at a time
    if (!levels_run.insert(clients).second) continue;
    std::atomic<int64_t> steps{0}, kv_bytes{0}, errors{0};
    absl::Mutex mu;
    std::vector<double> latencies;
    std::string first_error;
    const absl::Time end = absl::Now() + absl::GetFlag(FLAGS_duration);
    std::vector<std::thread> threads;
    for (int c = 0; c < clients; ++c) {
      threads.emplace_back([&, c] {
        std::mt19937_64 local(absl::GetFlag(FLAGS_seed) * 7919 + c);
        // A few steps' worth of random rows, reused: the client measures the server.
        std::vector<v1::Tensor> qs, ks, vs;
        for (int i = 0; i < 8; ++i) {
          qs.push_back(RandomRows(dtype, 1, heads, head_dim, local));
          ks.push_back(RandomRows(dtype, 1, kv_heads, head_dim, local));
          vs.push_back(RandomRows(dtype, 1, kv_heads, head_dim, local));
        }
        std::vector<double> mine;
        const int64_t owned = (n - c + clients - 1) / clients;  // sessions c, c + clients, ...
        for (int64_t i = 0; absl::Now() < end; ++i) {
          Sequence& seq = seqs[static_cast<size_t>(c + clients * (i % owned))];
          const size_t r = static_cast<size_t>(i % 8);
          const v1::AttendRequest request =
              stateless ? seq.dense
                        : SessionStep(seq.id, qs[r], &ks[r], &vs[r], true, check && !seq.checked);
          grpc::ClientContext context;
          Prepare(factory, &context, seq.route);
          v1::AttendResponse response;
          const absl::Time t0 = absl::Now();
          const grpc::Status s =
              stubs[static_cast<size_t>(c) % stubs.size()]->Attend(&context, request, &response);
          const double ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
          if (!s.ok()) {
            ++errors;
            absl::MutexLock lock(&mu);
            if (first_error.empty()) first_error = s.error_message();
            continue;
          }
          mine.push_back(ms);
          ++steps;
          if (!stateless) ++seq.tokens;  // the step's own row, attended over too
          kv_bytes += 2 * seq.tokens * row_bytes;
          if (!stateless && check && !seq.checked) {
            seq.k = ConcatRows(seq.k, ks[r]);
            seq.v = ConcatRows(seq.v, vs[r]);
            {
              seq.checked = true;
              const absl::StatusOr<CheckResult> ok =
                  CheckAgainstReference(DenseEquivalent(request, seq.k, seq.v), response);
              if (!ok.ok()) {
                ++errors;
                absl::MutexLock lock(&mu);
                if (first_error.empty()) first_error = std::string(ok.status().message());
              }
            }
          }
        }
        absl::MutexLock lock(&mu);
        latencies.insert(latencies.end(), mine.begin(), mine.end());
      });
    }
    for (auto& t : threads) t.join();
    const double seconds = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_duration));
    const double rate = static_cast<double>(steps.load()) / seconds;
    const double p50 = Percentile(latencies, 0.5), p90 = Percentile(latencies, 0.9),
                 p99 = Percentile(latencies, 0.99);
    // Each step appends its row, so the sessions grow over the levels: the keys a step
    // attended over, on average.
    const double mean_context =
        steps.load() > 0 ? static_cast<double>(kv_bytes.load()) / (2.0 * row_bytes * steps.load())
                         : 0.0;
    if (absl::GetFlag(FLAGS_json)) {
      std::printf(
          "{\"mode\": \"%s\", \"sessions\": %d, \"context\": %lld, \"clients\": %d, \"heads\": %d, "
          "\"kv_heads\": %d, \"head_dim\": %d, \"dtype\": \"%s\", \"steps\": %lld, "
          "\"steps_per_s\": %.1f, \"kv_read_gb_per_s\": %.3f, \"p50_ms\": %.3f, \"p90_ms\": %.3f, "
          "\"p99_ms\": %.3f, \"errors\": %lld, \"ingest_gb_per_s\": %.3f, "
          "\"mean_context\": %.0f}\n",
          stateless ? "stateless" : "sessions", n, static_cast<long long>(context_tokens), clients,
          heads, kv_heads, head_dim, v1::DType_Name(dtype).c_str(),
          static_cast<long long>(steps.load()), rate, kv_bytes.load() / seconds / 1e9, p50, p90,
          p99, static_cast<long long>(errors.load()), ingest_gbps, mean_context);
    } else {
      std::printf(
          "%-9s sessions %d x %lld tokens (mean %.0f attended), %d clients: %9.1f steps/s "
          "(%.1f tokens/s)  KV read %7.3f GB/s  p50 %7.3f ms  p90 %7.3f ms  p99 %7.3f ms  errors "
          "%lld%s\n",
          stateless ? "stateless" : "sessions", n, static_cast<long long>(context_tokens),
          mean_context, clients, rate, rate, kv_bytes.load() / seconds / 1e9, p50, p90, p99,
          static_cast<long long>(errors.load()),
          stateless ? "" : absl::StrFormat("  (ingest %.2f GB/s)", ingest_gbps).c_str());
    }
    std::fflush(stdout);
    if (errors.load() > 0) {
      std::fprintf(stderr, "first error: %s\n", first_error.c_str());
      exit_status = 1;
    }
  }
  if (!stateless) {
    for (const Sequence& seq : seqs) {
      grpc::ClientContext context;
      Prepare(factory, &context, seq.route);
      v1::DeleteSessionRequest r;
      r.set_session_id(seq.id);
      v1::DeleteSessionResponse response;
      (void)stubs.front()->DeleteSession(&context, r, &response);
    }
  }
  return exit_status;
}

}  // namespace attnserve::client
