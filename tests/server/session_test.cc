// KV sessions against the real server binary (CPU engine): sessions built by appends of odd
// sizes answer like one dense problem over the whole sequence (the float64 reference), decode
// steps with and without append, concurrent sessions batched together without mixing, and the
// edges: other identities, expiry, deletion during use, a full pool and its recovery, an append
// cancelled half-way, max_tokens, mismatched shapes, sessions spread over devices, SIGTERM.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attn/dtype.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "clients/cli/channel_factory.h"
#include "clients/cli/reference_check.h"
#include "clients/cli/session_client.h"
#include "proto/wire/request_decoder.h"
#include "tests/server/server_process.h"

namespace attnserve {
namespace {

using client::ChannelFactory;
using client::ChannelOptions;
using test_support::ServerProcess;

struct Client {
  std::unique_ptr<ChannelFactory> factory;
  std::unique_ptr<v1::AttentionService::Stub> stub;

  grpc::Status Attend(const v1::AttendRequest& request, v1::AttendResponse* response) const {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(60));
    return stub->Attend(&context, request, response);
  }
  grpc::Status Get(const std::string& id, v1::Session* session) const {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(10));
    v1::GetSessionRequest request;
    request.set_session_id(id);
    return stub->GetSession(&context, request, session);
  }
  v1::Session Create(int kv_heads, int head_dim, v1::DType dtype, int64_t max_tokens = 0,
                     int64_t ttl_seconds = 0) const {
    v1::CreateSessionRequest request;
    request.set_num_kv_heads(kv_heads);
    request.set_head_dim(head_dim);
    request.set_dtype(dtype);
    request.set_max_tokens(max_tokens);
    request.set_ttl_seconds(ttl_seconds);
    absl::StatusOr<v1::Session> session = client::CreateSession(*stub, *factory, request);
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? *session : v1::Session();
  }
  // Whether the server attends on a GPU (where the paged kernels take fp16 and bf16 only).
  bool OnGpu() const {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(10));
    v1::ServerInfo info;
    EXPECT_TRUE(stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
    return info.devices_size() > 0 && absl::StartsWith(info.devices(0).name(), "cuda:");
  }
};

Client ClientOf(const ServerProcess& server, const std::string& token = "") {
  ChannelOptions options;
  options.target = server.target();
  options.auth_token = token;
  Client c;
  c.factory = std::make_unique<ChannelFactory>(options);
  c.stub = v1::AttentionService::NewStub(*c.factory->Connect());
  return c;
}

std::unique_ptr<ServerProcess> Start(const std::vector<std::string>& extra) {
  std::vector<std::string> flags = {"--cpu_threads=1", "--metrics_address=", "--log_level=info"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  auto server = std::make_unique<ServerProcess>();
  EXPECT_TRUE(server->Start(ATTN_SERVER_BINARY, flags)) << server->log();
  return server;
}

// Random rows [tokens, heads, head_dim] of a dtype.
v1::Tensor Rows(v1::DType dtype, int64_t tokens, int heads, int head_dim, std::mt19937_64& rng) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : {tokens, int64_t{heads}, int64_t{head_dim}}) t.add_shape(d);
  const attn::DType dt = *FromProtoDType(dtype);
  const int64_t n = tokens * heads * head_dim;
  t.mutable_data()->resize(static_cast<size_t>(n * attn::DTypeSize(dt)));
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (int64_t i = 0; i < n; ++i)
    attn::StoreFromFloat(t.mutable_data()->data(), dt, i, uniform(rng));
  return t;
}

// What a session holds, kept on the client side for the reference.
struct History {
  v1::Tensor k, v;
  void Add(const v1::Tensor& k_rows, const v1::Tensor& v_rows) {
    k = client::ConcatRows(k, k_rows);
    v = client::ConcatRows(v, v_rows);
  }
};

void ExpectMatchesDense(const v1::AttendRequest& step, const v1::AttendResponse& response,
                        const History& all) {
  auto check = client::CheckAgainstReference(client::DenseEquivalent(step, all.k, all.v), response);
  EXPECT_TRUE(check.ok()) << check.status();
}

TEST(Sessions, AppendsOfOddSizesAnswerLikeTheDenseProblem) {
  auto server = Start({"--kv_page_bytes=4096"});  // 16-token pages at 2 KV heads x 32 x fp16
  Client c = ClientOf(*server);
  const bool on_gpu = c.OnGpu();
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    SCOPED_TRACE(v1::DType_Name(dtype));
    if (on_gpu && dtype == v1::DTYPE_FLOAT32) {
      v1::CreateSessionRequest fp32;
      fp32.set_num_kv_heads(2);
      fp32.set_head_dim(32);
      fp32.set_dtype(dtype);
      EXPECT_EQ(client::CreateSession(*c.stub, *c.factory, fp32).status().code(),
                absl::StatusCode::kFailedPrecondition);
      continue;
    }
    std::mt19937_64 rng(dtype * 101);
    const v1::Session session = c.Create(2, 32, dtype);
    History all;
    // AppendKV calls of odd sizes, one of them in several chunks.
    for (const auto& [tokens, chunk] :
         {std::pair<int64_t, int64_t>{1, 1}, {7, 3}, {16, 16}, {17, 5}, {1000, 128}}) {
      const v1::Tensor k = Rows(dtype, tokens, 2, 32, rng), v = Rows(dtype, tokens, 2, 32, rng);
      v1::AppendKVResponse appended;
      const grpc::Status status =
          client::AppendKV(*c.stub, *c.factory, session.session_id(), k, v, chunk, &appended);
      ASSERT_TRUE(status.ok()) << status.error_message();
      all.Add(k, v);
      EXPECT_EQ(appended.tokens_appended(), tokens);
      EXPECT_EQ(appended.session().tokens(), all.k.shape(0));
    }
    // A prefill chunk of 5 tokens that appends its own K/V, causal: it sees the cache and
    // itself up to its position; then a decode step without append.
    const v1::Tensor q = Rows(dtype, 5, 8, 32, rng);
    const v1::Tensor k5 = Rows(dtype, 5, 2, 32, rng), v5 = Rows(dtype, 5, 2, 32, rng);
    const v1::AttendRequest prefill = client::SessionStep(session.session_id(), q, &k5, &v5,
                                                          /*causal=*/true, /*return_lse=*/true);
    v1::AttendResponse response;
    ASSERT_TRUE(c.Attend(prefill, &response).ok());
    all.Add(k5, v5);
    ExpectMatchesDense(prefill, response, all);
    const v1::AttendRequest look = client::SessionStep(
        session.session_id(), Rows(dtype, 1, 8, 32, rng), nullptr, nullptr, /*causal=*/false, true);
    ASSERT_TRUE(c.Attend(look, &response).ok());
    ExpectMatchesDense(look, response, all);
    v1::Session now;
    ASSERT_TRUE(c.Get(session.session_id(), &now).ok());
    EXPECT_EQ(now.tokens(), 1046);
    EXPECT_EQ(now.pages(), (1046 + now.page_tokens() - 1) / now.page_tokens());
  }
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
}

TEST(Sessions, ConcurrentSessionsShareBatchesAndNeverMix) {
  auto server = Start({"--max_queue_delay=20ms"});
  Client c = ClientOf(*server);
  constexpr int kSessions = 8, kSteps = 6;
  std::vector<v1::Session> sessions;
  std::vector<History> histories(kSessions);
  std::mt19937_64 rng(7);
  for (int s = 0; s < kSessions; ++s) {
    sessions.push_back(c.Create(2, 64, v1::DTYPE_BFLOAT16));
    const int64_t context = 30 + 37 * s;
    const v1::Tensor k = Rows(v1::DTYPE_BFLOAT16, context, 2, 64, rng);
    const v1::Tensor v = Rows(v1::DTYPE_BFLOAT16, context, 2, 64, rng);
    v1::AppendKVResponse appended;
    ASSERT_TRUE(
        client::AppendKV(*c.stub, *c.factory, sessions[s].session_id(), k, v, 64, &appended).ok());
    histories[s].Add(k, v);
  }
  std::atomic<int> max_batch{0}, checked{0};
  absl::Mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> threads;
  for (int s = 0; s < kSessions; ++s) {
    threads.emplace_back([&, s] {
      std::mt19937_64 local(1000 + s);
      for (int i = 0; i < kSteps; ++i) {
        const v1::Tensor q = Rows(v1::DTYPE_BFLOAT16, 1, 8, 64, local);
        const v1::Tensor k1 = Rows(v1::DTYPE_BFLOAT16, 1, 2, 64, local);
        const v1::Tensor v1r = Rows(v1::DTYPE_BFLOAT16, 1, 2, 64, local);
        const v1::AttendRequest step =
            client::SessionStep(sessions[s].session_id(), q, &k1, &v1r, true, true);
        v1::AttendResponse response;
        const grpc::Status status = c.Attend(step, &response);
        histories[s].Add(k1, v1r);
        auto check =
            status.ok()
                ? client::CheckAgainstReference(
                      client::DenseEquivalent(step, histories[s].k, histories[s].v), response)
                : absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                               status.error_message());
        absl::MutexLock lock(&mu);
        if (!check.ok()) {
          failures.push_back(
              absl::StrCat("session ", s, " step ", i, ": ", check.status().ToString()));
        } else {
          ++checked;
          max_batch = std::max(max_batch.load(), response.batch().requests());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_EQ(checked.load(), kSessions * kSteps);
  EXPECT_GT(max_batch.load(), 1) << "steps of different sessions never shared a launch";
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
}

TEST(Sessions, BelongToTheirIdentity) {
  char path[] = "/tmp/attnserve-session-tokens-XXXXXX";
  const int fd = mkstemp(path);
  close(fd);
  std::ofstream(path) << "alice tok-alice-0001\nbob tok-bob-00001\n";
  auto server = Start({absl::StrCat("--auth_token_file=", path)});
  Client alice = ClientOf(*server, "tok-alice-0001"), bob = ClientOf(*server, "tok-bob-00001");
  const v1::Session session = alice.Create(1, 32, v1::DTYPE_FLOAT16);
  std::mt19937_64 rng(3);
  v1::Session got;
  const grpc::Status bob_get = bob.Get(session.session_id(), &got);
  const grpc::Status bob_unknown = bob.Get("00000000000000000000000000000000", &got);
  v1::AttendResponse response;
  const grpc::Status bob_attend =
      bob.Attend(client::SessionStep(session.session_id(), Rows(v1::DTYPE_FLOAT16, 1, 1, 32, rng),
                                     nullptr, nullptr, false, false),
                 &response);
  v1::AppendKVResponse appended;
  const grpc::Status bob_append = client::AppendKV(
      *bob.stub, *bob.factory, session.session_id(), Rows(v1::DTYPE_FLOAT16, 2, 1, 32, rng),
      Rows(v1::DTYPE_FLOAT16, 2, 1, 32, rng), 8, &appended);
  const grpc::Status bob_delete =
      client::DeleteSession(*bob.stub, *bob.factory, session.session_id());
  for (const grpc::Status& s : {bob_get, bob_attend, bob_append, bob_delete}) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
    EXPECT_EQ(s.error_message(), bob_unknown.error_message());  // ids cannot be probed
  }
  grpc::ClientContext context;
  bob.factory->Prepare(&context, absl::Seconds(10));
  v1::ListSessionsResponse list;
  ASSERT_TRUE(bob.stub->ListSessions(&context, {}, &list).ok());
  EXPECT_EQ(list.sessions_size(), 0);
  EXPECT_TRUE(alice.Get(session.session_id(), &got).ok());
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
  std::remove(path);
}

TEST(Sessions, IdleSessionsExpire) {
  auto server = Start({"--session_ttl=1s"});
  Client c = ClientOf(*server);
  const v1::Session fast = c.Create(1, 32, v1::DTYPE_FLOAT16);
  const v1::Session slow = c.Create(1, 32, v1::DTYPE_FLOAT16, 0, /*ttl_seconds=*/60);
  absl::SleepFor(absl::Milliseconds(2500));
  v1::Session got;
  EXPECT_EQ(c.Get(fast.session_id(), &got).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(c.Get(slow.session_id(), &got).ok());
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
  EXPECT_TRUE(
      absl::StrContains(server->log(), absl::StrCat("session ", fast.session_id(), " expired")))
      << server->log();
}

TEST(Sessions, AFullPoolRefusesAndRecovers) {
  // 8 pages of 2 KiB; at 2 KV heads x 32 x fp16 a page holds 8 tokens: 64 tokens in all.
  // (fp16: the paged kernels of a GPU server take it too.)
  auto server = Start({"--kv_page_bytes=2048", "--kv_pool_bytes=16384"});
  Client c = ClientOf(*server);
  std::mt19937_64 rng(5);
  const v1::Session a = c.Create(2, 32, v1::DTYPE_FLOAT16);
  const v1::Session b = c.Create(2, 32, v1::DTYPE_FLOAT16);
  v1::AppendKVResponse appended;
  ASSERT_TRUE(client::AppendKV(*c.stub, *c.factory, a.session_id(),
                               Rows(v1::DTYPE_FLOAT16, 40, 2, 32, rng),
                               Rows(v1::DTYPE_FLOAT16, 40, 2, 32, rng), 16, &appended)
                  .ok());
  // 30 more do not fit beside a's 40 (5 pages): refused, and b is as it was (empty).
  const grpc::Status full =
      client::AppendKV(*c.stub, *c.factory, b.session_id(), Rows(v1::DTYPE_FLOAT16, 30, 2, 32, rng),
                       Rows(v1::DTYPE_FLOAT16, 30, 2, 32, rng), 8, &appended);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << full.error_message();
  EXPECT_TRUE(absl::StrContains(full.error_message(), "bytes asked")) << full.error_message();
  v1::Session got;
  ASSERT_TRUE(c.Get(b.session_id(), &got).ok());
  EXPECT_EQ(got.tokens(), 0);
  EXPECT_EQ(got.pages(), 0);
  // Deleting a gives its pages back: now they fit.
  ASSERT_TRUE(client::DeleteSession(*c.stub, *c.factory, a.session_id()).ok());
  EXPECT_TRUE(client::AppendKV(*c.stub, *c.factory, b.session_id(),
                               Rows(v1::DTYPE_FLOAT16, 30, 2, 32, rng),
                               Rows(v1::DTYPE_FLOAT16, 30, 2, 32, rng), 8, &appended)
                  .ok());
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
}

TEST(Sessions, AnAppendCancelledHalfWayLeavesTheSessionAsItWas) {
  auto server = Start({"--kv_page_bytes=2048", "--kv_pool_bytes=16384"});
  Client c = ClientOf(*server);
  std::mt19937_64 rng(9);
  const v1::Session s = c.Create(2, 32, v1::DTYPE_FLOAT16);
  History all;
  const v1::Tensor k = Rows(v1::DTYPE_FLOAT16, 10, 2, 32, rng),
                   v = Rows(v1::DTYPE_FLOAT16, 10, 2, 32, rng);
  v1::AppendKVResponse appended;
  ASSERT_TRUE(client::AppendKV(*c.stub, *c.factory, s.session_id(), k, v, 4, &appended).ok());
  all.Add(k, v);
  {
    grpc::ClientContext context;
    c.factory->Prepare(&context, absl::Seconds(30));
    v1::AppendKVResponse response;
    auto writer = c.stub->AppendKV(&context, &response);
    for (int i = 0; i < 3; ++i) {
      v1::AppendKVRequest chunk;
      if (i == 0) chunk.set_session_id(s.session_id());
      *chunk.mutable_k() = Rows(v1::DTYPE_FLOAT16, 8, 2, 32, rng);
      *chunk.mutable_v() = Rows(v1::DTYPE_FLOAT16, 8, 2, 32, rng);
      ASSERT_TRUE(writer->Write(chunk));
    }
    absl::SleepFor(absl::Milliseconds(200));  // the chunks reach the pages
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  absl::SleepFor(absl::Milliseconds(200));
  v1::Session got;
  ASSERT_TRUE(c.Get(s.session_id(), &got).ok());
  EXPECT_EQ(got.tokens(), 10);
  // Its pages went back: the pool still takes 54 more tokens (8 pages x 8 - 10).
  const v1::Tensor k54 = Rows(v1::DTYPE_FLOAT16, 54, 2, 32, rng);
  const v1::Tensor v54 = Rows(v1::DTYPE_FLOAT16, 54, 2, 32, rng);
  ASSERT_TRUE(client::AppendKV(*c.stub, *c.factory, s.session_id(), k54, v54, 16, &appended).ok());
  all.Add(k54, v54);
  // And what the session holds is exactly what was committed, the cancelled rows nowhere.
  const v1::AttendRequest step = client::SessionStep(
      s.session_id(), Rows(v1::DTYPE_FLOAT16, 1, 2, 32, rng), nullptr, nullptr, false, true);
  v1::AttendResponse response;
  ASSERT_TRUE(c.Attend(step, &response).ok());
  ExpectMatchesDense(step, response, all);
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
}

TEST(Sessions, ADeletedSessionFinishesWhatRunsAndGivesItsPagesBack) {
  // 8 pages of 2 KiB; at 2 KV heads x 32 x fp16 a page holds 8 tokens: 64 tokens in all.
  auto server = Start({"--kv_page_bytes=2048", "--kv_pool_bytes=16384"});
  Client c = ClientOf(*server);
  std::mt19937_64 rng(21);
  const v1::Session s = c.Create(2, 32, v1::DTYPE_FLOAT16);
  History all;
  const v1::Tensor k = Rows(v1::DTYPE_FLOAT16, 40, 2, 32, rng),
                   v = Rows(v1::DTYPE_FLOAT16, 40, 2, 32, rng);
  v1::AppendKVResponse appended;
  ASSERT_TRUE(client::AppendKV(*c.stub, *c.factory, s.session_id(), k, v, 16, &appended).ok());
  all.Add(k, v);

  // Four clients step the session until it is gone: every answer is right, or NOT_FOUND.
  std::atomic<int> answered{0}, not_found{0};
  absl::Mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> steppers;
  for (int t = 0; t < 4; ++t) {
    steppers.emplace_back([&, t] {
      std::mt19937_64 local(100 + t);
      for (;;) {
        const v1::AttendRequest step =
            client::SessionStep(s.session_id(), Rows(v1::DTYPE_FLOAT16, 1, 4, 32, local), nullptr,
                                nullptr, /*causal=*/false, /*return_lse=*/true);
        v1::AttendResponse response;
        const grpc::Status status = c.Attend(step, &response);
        if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
          ++not_found;
          return;
        }
        absl::StatusOr<client::CheckResult> check =
            status.ok() ? client::CheckAgainstReference(client::DenseEquivalent(step, all.k, all.v),
                                                        response)
                        : absl::UnknownError(status.error_message());
        if (!check.ok()) {
          absl::MutexLock lock(&mu);
          failures.push_back(std::string(check.status().message()));
          return;
        }
        ++answered;
      }
    });
  }
  // And an append open on it, one chunk in.
  grpc::ClientContext context;
  c.factory->Prepare(&context, absl::Seconds(30));
  v1::AppendKVResponse append_response;
  auto writer = c.stub->AppendKV(&context, &append_response);
  v1::AppendKVRequest chunk;
  chunk.set_session_id(s.session_id());
  *chunk.mutable_k() = Rows(v1::DTYPE_FLOAT16, 8, 2, 32, rng);
  *chunk.mutable_v() = Rows(v1::DTYPE_FLOAT16, 8, 2, 32, rng);
  ASSERT_TRUE(writer->Write(chunk));
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (answered.load() < 20 && failures.empty() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_TRUE(client::DeleteSession(*c.stub, *c.factory, s.session_id()).ok());
  for (auto& t : steppers) t.join();
  chunk.clear_session_id();
  writer->Write(chunk);  // the server may already have ended the call
  writer->WritesDone();
  const grpc::Status append_status = writer->Finish();
  EXPECT_EQ(append_status.error_code(), grpc::StatusCode::NOT_FOUND)
      << append_status.error_message();
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_GE(answered.load(), 20);
  EXPECT_EQ(not_found.load(), 4);

  // Every page came back once the last use ended: a new session takes the whole pool.
  const v1::Session whole = c.Create(2, 32, v1::DTYPE_FLOAT16);
  const v1::Tensor k64 = Rows(v1::DTYPE_FLOAT16, 64, 2, 32, rng),
                   v64 = Rows(v1::DTYPE_FLOAT16, 64, 2, 32, rng);
  grpc::Status filled;
  for (const absl::Time end = absl::Now() + absl::Seconds(5); absl::Now() < end;) {
    filled = client::AppendKV(*c.stub, *c.factory, whole.session_id(), k64, v64, 16, &appended);
    if (filled.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) break;
    absl::SleepFor(absl::Milliseconds(20));  // the append's call may still be ending
  }
  EXPECT_TRUE(filled.ok()) << filled.error_message();
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
}

TEST(Sessions, WrongShapesAndLimitsAreNamed) {
  auto server = Start({});
  Client c = ClientOf(*server);
  std::mt19937_64 rng(11);
  const v1::Session s = c.Create(2, 32, v1::DTYPE_FLOAT16, /*max_tokens=*/20);
  auto expect = [&](const v1::AttendRequest& r, grpc::StatusCode code, const std::string& field) {
    v1::AttendResponse response;
    const grpc::Status status = c.Attend(r, &response);
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_TRUE(absl::StartsWith(status.error_message(), field)) << status.error_message();
  };
  const v1::Tensor q = Rows(v1::DTYPE_FLOAT16, 1, 4, 32, rng);
  expect(client::SessionStep(s.session_id(), Rows(v1::DTYPE_FLOAT32, 1, 4, 32, rng), nullptr,
                             nullptr, false, false),
         grpc::StatusCode::INVALID_ARGUMENT, "q.dtype");
  expect(client::SessionStep(s.session_id(), Rows(v1::DTYPE_FLOAT16, 1, 4, 64, rng), nullptr,
                             nullptr, false, false),
         grpc::StatusCode::INVALID_ARGUMENT, "q.shape[2]");
  expect(client::SessionStep(s.session_id(), Rows(v1::DTYPE_FLOAT16, 1, 3, 32, rng), nullptr,
                             nullptr, false, false),
         grpc::StatusCode::INVALID_ARGUMENT, "q.shape[1]");
  const v1::Tensor wrong_kv = Rows(v1::DTYPE_FLOAT16, 1, 1, 32, rng);
  expect(client::SessionStep(s.session_id(), q, &wrong_kv, &wrong_kv, false, false),
         grpc::StatusCode::INVALID_ARGUMENT, "k.shape");
  expect(client::SessionStep("ffffffffffffffffffffffffffffffff", q, nullptr, nullptr, false, false),
         grpc::StatusCode::NOT_FOUND, "session_id");
  // Past max_tokens: 20 fit, 21 do not.
  v1::AppendKVResponse appended;
  ASSERT_TRUE(client::AppendKV(*c.stub, *c.factory, s.session_id(),
                               Rows(v1::DTYPE_FLOAT16, 20, 2, 32, rng),
                               Rows(v1::DTYPE_FLOAT16, 20, 2, 32, rng), 8, &appended)
                  .ok());
  const v1::Tensor one_k = Rows(v1::DTYPE_FLOAT16, 1, 2, 32, rng);
  expect(client::SessionStep(s.session_id(), q, &one_k, &one_k, true, false),
         grpc::StatusCode::FAILED_PRECONDITION, "session_id");
  v1::CreateSessionRequest bad;
  bad.set_num_kv_heads(0);
  bad.set_head_dim(32);
  bad.set_dtype(v1::DTYPE_FLOAT16);
  EXPECT_EQ(client::CreateSession(*c.stub, *c.factory, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::AttendResponse response;
  EXPECT_TRUE(c.Attend(client::SessionStep(s.session_id(), q, nullptr, nullptr, true, false),
                       &response)
                  .ok());  // the server kept serving
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
}

TEST(Sessions, SpreadOverDevicesAndDrainOnSigterm) {
  auto server = Start({"--devices=0,1"});
  Client c = ClientOf(*server);
  std::mt19937_64 rng(13);
  std::set<std::string> devices;
  std::vector<std::pair<v1::Session, History>> sessions;
  for (int i = 0; i < 4; ++i) {
    const v1::Session s = c.Create(1, 32, v1::DTYPE_FLOAT32);
    devices.insert(s.device());
    History h;
    const v1::Tensor k = Rows(v1::DTYPE_FLOAT32, 50, 1, 32, rng),
                     v = Rows(v1::DTYPE_FLOAT32, 50, 1, 32, rng);
    v1::AppendKVResponse appended;
    ASSERT_TRUE(client::AppendKV(*c.stub, *c.factory, s.session_id(), k, v, 50, &appended).ok());
    h.Add(k, v);
    sessions.push_back({s, h});
  }
  EXPECT_EQ(devices, (std::set<std::string>{"cpu:0", "cpu:1"}));
  // Sessions created before any of them is filled hold no pages yet: they alternate too.
  std::map<std::string, int> empty_per_device;
  for (int i = 0; i < 6; ++i) ++empty_per_device[c.Create(1, 32, v1::DTYPE_FLOAT32).device()];
  EXPECT_EQ(empty_per_device, (std::map<std::string, int>{{"cpu:0", 3}, {"cpu:1", 3}}));
  for (const auto& [s, h] : sessions) {
    const v1::AttendRequest step = client::SessionStep(
        s.session_id(), Rows(v1::DTYPE_FLOAT32, 2, 2, 32, rng), nullptr, nullptr, true, true);
    v1::AttendResponse response;
    ASSERT_TRUE(c.Attend(step, &response).ok());
    ExpectMatchesDense(step, response, h);
  }
  // Sessions open at SIGTERM: the drain ends at once, exit 0.
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
}

}  // namespace
}  // namespace attnserve
