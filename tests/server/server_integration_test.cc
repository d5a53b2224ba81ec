// Integration tests: the real attnserve binary on an ephemeral loopback port (CPU engine),
// driven through the real client library and generated stubs.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attn/dtype.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "clients/cli/channel_factory.h"
#include "clients/cli/reference_check.h"
#include "clients/cli/request_factory.h"
#include "clients/cli/shared_memory_buffer.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/server/server_process.h"

namespace attnserve {
namespace {

using client::ChannelFactory;
using client::ChannelOptions;
using client::ShapeSpec;

// Runs a shell command and returns its standard output; fails the test on a non-zero exit.
std::string RunAndCapture(const std::string& command) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "popen failed: " << command;
    return out;
  }
  char buffer[4096];
  size_t n = 0;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  const int status = pclose(pipe);
  EXPECT_EQ(status, 0) << command << "\n" << out;
  return out;
}
using test_support::ServerProcess;

// Servers in these tests use one CPU thread: the build machine has two cores for everything.
const std::vector<std::string> kBaseFlags = {"--cpu_threads=1", "--log_level=info"};

struct Connection {
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<ChannelFactory> factory;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::AttentionService::Stub> stub;

  grpc::Status Attend(const v1::AttendRequest& request, v1::AttendResponse* response,
                      absl::Duration timeout = absl::Seconds(30)) {
    grpc::ClientContext context;
    factory->Prepare(&context, timeout);
    return stub->Attend(&context, request, response);
  }
  grpc::Status Backward(const v1::AttendBackwardRequest& request,
                        v1::AttendBackwardResponse* response) {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(60));
    return stub->AttendBackward(&context, request, response);
  }
  v1::ServerInfo Info() {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(10));
    v1::ServerInfo info;
    const grpc::Status status = stub->GetServerInfo(&context, {}, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info;
  }
};

Connection Connect(const std::vector<std::string>& extra_flags, ChannelOptions options = {},
                   bool start = true) {
  Connection c;
  std::vector<std::string> flags = kBaseFlags;
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  c.server = std::make_unique<ServerProcess>();
  if (start) {
    const bool up = c.server->Start(ATTN_SERVER_BINARY, flags);
    EXPECT_TRUE(up) << c.server->log();
    options.target = c.server->target();
  }
  c.factory = std::make_unique<ChannelFactory>(options);
  c.channel = *c.factory->Connect();
  c.stub = v1::AttentionService::NewStub(c.channel);
  return c;
}

ShapeSpec Shape(attn::DType dtype, int batch, int64_t lq, int64_t lk, int h, int hkv, int d,
                bool causal, bool varlen, bool lse) {
  ShapeSpec s;
  s.dtype = dtype;
  s.batch = batch;
  s.seqlen_q = lq;
  s.seqlen_k = lk;
  s.num_heads = h;
  s.num_kv_heads = hkv;
  s.head_dim = d;
  s.causal = causal;
  s.varlen = varlen;
  s.return_lse = lse;
  return s;
}

TEST(ServerIntegration, ConcurrentClientsWithDifferentShapesGetTheirOwnAnswers) {
  // A long queue delay makes batches form even on a busy two-core machine. (Parallel copies
  // start at 4 MiB per batch; LargeBatchCopiesSplitOverLaneThreads covers them.)
  Connection c = Connect({"--max_queue_delay=30ms", "--max_batch_requests=16"});
  // Threads in the same group are batch-compatible with each other but differ in lengths.
  const std::vector<ShapeSpec> shapes = {
      Shape(attn::DType::kF32, 1, 17, 33, 4, 4, 32, false, false, true),
      Shape(attn::DType::kF32, 2, 5, 9, 4, 4, 32, false, false, false),
      Shape(attn::DType::kF32, 3, 13, 13, 4, 4, 32, false, true, true),
      Shape(attn::DType::kF32, 1, 1, 40, 4, 4, 32, false, false, false),
      Shape(attn::DType::kBF16, 2, 16, 16, 8, 2, 64, true, true, true),
      Shape(attn::DType::kBF16, 1, 7, 21, 8, 2, 64, true, false, false),
      Shape(attn::DType::kF16, 1, 9, 30, 2, 1, 128, false, false, true),
      Shape(attn::DType::kF16, 2, 3, 8, 2, 1, 128, false, true, false),
  };
  constexpr int kRequestsPerThread = 6;
  std::atomic<int> ok{0}, mismatches{0}, rpc_errors{0}, max_batch{0}, timed{0};
  std::vector<std::thread> threads;
  absl::Mutex mu;
  std::vector<std::string> failures;
  for (size_t t = 0; t < shapes.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRequestsPerThread; ++i) {
        const std::string id = absl::StrCat("t", t, "-", i);
        const v1::AttendRequest request = client::MakeRandomRequest(shapes[t], t * 1000 + i, id);
        v1::AttendResponse response;
        const grpc::Status status = c.Attend(request, &response);
        if (!status.ok()) {
          ++rpc_errors;
          absl::MutexLock lock(&mu);
          failures.push_back(absl::StrCat(id, ": ", status.error_message()));
          continue;
        }
        auto check = client::CheckAgainstReference(request, response);
        if (!check.ok() || response.request_id() != id) {
          ++mismatches;
          absl::MutexLock lock(&mu);
          failures.push_back(absl::StrCat(id, ": ", check.status().ToString()));
          continue;
        }
        ++ok;
        const v1::Timing& timing = response.timing();
        if (timing.kernel_us() > 0) ++timed;
        EXPECT_LE(timing.kernel_us(), timing.compute_us()) << id;
        EXPECT_LE(timing.queue_us() + timing.compute_us(), timing.total_us()) << id;
        int seen = max_batch.load();
        while (response.batch().requests() > seen &&
               !max_batch.compare_exchange_weak(seen, response.batch().requests())) {
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_EQ(ok.load(), static_cast<int>(shapes.size()) * kRequestsPerThread);
  EXPECT_GT(max_batch.load(), 1) << "no request ever shared a batch";
  EXPECT_GT(timed.load(), 0) << "no response carried the engine call's time (kernel_us)";
  const v1::ServerInfo info = c.Info();
  EXPECT_GT(info.stats().batched_requests(), 0u);
  EXPECT_LT(info.stats().batches(), info.stats().requests_completed());
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

TEST(ServerIntegration, SharedMemoryTensorsMatchTheReference) {
  Connection c = Connect({"--max_queue_delay=30ms", "--max_batch_requests=16"});
  EXPECT_TRUE(c.Info().shared_memory());
  constexpr int kThreads = 4, kRequestsPerThread = 4;
  constexpr int64_t kArea = 256 << 10;  // per thread: its request's Q, K, V and O
  auto buffer = client::SharedMemoryBuffer::Create(kThreads * kArea);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const grpc::Status registered =
      client::RegisterSharedMemory(*c.stub, *c.factory, "tensors", **buffer);
  ASSERT_TRUE(registered.ok()) << registered.error_message();

  // One batch-compatible shape family with different lengths; threads 0 and 1 send everything
  // by reference, thread 2 only the inputs, thread 3 everything inline: all batch together.
  std::atomic<int> ok{0}, max_batch{0};
  absl::Mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRequestsPerThread; ++i) {
        const std::string id = absl::StrCat("shm", t, "-", i);
        const v1::AttendRequest request =
            client::MakeRandomRequest(Shape(attn::DType::kF16, 1 + i % 2, 9 + t, 20 + 3 * i, 4, 2,
                                            64, t % 2 == 1, false, true),
                                      7000 + t * 100 + i, id);
        v1::AttendRequest sent = request;
        int64_t offset = t * kArea;
        if (t < 3) {
          for (v1::Tensor* x : {sent.mutable_q(), sent.mutable_k(), sent.mutable_v()}) {
            ASSERT_TRUE(client::MoveToSharedMemory(x, "tensors", **buffer, &offset).ok());
          }
        }
        if (t < 2) {
          v1::SharedMemoryRef& o = *sent.mutable_o_shared_memory();
          o.set_region("tensors");
          o.set_offset(static_cast<uint64_t>(client::SharedMemoryAlignUp(offset)));
          o.set_byte_size(request.q().data().size());
        }
        v1::AttendResponse response;
        const grpc::Status status = c.Attend(sent, &response);
        absl::MutexLock lock(&mu);
        if (!status.ok()) {
          failures.push_back(absl::StrCat(id, ": ", status.error_message()));
          continue;
        }
        if (t < 2) {
          // O is in the region; the response says where and carries no bytes.
          EXPECT_TRUE(response.o().data().empty()) << id;
          EXPECT_EQ(response.o().shared_memory().offset(), sent.o_shared_memory().offset()) << id;
          auto o = client::ReadSharedMemory(response.o().shared_memory(), **buffer);
          ASSERT_TRUE(o.ok()) << o.status();
          response.mutable_o()->clear_shared_memory();
          response.mutable_o()->set_data(*o);
        }
        auto check = client::CheckAgainstReference(request, response);
        if (!check.ok()) {
          failures.push_back(absl::StrCat(id, ": ", check.status().ToString()));
          continue;
        }
        ++ok;
        max_batch = std::max(max_batch.load(), response.batch().requests());
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_EQ(ok.load(), kThreads * kRequestsPerThread);
  EXPECT_GT(max_batch.load(), 1) << "shared-memory requests never shared a batch";

  // Unregistered: the same reference is now an error naming the field; the server stays up.
  const grpc::Status unregistered = client::UnregisterSharedMemory(*c.stub, *c.factory, "tensors");
  ASSERT_TRUE(unregistered.ok()) << unregistered.error_message();
  v1::AttendRequest stale = client::MakeRandomRequest(
      Shape(attn::DType::kF16, 1, 4, 4, 4, 2, 64, false, false, false), 1);
  int64_t offset = 0;
  ASSERT_TRUE(client::MoveToSharedMemory(stale.mutable_q(), "tensors", **buffer, &offset).ok());
  v1::AttendResponse response;
  grpc::Status status = c.Attend(stale, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "q.shared_memory.region"))
      << status.error_message();
  // Registration by name is refused (the server would open the object with its own rights), as
  // is a token that the socket never gave out.
  v1::RegisterSharedMemoryRequest by_name;
  by_name.set_name("by-name");
  by_name.set_key("/attnserve-test-object");
  by_name.set_byte_size(64);
  v1::RegisterSharedMemoryRequest bad_token = by_name;
  bad_token.clear_key();
  bad_token.set_fd_token("00112233445566778899aabbccddeeff");
  for (const auto& [request, code, field] :
       {std::tuple{&by_name, grpc::StatusCode::INVALID_ARGUMENT, "key"},
        std::tuple{&bad_token, grpc::StatusCode::NOT_FOUND, "fd_token"}}) {
    grpc::ClientContext context;
    c.factory->Prepare(&context, absl::Seconds(10));
    v1::RegisterSharedMemoryResponse registered_response;
    status = c.stub->RegisterSharedMemory(&context, *request, &registered_response);
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_TRUE(absl::StartsWith(status.error_message(), field)) << status.error_message();
  }
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

// The first IPv4 address of this machine that is not a loopback one; empty when there is none.
std::string NonLoopbackAddress() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if ((a->ifa_flags & IFF_LOOPBACK) != 0 || (a->ifa_flags & IFF_UP) == 0) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
    found = text;
  }
  freeifaddrs(list);
  return found;
}

TEST(ServerIntegration, SharedMemoryIsOnlyForLoopbackPeers) {
  const std::string address = NonLoopbackAddress();
  if (address.empty()) GTEST_SKIP() << "this machine has no non-loopback IPv4 address";
  Connection c = Connect({"--listen=0.0.0.0:0"});
  ChannelOptions options;
  options.target = absl::StrCat(address, ":", c.server->port());
  ChannelFactory factory(options);
  auto channel = factory.Connect();
  ASSERT_TRUE(channel.ok());
  auto stub = v1::AttentionService::NewStub(*channel);
  auto buffer = client::SharedMemoryBuffer::Create(4096);
  ASSERT_TRUE(buffer.ok());
  // Through the machine's own network address the peer is not a loopback one: refused.
  const grpc::Status refused = client::RegisterSharedMemory(*stub, factory, "r", **buffer);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED) << refused.error_message();
  // Over loopback the same registration is accepted.
  auto local = client::SharedMemoryBuffer::Create(4096);
  ASSERT_TRUE(local.ok());
  const grpc::Status accepted = client::RegisterSharedMemory(*c.stub, *c.factory, "r", **local);
  EXPECT_TRUE(accepted.ok()) << accepted.error_message();
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

TEST(ServerIntegration, SharedMemoryCanBeSwitchedOff) {
  Connection c = Connect({"--shared_memory=false"});
  EXPECT_FALSE(c.Info().shared_memory());
  auto buffer = client::SharedMemoryBuffer::Create(4096);
  ASSERT_TRUE(buffer.ok());
  const grpc::Status status = client::RegisterSharedMemory(*c.stub, *c.factory, "r", **buffer);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  v1::AttendRequest request = client::MakeRandomRequest(
      Shape(attn::DType::kF32, 1, 4, 4, 2, 2, 32, false, false, false), 2);
  int64_t offset = 0;
  ASSERT_TRUE(client::MoveToSharedMemory(request.mutable_v(), "r", **buffer, &offset).ok());
  v1::AttendResponse response;
  const grpc::Status attend = c.Attend(request, &response);
  EXPECT_EQ(attend.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(attend.error_message(), "v.shared_memory"))
      << attend.error_message();
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

TEST(ServerIntegration, LargeBatchCopiesSplitOverLaneThreads) {
  // Three requests of 2 MiB of Q each, held into one batch: 7.5 MiB staged and 6 MiB of O
  // copied out, both past the 4 MiB at which the copies are chunked over the lane's threads.
  Connection c = Connect({"--max_queue_delay=500ms", "--max_batch_requests=3", "--lane_threads=3"});
  constexpr int kRequests = 3;
  std::atomic<int> ok{0}, shared{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kRequests; ++t) {
    threads.emplace_back([&, t] {
      const ShapeSpec shape =
          Shape(attn::DType::kF32, 1, 1024 - 64 * t, 128, 8, 8, 64, t == 1, false, t == 2);
      const v1::AttendRequest request =
          client::MakeRandomRequest(shape, 500 + t, absl::StrCat("big-", t));
      v1::AttendResponse response;
      const grpc::Status status = c.Attend(request, &response);
      ASSERT_TRUE(status.ok()) << status.error_message();
      auto check = client::CheckAgainstReference(request, response);
      EXPECT_TRUE(check.ok()) << "big-" << t << ": " << check.status();
      if (check.ok()) ++ok;
      if (response.batch().requests() > 1) ++shared;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), kRequests);
  EXPECT_GT(shared.load(), 0) << "the requests never shared a batch";
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

TEST(ServerIntegration, BackwardGradientsMatchTheReference) {
  // The training endpoint under forward traffic: the held forward requests batch with each
  // other, the backward ones run alone, and every answer is checked for its own input.
  Connection c = Connect({"--max_queue_delay=20ms", "--max_batch_requests=8"});
  const v1::ServerInfo info = c.Info();
  ASSERT_EQ(info.backward_engines_size(), 1);
  EXPECT_EQ(info.backward_engines(0), "cpu_tiled");
  const std::vector<ShapeSpec> shapes = {
      Shape(attn::DType::kF32, 2, 33, 47, 4, 2, 32, true, false, false),
      Shape(attn::DType::kF32, 3, 20, 40, 4, 1, 64, false, true, false),
      Shape(attn::DType::kBF16, 1, 65, 65, 2, 2, 64, true, false, false),
      Shape(attn::DType::kF16, 2, 17, 9, 4, 4, 128, false, true, false),
  };
  std::atomic<int> checked{0};
  std::vector<std::thread> threads;
  for (size_t t = 0; t < shapes.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2; ++i) {
        v1::AttendBackwardRequest request = client::MakeRandomBackwardRequest(
            shapes[t], 70 + t * 10 + i, absl::StrCat("bw-", t, "-", i));
        if (t == 0 && i == 0) request.mutable_forward()->set_window_left(7);
        if (i == 1) {  // the client kept O and the LSE of its forward pass
          v1::AttendRequest forward = request.forward();
          forward.set_return_lse(true);
          v1::AttendResponse out;
          ASSERT_TRUE(c.Attend(forward, &out).ok());
          *request.mutable_o() = out.o();
          *request.mutable_lse() = out.lse();
        }
        v1::AttendBackwardResponse response;
        const grpc::Status status = c.Backward(request, &response);
        ASSERT_TRUE(status.ok()) << status.error_message();
        EXPECT_EQ(response.request_id(), request.forward().request_id());
        EXPECT_EQ(response.path(), v1::PATH_CPU);
        auto check = client::CheckBackwardAgainstReference(request, response);
        EXPECT_TRUE(check.ok()) << request.forward().request_id() << ": " << check.status();
        if (check.ok()) ++checked;
      }
    });
  }
  // Forward traffic alongside.
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 4; ++i) {
        const v1::AttendRequest request = client::MakeRandomRequest(
            Shape(attn::DType::kF32, 1, 24, 24, 4, 2, 32, false, false, false), 900 + t * 10 + i);
        v1::AttendResponse response;
        ASSERT_TRUE(c.Attend(request, &response).ok());
        EXPECT_TRUE(client::CheckAgainstReference(request, response).ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(checked.load(), 2 * static_cast<int>(shapes.size()));

  // The check can fail: one wrong element of dK is caught.
  v1::AttendBackwardRequest request = client::MakeRandomBackwardRequest(shapes[0], 5, "bw-x");
  v1::AttendBackwardResponse response;
  ASSERT_TRUE(c.Backward(request, &response).ok());
  ASSERT_TRUE(client::CheckBackwardAgainstReference(request, response).ok());
  std::string& dk = *response.mutable_d_k()->mutable_data();
  attn::StoreFromFloat(dk.data(), attn::DType::kF32, 3,
                       attn::LoadAsFloat(dk.data(), attn::DType::kF32, 3) + 0.01f);
  EXPECT_FALSE(client::CheckBackwardAgainstReference(request, response).ok());
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

TEST(ServerIntegration, BackwardRequestsDoNotWaitForABatch) {
  // A held batch never forms around a backward request (it runs alone), so a long
  // --max_queue_delay must not hold it.
  Connection c = Connect({"--max_queue_delay=3s", "--max_batch_requests=8"});
  const v1::AttendBackwardRequest request = client::MakeRandomBackwardRequest(
      Shape(attn::DType::kF32, 1, 16, 16, 2, 2, 16, false, false, false), 11, "alone");
  v1::AttendBackwardResponse response;
  const absl::Time start = absl::Now();
  ASSERT_TRUE(c.Backward(request, &response).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_LT(response.timing().queue_us(), 1'000'000);
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

// A deterministic backward gives the same bytes every time and for any thread count: the CPU
// engine runs with several threads, whose dQ additions race in the default mode (each sequence
// spans four key blocks), and every answer must equal the first. --deterministic_backward makes
// every request deterministic, asked or not.
TEST(ServerIntegration, DeterministicBackwardGivesTheSameBytesEveryTime) {
  const ShapeSpec shape = Shape(attn::DType::kF32, 2, 384, 512, 4, 1, 32, false, false, false);
  v1::AttendBackwardRequest request = client::MakeRandomBackwardRequest(shape, 21, "det");
  request.set_deterministic(true);
  v1::AttendBackwardRequest plain = request;
  plain.set_deterministic(false);
  auto gradients = [](const v1::AttendBackwardResponse& r) {
    return std::make_tuple(r.d_q().data(), r.d_k().data(), r.d_v().data());
  };

  Connection c = Connect({"--cpu_threads=4"});
  EXPECT_FALSE(c.Info().deterministic_backward());
  v1::AttendBackwardResponse first;
  ASSERT_TRUE(c.Backward(request, &first).ok());
  EXPECT_TRUE(first.deterministic());
  const auto check = client::CheckBackwardAgainstReference(request, first);
  EXPECT_TRUE(check.ok()) << check.status();
  for (int run = 1; run < 4; ++run) {
    v1::AttendBackwardResponse again;
    ASSERT_TRUE(c.Backward(request, &again).ok());
    EXPECT_TRUE(again.deterministic());
    EXPECT_TRUE(gradients(again) == gradients(first)) << "run " << run << " differs";
  }
  v1::AttendBackwardResponse plain_response;
  ASSERT_TRUE(c.Backward(plain, &plain_response).ok());
  EXPECT_FALSE(plain_response.deterministic());
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();

  Connection forced = Connect({"--cpu_threads=3", "--deterministic_backward"});
  EXPECT_TRUE(forced.Info().deterministic_backward());
  v1::AttendBackwardResponse forced_response;
  ASSERT_TRUE(forced.Backward(plain, &forced_response).ok());
  EXPECT_TRUE(forced_response.deterministic());
  EXPECT_TRUE(gradients(forced_response) == gradients(first))
      << "three threads gave other bytes than four";
  EXPECT_EQ(forced.server->Stop(SIGTERM), 0) << forced.server->log();
}

TEST(ServerIntegration, MalformedBackwardRequestsAreRejectedNamingTheField) {
  Connection c = Connect({"--memory_limit_bytes=1048576"});
  const v1::AttendBackwardRequest good = client::MakeRandomBackwardRequest(
      Shape(attn::DType::kF32, 1, 8, 8, 2, 2, 16, false, false, false), 3);
  struct Case {
    const char* field;
    std::function<void(v1::AttendBackwardRequest*)> mutate;
  };
  const std::vector<Case> cases = {
      {"forward:", [](v1::AttendBackwardRequest* r) { r->clear_forward(); }},
      {"forward.q.data:",
       [](v1::AttendBackwardRequest* r) {
         r->mutable_forward()->mutable_q()->mutable_data()->pop_back();
       }},
      {"d_o:", [](v1::AttendBackwardRequest* r) { r->clear_d_o(); }},
      {"d_o.shape:",
       [](v1::AttendBackwardRequest* r) {
         r->mutable_d_o()->set_shape(1, 4);  // [1, 4, 2, 16]: consistent bytes, not q's shape
         r->mutable_d_o()->mutable_data()->resize(4 * 2 * 16 * 4);
       }},
      {"d_o.dtype:",
       [](v1::AttendBackwardRequest* r) { r->mutable_d_o()->set_dtype(v1::DTYPE_FLOAT16); }},
      {"lse:", [](v1::AttendBackwardRequest* r) { *r->mutable_o() = r->d_o(); }},
      {"lse.shape:",
       [](v1::AttendBackwardRequest* r) {
         *r->mutable_o() = r->d_o();
         r->mutable_lse()->set_dtype(v1::DTYPE_FLOAT32);
         r->mutable_lse()->add_shape(2);
         r->mutable_lse()->add_shape(4);
         r->mutable_lse()->mutable_data()->assign(2 * 4 * 4, '\0');
       }},
      {"path: PATH_FUSED",  // the engine choice names the path
       [](v1::AttendBackwardRequest* r) { r->mutable_forward()->set_path(v1::PATH_FUSED); }},
  };
  for (const Case& k : cases) {
    v1::AttendBackwardRequest bad = good;
    k.mutate(&bad);
    v1::AttendBackwardResponse response;
    const grpc::Status status = c.Backward(bad, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << k.field;
    EXPECT_TRUE(absl::StartsWith(status.error_message(), k.field))
        << k.field << " vs " << status.error_message();
  }
  // Fits the limit as a forward request (~0.6 MiB) but not with the gradients (~1.1 MiB).
  const v1::AttendBackwardRequest big = client::MakeRandomBackwardRequest(
      Shape(attn::DType::kF32, 1, 1024, 1024, 2, 2, 16, false, false, false), 4);
  v1::AttendBackwardResponse response;
  const grpc::Status status = c.Backward(big, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  v1::AttendBackwardResponse ok_response;
  EXPECT_TRUE(c.Backward(good, &ok_response).ok());  // still serving
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

TEST(ServerIntegration, MalformedRequestsAreRejectedNamingTheField) {
  Connection c = Connect({});
  const v1::AttendRequest good = client::MakeRandomRequest(
      Shape(attn::DType::kF32, 1, 4, 4, 4, 2, 16, false, false, false), 7);
  struct Case {
    const char* field;
    std::function<void(v1::AttendRequest*)> mutate;
  };
  std::vector<Case> cases = {
      {"q:", [](v1::AttendRequest* r) { r->clear_q(); }},
      {"q.dtype", [](v1::AttendRequest* r) { r->mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED); }},
      {"k.dtype", [](v1::AttendRequest* r) { r->mutable_k()->set_dtype(v1::DTYPE_BFLOAT16); }},
      {"q.data", [](v1::AttendRequest* r) { r->mutable_q()->mutable_data()->pop_back(); }},
      {"q.shape", [](v1::AttendRequest* r) { r->mutable_q()->add_shape(1); }},
      {"v.shape",
       [](v1::AttendRequest* r) {
         r->mutable_v()->set_shape(1, 3);
         r->mutable_v()->mutable_data()->resize(3 * 2 * 16 * 4);
       }},
      {"k.shape",
       [](v1::AttendRequest* r) {  // 4 query heads over 3 KV heads
         for (auto* t : {r->mutable_k(), r->mutable_v()}) {
           t->set_shape(2, 3);
           t->mutable_data()->resize(4 * 3 * 16 * 4);
         }
       }},
      {"cu_seqlens_q", [](v1::AttendRequest* r) { r->add_cu_seqlens_q(0); }},
      {"window_right",
       [](v1::AttendRequest* r) {
         r->set_causal(true);
         r->set_window_right(3);
       }},
      {"softmax_scale", [](v1::AttendRequest* r) { r->set_softmax_scale(-1.f); }},
      {"path", [](v1::AttendRequest* r) { r->set_path(static_cast<v1::Path>(42)); }},
  };
  if (!c.Info().gpu()) {
    cases.push_back({"path", [](v1::AttendRequest* r) { r->set_path(v1::PATH_FUSED); }});
  }
  for (const Case& k : cases) {
    v1::AttendRequest bad = good;
    k.mutate(&bad);
    v1::AttendResponse response;
    const grpc::Status status = c.Attend(bad, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << k.field << ": " << status.error_message();
    EXPECT_TRUE(absl::StartsWith(status.error_message(), k.field))
        << "expected the message to start with '" << k.field << "': " << status.error_message();
  }
  // Varlen with a bad prefix sum.
  v1::AttendRequest varlen =
      client::MakeRandomRequest(Shape(attn::DType::kF32, 2, 4, 4, 2, 2, 16, false, true, false), 3);
  varlen.set_cu_seqlens_q(1, varlen.cu_seqlens_q(2) + 1);
  v1::AttendResponse response;
  grpc::Status status = c.Attend(varlen, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "cu_seqlens_q")) << status.error_message();
  // The server is still fine.
  status = c.Attend(good, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(client::CheckAgainstReference(good, response).ok());
}

TEST(ServerIntegration, FullQueueRejectsAtOnceWithResourceExhausted) {
  Connection c = Connect({"--queue_capacity=2", "--max_batch_requests=1", "--max_queue_delay=0s"});
  const v1::AttendRequest request = client::MakeRandomRequest(
      Shape(attn::DType::kF32, 1, 256, 256, 8, 8, 64, false, false, false), 11);
  constexpr int kCalls = 24;
  std::atomic<int> ok{0}, exhausted{0}, other{0};
  std::string message;
  absl::Mutex mu;
  std::vector<std::thread> threads;
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&] {
      v1::AttendResponse response;
      const grpc::Status status = c.Attend(request, &response);
      if (status.ok()) {
        ++ok;
      } else if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        ++exhausted;
        absl::MutexLock lock(&mu);
        message = status.error_message();
      } else {
        ++other;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GT(exhausted.load(), 0);
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(other.load(), 0);
  EXPECT_TRUE(absl::StartsWith(message, "queue: full")) << message;
  EXPECT_EQ(c.Info().stats().requests_rejected(), static_cast<uint64_t>(exhausted.load()));
}

TEST(ServerIntegration, OversizeMessagesAndRequestsOverTheMemoryLimit) {
  Connection c = Connect({"--max_message_bytes=2097152", "--memory_limit_bytes=1048576"});
  v1::AttendResponse response;
  // 3 x 1 MiB tensors: over the message limit; gRPC refuses it.
  v1::AttendRequest huge = client::MakeRandomRequest(
      Shape(attn::DType::kF32, 1, 1024, 1024, 4, 4, 64, false, false, false), 1);
  grpc::Status status = c.Attend(huge, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  // Under the message limit (3 x 320 KiB) but its working set is over the memory limit.
  v1::AttendRequest big = client::MakeRandomRequest(
      Shape(attn::DType::kF32, 1, 320, 320, 4, 4, 64, false, false, false), 2);
  status = c.Attend(big, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "memory limit")) << status.error_message();
  // The server stays up and serves.
  const v1::AttendRequest small = client::MakeRandomRequest(
      Shape(attn::DType::kF32, 1, 8, 8, 4, 4, 64, false, false, false), 3);
  status = c.Attend(small, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(client::CheckAgainstReference(small, response).ok());
}

TEST(ServerIntegration, ExpiredDeadlinesAndCancelledCallsAreDroppedBeforeCompute) {
  Connection c = Connect({"--max_queue_delay=300ms", "--max_batch_requests=64"});
  const v1::AttendRequest request = client::MakeRandomRequest(
      Shape(attn::DType::kF32, 1, 16, 16, 2, 2, 32, false, false, false), 5);
  v1::AttendResponse response;
  grpc::Status status = c.Attend(request, &response, absl::Milliseconds(50));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);

  // Cancel a queued call from the client.
  grpc::ClientContext context;
  c.factory->Prepare(&context, absl::Seconds(30));
  absl::Notification done;
  grpc::Status cancelled_status;
  c.stub->async()->Attend(&context, &request, &response, [&](grpc::Status s) {
    cancelled_status = s;
    done.Notify();
  });
  absl::SleepFor(absl::Milliseconds(50));
  context.TryCancel();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(cancelled_status.error_code(), grpc::StatusCode::CANCELLED);

  // Both requests were accepted, neither was computed. They leave the queue when their batch
  // closes (300 ms after the first arrived).
  v1::ServerInfo info;
  for (const absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until;) {
    info = c.Info();
    if (info.stats().requests_failed() + info.stats().requests_completed() >= 2) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(info.stats().requests_accepted(), 2u);
  EXPECT_EQ(info.stats().requests_failed(), 2u);
  EXPECT_EQ(info.stats().requests_completed(), 0u);
  EXPECT_EQ(info.stats().batches(), 0u);
}

TEST(ServerIntegration, BearerTokenIsRequiredWhenConfigured) {
  char templ[] = "/tmp/attnserve_token_XXXXXX";
  const int fd = mkstemp(templ);
  ASSERT_GE(fd, 0);
  close(fd);
  { std::ofstream(templ) << "s3cret-token\n"; }
  Connection c = Connect({absl::StrCat("--auth_token_file=", templ)});
  const v1::AttendRequest request = client::MakeRandomRequest(
      Shape(attn::DType::kF32, 1, 4, 4, 2, 2, 16, false, false, false), 9);
  v1::AttendResponse response;
  grpc::Status status = c.Attend(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();

  ChannelOptions wrong;
  wrong.target = c.server->target();
  wrong.auth_token = "s3cret-tokem";
  ChannelFactory wrong_factory(wrong);
  auto wrong_stub = v1::AttentionService::NewStub(*wrong_factory.Connect());
  {
    grpc::ClientContext context;
    wrong_factory.Prepare(&context);
    status = wrong_stub->Attend(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  ChannelOptions right = wrong;
  right.auth_token = "s3cret-token";
  ChannelFactory right_factory(right);
  auto right_stub = v1::AttentionService::NewStub(*right_factory.Connect());
  {
    grpc::ClientContext context;
    right_factory.Prepare(&context);
    status = right_stub->Attend(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
  {  // AttendStream checks the token when the stream opens
    grpc::ClientContext context;
    wrong_factory.Prepare(&context);
    auto stream = wrong_stub->AttendStream(&context);
    stream->Write(request);
    stream->WritesDone();
    v1::AttendResponse ignored;
    while (stream->Read(&ignored)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    right_factory.Prepare(&context);
    auto stream = right_stub->AttendStream(&context);
    ASSERT_TRUE(stream->Write(request));
    ASSERT_TRUE(stream->WritesDone());
    v1::AttendResponse streamed;
    ASSERT_TRUE(stream->Read(&streamed));
    EXPECT_TRUE(client::CheckAgainstReference(request, streamed).ok());
    EXPECT_TRUE(stream->Finish().ok());
  }
  // Health stays open for probes.
  auto health = grpc::health::v1::Health::NewStub(c.channel);
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckResponse h;
  status = health->Check(&context, {}, &h);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(h.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  std::remove(templ);
}

TEST(ServerIntegration, StreamPipelinesRequestsAndTagsResponses) {
  Connection c = Connect({"--max_queue_delay=5ms"});
  grpc::ClientContext context;
  c.factory->Prepare(&context, absl::Seconds(60));
  auto stream = c.stub->AttendStream(&context);
  std::vector<v1::AttendRequest> sent;
  for (int i = 0; i < 12; ++i) {
    const ShapeSpec s =
        i % 3 == 0   ? Shape(attn::DType::kF32, 1, 9 + i, 20, 4, 2, 32, true, false, true)
        : i % 3 == 1 ? Shape(attn::DType::kBF16, 2, 5, 11, 4, 4, 64, false, true, false)
                     : Shape(attn::DType::kF16, 1, 3, 7 + i, 2, 2, 16, false, false, true);
    sent.push_back(client::MakeRandomRequest(s, 100 + i, absl::StrCat("s", i)));
  }
  v1::AttendRequest bad = sent[0];
  bad.set_request_id("bad");
  bad.mutable_q()->mutable_data()->append("x");
  for (const auto& r : sent) ASSERT_TRUE(stream->Write(r));
  ASSERT_TRUE(stream->Write(bad));
  ASSERT_TRUE(stream->WritesDone());
  std::map<std::string, v1::AttendResponse> got;
  v1::AttendResponse response;
  while (stream->Read(&response)) got[response.request_id()] = response;
  const grpc::Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(got.size(), sent.size() + 1);
  for (const auto& r : sent) {
    const v1::AttendResponse& resp = got[r.request_id()];
    EXPECT_FALSE(resp.has_error()) << r.request_id() << ": " << resp.error().message();
    auto check = client::CheckAgainstReference(r, resp);
    EXPECT_TRUE(check.ok()) << r.request_id() << ": " << check.status();
  }
  EXPECT_EQ(got["bad"].error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_TRUE(absl::StartsWith(got["bad"].error().message(), "q.data"))
      << got["bad"].error().message();
}

TEST(ServerIntegration, CancelledStreamDropsItsQueuedRequestsAndTheServerStaysUp) {
  Connection c = Connect({"--max_queue_delay=300ms", "--max_batch_requests=64"});
  {
    grpc::ClientContext context;
    c.factory->Prepare(&context, absl::Seconds(30));
    auto stream = c.stub->AttendStream(&context);
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(stream->Write(client::MakeRandomRequest(
          Shape(attn::DType::kF32, 1, 16, 16, 2, 2, 32, false, false, false), 40 + i,
          absl::StrCat("c", i))));
    }
    absl::SleepFor(absl::Milliseconds(50));  // admitted, waiting for their batch to close
    context.TryCancel();
    v1::AttendResponse response;
    while (stream->Read(&response)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  v1::ServerInfo info;
  for (const absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until;) {
    info = c.Info();
    if (info.stats().requests_failed() + info.stats().requests_completed() >= 3) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(info.stats().requests_accepted(), 3u);
  EXPECT_EQ(info.stats().requests_failed(), 3u);
  EXPECT_EQ(info.stats().batches(), 0u);

  // The next stream on the same connection is served.
  grpc::ClientContext context;
  c.factory->Prepare(&context, absl::Seconds(30));
  auto stream = c.stub->AttendStream(&context);
  const v1::AttendRequest request = client::MakeRandomRequest(
      Shape(attn::DType::kF16, 1, 5, 9, 2, 1, 64, true, false, true), 44, "after");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->WritesDone());
  v1::AttendResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), "after");
  EXPECT_TRUE(client::CheckAgainstReference(request, response).ok());
  EXPECT_TRUE(stream->Finish().ok());
}

TEST(ServerIntegration, SigtermAnswersEveryRequestAnOpenStreamSent) {
  Connection c = Connect({"--max_queue_delay=200ms", "--drain_timeout=20s"});
  grpc::ClientContext context;
  c.factory->Prepare(&context, absl::Seconds(60));
  auto stream = c.stub->AttendStream(&context);
  std::map<std::string, v1::AttendRequest> sent;
  for (int i = 0; i < 8; ++i) {
    const v1::AttendRequest r = client::MakeRandomRequest(
        Shape(attn::DType::kBF16, 1, 7 + i, 12, 4, 2, 32, i % 2 == 0, false, false), 60 + i,
        absl::StrCat("d", i));
    ASSERT_TRUE(stream->Write(r));
    sent[r.request_id()] = r;
  }
  absl::SleepFor(absl::Milliseconds(50));
  c.server->Signal(SIGTERM);
  // The drain answers every request the stream sent, then ends the stream itself (UNAVAILABLE:
  // the client should go elsewhere) without waiting for the client to half-close.
  v1::AttendResponse response;
  for (size_t n = 0; n < sent.size(); ++n) {
    ASSERT_TRUE(stream->Read(&response)) << c.server->log();
    const auto it = sent.find(response.request_id());
    ASSERT_NE(it, sent.end()) << response.request_id();
    EXPECT_FALSE(response.has_error()) << response.error().message();
    EXPECT_TRUE(client::CheckAgainstReference(it->second, response).ok()) << it->first;
  }
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(c.server->Wait(absl::Seconds(30)), 0) << c.server->log();
  EXPECT_TRUE(absl::StrContains(c.server->log(), "drained: 8 accepted, 8 completed, 0 failed"))
      << c.server->log();
}

TEST(ServerIntegration, AStreamLeftOpenEndsOnceItsRequestsAreAnswered) {
  Connection c = Connect({"--drain_timeout=20s"});
  grpc::ClientContext context;
  c.factory->Prepare(&context, absl::Seconds(60));
  auto stream = c.stub->AttendStream(&context);
  const v1::AttendRequest request = client::MakeRandomRequest(
      Shape(attn::DType::kF32, 1, 8, 8, 2, 2, 32, false, false, false), 70, "open");
  ASSERT_TRUE(stream->Write(request));
  v1::AttendResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_TRUE(client::CheckAgainstReference(request, response).ok());
  // The client never half-closes: nothing is left to answer, so the drain ends the stream and
  // the server exits at once instead of waiting for the drain timeout.
  const absl::Time signalled = absl::Now();
  c.server->Signal(SIGTERM);
  EXPECT_EQ(c.server->Wait(absl::Seconds(20)), 0) << c.server->log();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(2));
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(c.server->log(), "drained: 1 accepted, 1 completed, 0 failed"))
      << c.server->log();
}

TEST(ServerIntegration, AnAddressThatCannotBeListenedOnIsNamed) {
  // The shell's `echo` makes the exit status part of the output (RunAndCapture wants 0).
  const std::string out = RunAndCapture(
      absl::StrCat(test_support::BinaryFromEnv("ATTNSERVE_SERVER_BINARY", ATTN_SERVER_BINARY),
                   " --listen=unix:/nonexistent-attnserve-dir/s.sock --metrics_address= ",
                   "--cpu_threads=1 2>&1; echo \"exit $?\""));
  EXPECT_TRUE(absl::StrContains(
      out, "--listen=unix:/nonexistent-attnserve-dir/s.sock: cannot listen there"))
      << out;
  EXPECT_TRUE(absl::StrContains(out, "exit 1")) << out;
  // Nothing else complains on the way out (the stream queues were never started).
  EXPECT_FALSE(absl::StrContains(out, "CompletionQueue")) << out;
  EXPECT_FALSE(absl::StrContains(out, "Sanitizer")) << out;
}

TEST(ServerIntegration, SigtermDuringLoadLosesNoAcceptedRequest) {
  Connection c = Connect({"--max_queue_delay=5ms", "--drain_timeout=20s"});
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, refused{0}, other{0}, wrong{0};
  absl::Mutex mu;
  std::vector<std::string> other_errors;
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; !stop.load(); ++i) {
        const v1::AttendRequest request = client::MakeRandomRequest(
            Shape(attn::DType::kF32, 1, 32 + t, 64, 4, 4, 32, t % 2 == 0, false, false),
            t * 100000 + i);
        v1::AttendResponse response;
        const grpc::Status status = c.Attend(request, &response);
        if (status.ok()) {
          ++ok;
          if (!client::CheckAgainstReference(request, response).ok()) ++wrong;
        } else if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                   status.error_code() == grpc::StatusCode::CANCELLED) {
          // Refused: UNAVAILABLE from the draining service or a closed port; CANCELLED from
          // gRPC's own shutdown for a call that never reached the service. The server's count
          // below proves that none of them had been accepted.
          ++refused;
          absl::SleepFor(absl::Milliseconds(20));
        } else {
          ++other;
          absl::MutexLock lock(&mu);
          other_errors.push_back(
              absl::StrCat(static_cast<int>(status.error_code()), ": ", status.error_message()));
        }
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(800));
  c.server->Signal(SIGTERM);
  const int exit_status = c.server->Wait(absl::Seconds(30));
  absl::SleepFor(absl::Milliseconds(200));
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(exit_status, 0) << c.server->log();
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  for (const std::string& e : other_errors) ADD_FAILURE() << "neither OK nor refused: " << e;
  // The server's own account: everything it accepted completed, and the client saw every one.
  const std::string log = c.server->log();
  EXPECT_TRUE(absl::StrContains(
      log, absl::StrCat("drained: ", ok.load(), " accepted, ", ok.load(), " completed, 0 failed")))
      << "client saw " << ok.load() << " OK\n"
      << log;
}

TEST(ServerIntegration, TlsServesWithTheGivenCertificate) {
  char templ[] = "/tmp/attnserve_tls_XXXXXX";
  const std::string dir = mkdtemp(templ);
  const std::string command = absl::StrCat(
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
      "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout ",
      dir, "/key.pem -out ", dir, "/cert.pem >/dev/null 2>&1");
  if (std::system(command.c_str()) != 0) GTEST_SKIP() << "openssl is not available";
  ChannelOptions options;
  options.tls_ca_file = dir + "/cert.pem";
  options.tls_server_name = "localhost";
  Connection c = Connect({absl::StrCat("--tls_cert_file=", dir, "/cert.pem"),
                          absl::StrCat("--tls_key_file=", dir, "/key.pem")},
                         options, /*start=*/true);
  // Connect() built the channel before knowing the port for TLS options; rebuild it.
  options.target = c.server->target();
  ChannelFactory factory(options);
  auto stub = v1::AttentionService::NewStub(*factory.Connect());
  const v1::AttendRequest request = client::MakeRandomRequest(
      Shape(attn::DType::kF32, 1, 8, 8, 2, 2, 16, false, false, false), 4);
  v1::AttendResponse response;
  grpc::ClientContext context;
  factory.Prepare(&context, absl::Seconds(20));
  const grpc::Status status = stub->Attend(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(client::CheckAgainstReference(request, response).ok());
  // A plaintext client cannot talk to it.
  ChannelOptions plain;
  plain.target = c.server->target();
  ChannelFactory plain_factory(plain);
  auto plain_stub = v1::AttentionService::NewStub(*plain_factory.Connect());
  grpc::ClientContext plain_context;
  plain_factory.Prepare(&plain_context, absl::Seconds(5));
  EXPECT_FALSE(plain_stub->Attend(&plain_context, request, &response).ok());
  std::system(absl::StrCat("rm -rf ", dir).c_str());
}

TEST(ServerIntegration, CommandLineClientChecksAgainstTheReference) {
  // Two AttendStream threads: the streams below are spread over their queues.
  Connection c = Connect({"--stream_threads=2"});
  const std::string base =
      absl::StrCat(test_support::BinaryFromEnv("ATTNSERVE_CLIENT_BINARY", ATTN_CLIENT_BINARY),
                   " --target=", c.server->target());
  EXPECT_EQ(std::system((base + " health >/dev/null").c_str()), 0);
  EXPECT_EQ(std::system((base + " info --json >/dev/null").c_str()), 0);
  EXPECT_EQ(std::system((base + " attend --check --varlen --batch=3 --causal --dtype=bf16 "
                                "--heads=4 --kv_heads=2 --seqlen_q=20 --seqlen_k=30 --lse "
                                "--count=2 >/dev/null")
                            .c_str()),
            0);
  EXPECT_EQ(std::system((base + " bench --concurrency=1,4 --rates=50 --duration=500ms "
                                "--seqlen_q=16 --seqlen_k=16 --heads=2 --json >/dev/null")
                            .c_str()),
            0);
  // The pipelined AttendStream load: every response matched to its request, none failed.
  const std::string stream_json = RunAndCapture(
      base +
      " bench --rpc=stream --streams=3 --concurrency=8 --duration=500ms --seqlen_q=16 "
      "--seqlen_k=16 --heads=2 --json");
  EXPECT_NE(stream_json.find("\"rpc\": \"stream\", \"streams\": 3"), std::string::npos)
      << stream_json;
  EXPECT_NE(stream_json.find("\"errors\": {}"), std::string::npos) << stream_json;
  const size_t ok_at = stream_json.find("\"ok\": ");
  ASSERT_NE(ok_at, std::string::npos) << stream_json;
  EXPECT_GT(std::atoi(stream_json.c_str() + ok_at + 6), 8) << stream_json;
  // Tensors by reference from the command line: a checked request, and both closed loops.
  EXPECT_EQ(std::system((base + " attend --check --shared_memory --dtype=f16 --heads=4 "
                                "--seqlen_q=24 --seqlen_k=40 --count=2 >/dev/null")
                            .c_str()),
            0);
  for (const char* rpc : {"unary", "stream"}) {
    const std::string json = RunAndCapture(
        absl::StrCat(base, " bench --shared_memory --rpc=", rpc,
                     " --concurrency=1,4 --duration=300ms --seqlen_q=16 --seqlen_k=16 --heads=2 "
                     "--json"));
    EXPECT_NE(json.find("\"shared_memory\": true"), std::string::npos) << json;
    EXPECT_EQ(json.find("\"errors\": {\""), std::string::npos) << json;
  }
}

}  // namespace
}  // namespace attnserve
