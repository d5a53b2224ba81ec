// The reliability suite: the real attnserve binary driven from outside the way a careless or
// hostile client would, each scenario ending with the server up (or cleanly exited) and nothing
// it accepted lost. Each scenario prints one line of figures, "[reliability] <scenario>: ...",
// so a CI log shows what was exercised. Servers use one CPU thread: the build machine has two
// cores for everything.
#include <fcntl.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attn/dtype.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "clients/cli/channel_factory.h"
#include "clients/cli/reference_check.h"
#include "clients/cli/request_factory.h"
#include "clients/cli/shared_memory_buffer.h"
#include "proto/wire/descriptor_passing.h"
#include "tests/server/server_process.h"

namespace attnserve {
namespace {

using client::ChannelFactory;
using client::ChannelOptions;
using client::ShapeSpec;
using test_support::ServerProcess;

// AddressSanitizer's allocator keeps freed memory in quarantine, so resident-memory bounds only
// mean something in builds without it.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRssIsMeaningful = false;
#else
constexpr bool kRssIsMeaningful = true;
#endif

constexpr char kAttendMethod[] = "/attnserve.v1.AttentionService/Attend";
constexpr char kAttendStreamMethod[] = "/attnserve.v1.AttentionService/AttendStream";

void Report(const std::string& scenario, const std::string& figures) {
  std::printf("[reliability] %s: %s\n", scenario.c_str(), figures.c_str());
  std::fflush(stdout);
}

ShapeSpec SmallShape(int seqlen = 16) {
  ShapeSpec s;
  s.dtype = attn::DType::kF16;
  s.batch = 1;
  s.seqlen_q = seqlen;
  s.seqlen_k = seqlen;
  s.num_heads = 2;
  s.num_kv_heads = 1;
  s.head_dim = 32;
  return s;
}

// A server and a client of it with a bearer token (or none).
struct Connection {
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<ChannelFactory> factory;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::AttentionService::Stub> stub;

  grpc::Status Attend(const v1::AttendRequest& request, v1::AttendResponse* response,
                      absl::Duration timeout = absl::Seconds(30)) const {
    grpc::ClientContext context;
    factory->Prepare(&context, timeout);
    return stub->Attend(&context, request, response);
  }
  v1::ServerInfo Info() const {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(10));
    v1::ServerInfo info;
    const grpc::Status status = stub->GetServerInfo(&context, {}, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info;
  }
  bool Alive() const {
    v1::AttendResponse response;
    return Attend(client::MakeRandomRequest(SmallShape(), 99), &response, absl::Seconds(20)).ok();
  }
};

std::unique_ptr<ServerProcess> StartServer(const std::vector<std::string>& extra) {
  std::vector<std::string> flags = {"--cpu_threads=1", "--metrics_address=", "--log_level=info"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  auto server = std::make_unique<ServerProcess>();
  EXPECT_TRUE(server->Start(ATTN_SERVER_BINARY, flags)) << server->log();
  return server;
}

Connection ClientOf(const ServerProcess& server, const std::string& token = "") {
  Connection c;
  ChannelOptions options;
  options.target = server.target();
  options.auth_token = token;
  c.factory = std::make_unique<ChannelFactory>(options);
  c.channel = *c.factory->Connect();
  c.stub = v1::AttentionService::NewStub(c.channel);
  return c;
}

Connection Connect(const std::vector<std::string>& extra) {
  auto server = StartServer(extra);
  Connection c = ClientOf(*server);
  c.server = std::move(server);
  return c;
}

int64_t ResidentBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      int64_t kib = 0;
      std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipWhitespace());
      if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kib)) return kib << 10;
    }
  }
  return -1;
}

// The counts of the server's "drained: A accepted, C completed, F failed" log line.
struct DrainCounts {
  int64_t accepted = -1, completed = -1, failed = -1;
};
DrainCounts ParseDrained(const std::string& log) {
  DrainCounts counts;
  const size_t at = log.rfind("drained: ");
  if (at == std::string::npos) return counts;
  std::istringstream in(log.substr(at + 9));
  std::string word;
  in >> counts.accepted >> word >> counts.completed >> word >> counts.failed;
  return counts;
}

std::string TempFile(const std::string& text) {
  char path[] = "/tmp/attnserve-reliability-XXXXXX";
  const int fd = mkstemp(path);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

// Too many clients for a small queue: every refusal is RESOURCE_EXHAUSTED, every acceptance is
// answered, and the server's own books agree with what the clients saw.
TEST(Reliability, OverloadWithASmallQueue) {
  Connection c = Connect({"--queue_capacity=4", "--max_batch_requests=2"});
  constexpr int kThreads = 24, kPerThread = 12;
  std::atomic<int> ok{0}, exhausted{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const v1::AttendRequest request = client::MakeRandomRequest(SmallShape(64), t * 100 + i);
        v1::AttendResponse response;
        const grpc::Status status = c.Attend(request, &response);
        if (status.ok() && client::CheckAgainstReference(request, response).ok()) {
          ++ok;
        } else if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          ++exhausted;
        } else {
          ++other;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  const v1::Stats stats = c.Info().stats();
  Report("overload",
         absl::StrCat("sent ", kThreads * kPerThread, ", ok ", ok.load(), ", RESOURCE_EXHAUSTED ",
                      exhausted.load(), ", other ", other.load(), "; server accepted ",
                      stats.requests_accepted(), " completed ", stats.requests_completed(),
                      " failed ", stats.requests_failed()));
  EXPECT_EQ(other.load(), 0);
  EXPECT_GT(exhausted.load(), 0) << "the queue never filled: the scenario tested nothing";
  EXPECT_EQ(stats.requests_accepted(), stats.requests_completed() + stats.requests_failed());
  EXPECT_EQ(stats.requests_completed(), static_cast<uint64_t>(ok.load()));
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

// SIGTERM while unary clients keep sending: answers are either right or UNAVAILABLE, every
// accepted request is answered, and the process exits promptly after the last answer.
TEST(Reliability, SigtermUnderUnaryLoad) {
  Connection c = Connect({"--drain_timeout=30s"});
  std::atomic<bool> stop{false};
  // Calls that reach the server as its connections close are cut off (CANCELLED) without ever
  // being accepted; what counts is that every accepted one was answered.
  std::atomic<int> ok{0}, unavailable{0}, cut_off{0}, other{0};
  std::atomic<int64_t> last_answer_us{0};
  absl::Mutex other_mu;
  std::string others;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; !stop.load(); ++i) {
        const v1::AttendRequest request = client::MakeRandomRequest(SmallShape(32), t * 1000 + i);
        v1::AttendResponse response;
        const grpc::Status status = c.Attend(request, &response, absl::Seconds(20));
        if (status.ok()) {
          last_answer_us = absl::ToUnixMicros(absl::Now());
          client::CheckAgainstReference(request, response).ok() ? ++ok : ++other;
        } else if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
          ++unavailable;
          absl::SleepFor(absl::Milliseconds(5));
        } else if (status.error_code() == grpc::StatusCode::CANCELLED) {
          ++cut_off;
        } else {
          ++other;
          absl::MutexLock lock(&other_mu);
          absl::StrAppend(&others, " [", status.error_code(), " ", status.error_message(), "]");
        }
      }
    });
  }
  absl::SleepFor(absl::Seconds(2));
  c.server->Signal(SIGTERM);
  const int exit_status = c.server->Wait(absl::Seconds(40));
  const absl::Time exited = absl::Now();
  absl::SleepFor(absl::Milliseconds(300));
  stop = true;
  for (auto& t : threads) t.join();
  const DrainCounts drained = ParseDrained(c.server->log());
  const absl::Duration after_last = exited - absl::FromUnixMicros(last_answer_us.load());
  Report("sigterm-unary",
         absl::StrCat("ok ", ok.load(), ", UNAVAILABLE ", unavailable.load(),
                      ", cut off at the close ", cut_off.load(), ", other ", other.load(),
                      "; server accepted ", drained.accepted, " completed ", drained.completed,
                      " failed ", drained.failed, "; exit ", absl::FormatDuration(after_last),
                      " after the last answer", others));
  EXPECT_EQ(exit_status, 0) << c.server->log();
  EXPECT_EQ(other.load(), 0);
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(drained.accepted, drained.completed) << c.server->log();
  EXPECT_EQ(drained.completed, ok.load());  // every accepted request reached its client
  EXPECT_LT(after_last, absl::Seconds(1));
}

// SIGTERM while streams pipeline requests: a stream stops admitting (each new request answered
// UNAVAILABLE on it), answers what it accepted, ends with UNAVAILABLE, and nothing is lost.
TEST(Reliability, SigtermUnderStreamingLoad) {
  Connection c = Connect({"--drain_timeout=30s"});
  constexpr int kStreams = 4;
  std::atomic<int> ok{0}, refused{0}, other{0};
  std::vector<grpc::StatusCode> ends(kStreams, grpc::StatusCode::OK);
  std::vector<std::thread> threads;
  std::atomic<bool> stop{false};
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      grpc::ClientContext context;
      c.factory->Prepare(&context, absl::Seconds(60));
      auto stream = c.stub->AttendStream(&context);
      std::map<std::string, v1::AttendRequest> sent;
      absl::Mutex mu;
      std::thread reader([&] {
        v1::AttendResponse response;
        while (stream->Read(&response)) {
          v1::AttendRequest request;
          {
            absl::MutexLock lock(&mu);
            request = sent[response.request_id()];
          }
          if (response.has_error()) {
            // Refusals: draining (UNAVAILABLE), or a full queue on a slow build.
            const int code = response.error().code();
            code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::RESOURCE_EXHAUSTED
                ? ++refused
                : ++other;
          } else {
            client::CheckAgainstReference(request, response).ok() ? ++ok : ++other;
          }
        }
      });
      for (int i = 0; !stop.load(); ++i) {
        const std::string id = absl::StrCat(s, "-", i);
        v1::AttendRequest request = client::MakeRandomRequest(SmallShape(32), s * 100000 + i, id);
        {
          absl::MutexLock lock(&mu);
          sent[id] = request;
        }
        if (!stream->Write(request)) break;
        if (i % 8 == 7) absl::SleepFor(absl::Milliseconds(2));
      }
      stream->WritesDone();
      reader.join();
      ends[s] = stream->Finish().error_code();
    });
  }
  absl::SleepFor(absl::Seconds(2));
  c.server->Signal(SIGTERM);
  const int exit_status = c.server->Wait(absl::Seconds(40));
  stop = true;
  for (auto& t : threads) t.join();
  const DrainCounts drained = ParseDrained(c.server->log());
  int unavailable_ends = 0;
  for (grpc::StatusCode code : ends) unavailable_ends += code == grpc::StatusCode::UNAVAILABLE;
  Report("sigterm-stream",
         absl::StrCat("ok ", ok.load(), ", refused on the stream ", refused.load(), ", other ",
                      other.load(), ", streams ended UNAVAILABLE ", unavailable_ends, "/", kStreams,
                      "; server accepted ", drained.accepted, " completed ", drained.completed));
  EXPECT_EQ(exit_status, 0) << c.server->log();
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(unavailable_ends, kStreams);
  EXPECT_EQ(drained.accepted, drained.completed) << c.server->log();
  EXPECT_EQ(drained.completed, ok.load());
}

// Idle connections do not hold the exit: with nothing in flight the server is gone at once,
// not at --drain_timeout.
TEST(Reliability, IdleConnectionsDoNotHoldTheExit) {
  Connection c = Connect({"--drain_timeout=20s"});
  std::vector<Connection> idle;
  for (int i = 0; i < 3; ++i) {
    idle.push_back(ClientOf(*c.server));
    idle.back().Info();  // connected, then left open
  }
  const absl::Time t0 = absl::Now();
  const int exit_status = c.server->Stop(SIGTERM, absl::Seconds(30));
  const absl::Duration took = absl::Now() - t0;
  Report("idle-connections",
         absl::StrCat("3 idle connections, exit in ", absl::FormatDuration(took)));
  EXPECT_EQ(exit_status, 0);
  EXPECT_LT(took, absl::Seconds(2));
}

// A client that sends on a stream and never reads: the server stops reading from it once its
// unsent responses pass the bound, instead of growing; cancelling frees them.
TEST(Reliability, AStreamThatNeverReadsIsBounded) {
  Connection c = Connect({"--max_stream_buffer_bytes=4194304"});
  ASSERT_TRUE(c.Alive());
  const int64_t before = ResidentBytes(c.server->pid());
  ShapeSpec shape = SmallShape(256);
  shape.num_heads = 8;
  shape.head_dim = 64;  // 256 KiB of O per response
  const v1::AttendRequest request = client::MakeRandomRequest(shape, 5, "never-read");
  grpc::ClientContext context;
  auto stream = c.stub->AttendStream(&context);
  std::atomic<int> written{0};
  std::thread writer([&] {
    for (int i = 0; i < 1500; ++i) {
      if (!stream->Write(request)) return;
      ++written;
    }
  });
  // Writes block once flow control stops them; the server stopped reading well before 1500.
  absl::SleepFor(absl::Seconds(6));
  const int written_when_blocked = written.load();
  const int64_t during = ResidentBytes(c.server->pid());
  context.TryCancel();
  writer.join();
  stream->Finish();
  absl::SleepFor(absl::Milliseconds(500));
  const bool alive = c.Alive();
  Report("never-read", absl::StrCat("client wrote ", written_when_blocked,
                                    " of 1500 requests (256 KiB responses) before blocking; "
                                    "server RSS ",
                                    before >> 20, " MiB -> ", during >> 20, " MiB"));
  EXPECT_LT(written_when_blocked, 1500);
  if (kRssIsMeaningful) {
    EXPECT_LT(during - before, int64_t{192} << 20);
  }
  EXPECT_TRUE(alive);
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

// Shared memory that could shrink under the server never gets registered: by name it is
// refused, unsealed it is refused, and a sealed region cannot shrink at all.
TEST(Reliability, ShrunkSharedMemoryCannotFaultTheServer) {
  Connection c = Connect({});
  const v1::ServerInfo info = c.Info();
  ASSERT_FALSE(info.shared_memory_socket().empty());

  // By name (the old way, which a client could shrink under the server): refused.
  const std::string key = absl::StrCat("/attnserve-reliability-", getpid());
  const int named = shm_open(key.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(named, 0);
  ASSERT_EQ(ftruncate(named, 1 << 20), 0);
  v1::RegisterSharedMemoryRequest by_name;
  by_name.set_name("named");
  by_name.set_key(key);
  by_name.set_byte_size(1 << 20);
  grpc::ClientContext context;
  c.factory->Prepare(&context, absl::Seconds(10));
  v1::RegisterSharedMemoryResponse registered;
  const grpc::Status named_status = c.stub->RegisterSharedMemory(&context, by_name, &registered);
  // The attack itself, in case the registration had been taken: shrink it and send again.
  ASSERT_EQ(ftruncate(named, 0), 0);
  close(named);
  shm_unlink(key.c_str());

  // An unsealed memfd: the socket refuses it.
  const int unsealed = memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(unsealed, 1 << 20), 0);
  auto unsealed_token = wire::PassDescriptor(info.shared_memory_socket(), unsealed);
  close(unsealed);

  // A sealed memfd registers; shrinking it then fails in the client.
  auto buffer = client::SharedMemoryBuffer::Create(1 << 20);
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE(client::RegisterSharedMemory(*c.stub, *c.factory, "sealed", **buffer).ok());
  const int shrink = ftruncate((*buffer)->fd(), 0);
  v1::AttendRequest request = client::MakeRandomRequest(SmallShape(64), 7);
  const v1::AttendRequest original = request;
  int64_t offset = 0;
  for (v1::Tensor* t : {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
    ASSERT_TRUE(client::MoveToSharedMemory(t, "sealed", **buffer, &offset).ok());
  }
  v1::AttendResponse response;
  const grpc::Status attended = c.Attend(request, &response);
  const bool alive = c.Alive();
  Report("shrunk-shared-memory",
         absl::StrCat("by name: ", grpc::StatusCode(named_status.error_code()), "; unsealed: ",
                      unsealed_token.status().code() == absl::StatusCode::kFailedPrecondition
                          ? "refused"
                          : "ACCEPTED",
                      "; sealed ftruncate: ", shrink == 0 ? "SHRANK" : "refused",
                      "; server alive: ", alive));
  EXPECT_EQ(named_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(unsealed_token.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(shrink, 0);
  ASSERT_TRUE(attended.ok()) << attended.error_message();
  EXPECT_TRUE(client::CheckAgainstReference(original, response).ok());
  EXPECT_TRUE(alive);
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

// Two identities: one cannot see, use, unregister or crowd out the other's regions; SIGHUP
// adds and revokes tokens.
TEST(Reliability, RegionsBelongToTheirIdentity) {
  const std::string tokens = TempFile("alice tok-alice-0001\nbob tok-bob-00001\n");
  auto server =
      StartServer({absl::StrCat("--auth_token_file=", tokens), "--max_regions_per_identity=3"});
  Connection alice = ClientOf(*server, "tok-alice-0001");
  Connection bob = ClientOf(*server, "tok-bob-00001");
  auto alices = client::SharedMemoryBuffer::Create(1 << 16);
  ASSERT_TRUE(alices.ok());
  ASSERT_TRUE(client::RegisterSharedMemory(*alice.stub, *alice.factory, "r", **alices).ok());
  v1::AttendRequest request = client::MakeRandomRequest(SmallShape(16), 3);
  const v1::AttendRequest original = request;
  int64_t offset = 0;
  ASSERT_TRUE(client::MoveToSharedMemory(request.mutable_q(), "r", **alices, &offset).ok());

  // Bob names alice's region: the same NOT_FOUND as for a name nobody registered.
  v1::AttendResponse response;
  const grpc::Status bob_reads = bob.Attend(request, &response);
  v1::AttendRequest nobody = request;
  nobody.mutable_q()->mutable_shared_memory()->set_region("nobody");
  const grpc::Status bob_unknown = bob.Attend(nobody, &response);
  const grpc::Status bob_unregisters = client::UnregisterSharedMemory(*bob.stub, *bob.factory, "r");
  v1::UnregisterSharedMemoryRequest everything;
  v1::UnregisterSharedMemoryResponse removed;
  grpc::ClientContext clear_context;
  bob.factory->Prepare(&clear_context, absl::Seconds(10));
  const grpc::Status bob_clears =
      bob.stub->UnregisterSharedMemory(&clear_context, everything, &removed);
  // Bob fills his cap; alice can still register.
  int bob_registered = 0;
  std::vector<std::unique_ptr<client::SharedMemoryBuffer>> bobs;
  grpc::Status bob_over_cap;
  for (int i = 0; i < 4; ++i) {
    bobs.push_back(*client::SharedMemoryBuffer::Create(4096));
    bob_over_cap =
        client::RegisterSharedMemory(*bob.stub, *bob.factory, absl::StrCat("b", i), *bobs.back());
    bob_registered += bob_over_cap.ok();
  }
  auto alices2 = client::SharedMemoryBuffer::Create(4096);
  const grpc::Status alice_second =
      client::RegisterSharedMemory(*alice.stub, *alice.factory, "r2", **alices2);
  const grpc::Status alice_reads = alice.Attend(request, &response);

  // SIGHUP: carol joins, bob is revoked.
  std::ofstream(tokens) << "alice tok-alice-0001\ncarol tok-carol-0001\n";
  server->Signal(SIGHUP);
  absl::SleepFor(absl::Milliseconds(300));
  Connection carol = ClientOf(*server, "tok-carol-0001");
  v1::AttendResponse ignored;
  const grpc::Status carol_status =
      carol.Attend(client::MakeRandomRequest(SmallShape(), 4), &ignored);
  const grpc::Status bob_revoked = bob.Attend(client::MakeRandomRequest(SmallShape(), 4), &ignored);

  Report("foreign-regions",
         absl::StrCat("bob on alice's region: ", bob_reads.error_code(),
                      " (unknown name: ", bob_unknown.error_code(), "); bob unregisters it: ",
                      bob_unregisters.error_code(), "; bob clears all: removed ",
                      removed.unregistered(), "; bob registered ", bob_registered,
                      "/4 under a cap of 3; alice still registers: ", alice_second.ok(),
                      "; after SIGHUP carol: ", carol_status.error_code(),
                      " bob: ", bob_revoked.error_code()));
  EXPECT_EQ(bob_reads.error_code(), grpc::StatusCode::NOT_FOUND) << bob_reads.error_message();
  // Word for word the answer for a name nobody registered, so ids cannot be probed.
  EXPECT_EQ(absl::StrReplaceAll(bob_reads.error_message(), {{"'r'", "'nobody'"}}),
            bob_unknown.error_message());
  EXPECT_EQ(bob_unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(bob_unregisters.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(bob_clears.ok());
  EXPECT_EQ(removed.unregistered(), 0);
  EXPECT_EQ(bob_registered, 3);
  EXPECT_EQ(bob_over_cap.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(alice_second.ok()) << alice_second.error_message();
  ASSERT_TRUE(alice_reads.ok()) << alice_reads.error_message();
  EXPECT_TRUE(client::CheckAgainstReference(original, response).ok());
  EXPECT_TRUE(carol_status.ok()) << carol_status.error_message();
  EXPECT_EQ(bob_revoked.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
  std::remove(tokens.c_str());
}

// Shapes that name far more work than their bytes carry are refused at once, naming the field.
TEST(Reliability, OversizedAndDegenerateShapes) {
  Connection c = Connect({"--max_sequences=4096"});
  struct Case {
    std::string name;
    v1::AttendRequest request;
    grpc::StatusCode code;
    std::string field;
  };
  std::vector<Case> cases;
  auto tensor = [](std::vector<int64_t> shape, v1::DType dtype = v1::DTYPE_FLOAT32) {
    v1::Tensor t;
    t.set_dtype(dtype);
    int64_t elements = 1;
    for (int64_t d : shape) {
      t.add_shape(d);
      elements *= d;
    }
    t.set_data(std::string(static_cast<size_t>(elements) * 4, '\0'));
    return t;
  };
  {  // 41 bytes that asked for a loop of 2^31 heads
    v1::AttendRequest r;
    *r.mutable_q() = tensor({0, 2147483647, 1});
    *r.mutable_k() = tensor({0, 2147483647, 1});
    *r.mutable_v() = tensor({0, 2147483647, 1});
    r.set_return_lse(true);
    cases.push_back({"2^31 heads, no tokens", r, grpc::StatusCode::INVALID_ARGUMENT, "q.shape"});
  }
  {
    v1::AttendRequest r = client::MakeRandomRequest(SmallShape(), 1);
    *r.mutable_q() = tensor({1, 4, 1025, 8});
    *r.mutable_k() = tensor({1, 4, 1025, 8});
    *r.mutable_v() = tensor({1, 4, 1025, 8});
    cases.push_back({"1025 heads", r, grpc::StatusCode::INVALID_ARGUMENT, "q.shape"});
  }
  {
    v1::AttendRequest r;
    *r.mutable_q() = tensor({1, 2, 1, 257});
    *r.mutable_k() = tensor({1, 2, 1, 257});
    *r.mutable_v() = tensor({1, 2, 1, 257});
    cases.push_back({"head_dim 257", r, grpc::StatusCode::INVALID_ARGUMENT, "head_dim"});
  }
  {
    v1::AttendRequest r;
    *r.mutable_q() = tensor({5000, 0, 1, 8});
    *r.mutable_k() = tensor({5000, 0, 1, 8});
    *r.mutable_v() = tensor({5000, 0, 1, 8});
    cases.push_back({"5000 empty sequences", r, grpc::StatusCode::INVALID_ARGUMENT, "q.shape[0]"});
  }
  {
    v1::AttendRequest r;
    *r.mutable_q() = tensor({0, 1, 8});
    *r.mutable_k() = tensor({0, 1, 8});
    *r.mutable_v() = tensor({0, 1, 8});
    for (int i = 0; i < 2000000; ++i) {
      r.add_cu_seqlens_q(0);
      r.add_cu_seqlens_k(0);
    }
    cases.push_back(
        {"2M cu_seqlens entries", r, grpc::StatusCode::INVALID_ARGUMENT, "cu_seqlens_q"});
  }
  {
    v1::AttendRequest r = client::MakeRandomRequest(SmallShape(), 1);
    r.set_window_left(-5);
    cases.push_back({"window_left -5", r, grpc::StatusCode::INVALID_ARGUMENT, "window_left"});
  }
  {
    v1::AttendRequest r;
    // Shapes only, no bytes: refused on the sizes before anything is copied.
    *r.mutable_q() = tensor({0, 64, 128});
    r.mutable_q()->clear_shape();
    for (int64_t d : {int64_t{1} << 22, int64_t{64}, int64_t{128}}) r.mutable_q()->add_shape(d);
    *r.mutable_k() = r.q();
    *r.mutable_v() = r.q();
    cases.push_back(
        {"4M tokens x 64 heads, no bytes", r, grpc::StatusCode::INVALID_ARGUMENT, "q.data"});
  }
  const int64_t rss_before = ResidentBytes(c.server->pid());
  std::string figures;
  for (const Case& k : cases) {
    v1::AttendResponse response;
    const absl::Time t0 = absl::Now();
    const grpc::Status status = c.Attend(k.request, &response);
    const absl::Duration took = absl::Now() - t0;
    absl::StrAppend(&figures, figures.empty() ? "" : "; ", k.name, " -> ", status.error_code(),
                    " in ", absl::FormatDuration(absl::Trunc(took, absl::Microseconds(100))));
    EXPECT_EQ(status.error_code(), k.code) << k.name << ": " << status.error_message();
    EXPECT_TRUE(absl::StartsWith(status.error_message(), k.field))
        << k.name << ": " << status.error_message();
    EXPECT_LT(took, absl::Seconds(2)) << k.name;
  }
  const int64_t rss_after = ResidentBytes(c.server->pid());
  absl::StrAppend(&figures, "; RSS ", rss_before >> 20, " -> ", rss_after >> 20, " MiB");
  Report("shapes", figures);
  EXPECT_TRUE(c.Alive());
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

// Raw bytes through the generic stub, for what a typed stub cannot send.
grpc::Status RawAttend(grpc::GenericStub& stub, const std::string& bytes, std::string* reply) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&context, kAttendMethod, request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  if (reply != nullptr && status.ok()) {
    std::vector<grpc::Slice> slices;
    (void)response.Dump(&slices);
    reply->clear();
    for (const grpc::Slice& s : slices)
      reply->append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return status;
}

// A fixed count of byte mutations of valid requests: every one gets an answer (any status), and
// the server serves valid requests after them.
TEST(Reliability, MutatedRequestsNeverTakeTheServerDown) {
  Connection c = Connect({});
  grpc::GenericStub stub(c.channel);
  std::mt19937_64 random(20261201);
  std::map<grpc::StatusCode, int> codes;
  constexpr int kMutations = 1500;
  ShapeSpec shape = SmallShape(8);
  for (int i = 0; i < kMutations; ++i) {
    shape.varlen = i % 2 == 1;
    shape.return_lse = i % 3 == 0;
    std::string bytes = client::MakeRandomRequest(shape, i).SerializeAsString();
    const int flips = 1 + static_cast<int>(random() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t at = random() % bytes.size();
      switch (random() % 3) {
        case 0:
          bytes[at] = static_cast<char>(random());
          break;
        case 1:
          bytes.erase(at, 1 + random() % 8);
          break;
        default:
          bytes.insert(at, 1 + random() % 4, static_cast<char>(random()));
      }
    }
    ++codes[RawAttend(stub, bytes, nullptr).error_code()];
  }
  std::string figures = absl::StrCat(kMutations, " mutated requests:");
  for (const auto& [code, n] : codes) absl::StrAppend(&figures, " ", code, "x", n);
  const bool alive = c.Alive();
  absl::StrAppend(&figures, "; server alive: ", alive);
  Report("mutation-fuzz", figures);
  EXPECT_EQ(codes.count(grpc::StatusCode::UNAVAILABLE), 0u) << "the server went away";
  EXPECT_EQ(codes.count(grpc::StatusCode::DEADLINE_EXCEEDED), 0u);
  EXPECT_TRUE(alive);
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

// [valid, garbage, valid, valid, valid] on AttendStream: the valid one before the garbage is
// answered, and the stream ends with INVALID_ARGUMENT, never OK.
TEST(Reliability, AnUnparsableStreamMessageEndsTheStreamWithAnError) {
  Connection c = Connect({});
  grpc::GenericStub stub(c.channel);
  grpc::ClientContext context;
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&context, kAttendStreamMethod, &cq);
  auto wait = [&cq] {
    void* tag = nullptr;
    bool ok = false;
    cq.Next(&tag, &ok);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(wait());
  const std::string valid = client::MakeRandomRequest(SmallShape(), 1, "valid").SerializeAsString();
  for (const std::string& bytes : {valid, std::string("\xff\xff\xff"), valid, valid, valid}) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer message(&slice, 1);
    call->Write(message, reinterpret_cast<void*>(2));
    if (!wait()) break;  // the server may end the stream before the last writes
  }
  call->WritesDone(reinterpret_cast<void*>(3));
  wait();
  int responses = 0;
  while (true) {
    grpc::ByteBuffer response;
    call->Read(&response, reinterpret_cast<void*>(4));
    if (!wait()) break;
    ++responses;
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  wait();
  Report("stream-garbage", absl::StrCat(responses, " response(s), stream ended ",
                                        status.error_code(), ": ", status.error_message()));
  EXPECT_EQ(responses, 1);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "message 2")) << status.error_message();
  EXPECT_TRUE(c.Alive());
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
    const std::string request = absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n\r\n");
    (void)!write(fd, request.data(), request.size());
    char buffer[65536];
    ssize_t n = 0;
    while ((n = read(fd, buffer, sizeof(buffer))) > 0) out.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

// The value of the sample of `name` carrying every label in `labels` (in any order).
double CounterValue(const std::string& text, const std::string& name,
                    const std::vector<std::string>& labels) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    bool match = absl::StartsWith(line, absl::StrCat(name, "{"));
    for (const std::string& label : labels) match = match && absl::StrContains(line, label);
    if (match) {
      double value = 0;
      if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) return value;
    }
  }
  return 0;
}

// A request whose deadline passes in the queue counts as DEADLINE_EXCEEDED, not CANCELLED.
TEST(Reliability, ExpiredDeadlinesAreCountedAsSuch) {
  auto server = std::make_unique<ServerProcess>();
  ASSERT_TRUE(
      server->Start(ATTN_SERVER_BINARY, {"--cpu_threads=1", "--metrics_address=127.0.0.1:0",
                                         "--max_queue_delay=400ms", "--max_batch_requests=64"}))
      << server->log();
  std::string metrics_port_text;
  for (int i = 0; i < 100 && metrics_port_text.empty(); ++i) {
    const std::string log = server->log();
    const size_t at = log.find("metrics on port ");
    if (at != std::string::npos) {
      metrics_port_text = log.substr(at + 16, log.find(' ', at + 16) - at - 16);
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  int metrics_port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(metrics_port_text, &metrics_port)) << server->log();
  Connection c = ClientOf(*server);
  v1::AttendResponse response;
  const grpc::Status status =
      c.Attend(client::MakeRandomRequest(SmallShape(), 1), &response, absl::Milliseconds(100));
  absl::SleepFor(absl::Milliseconds(800));  // the batch closes and drops the expired request
  const std::string scrape = HttpGet(metrics_port, "/metrics");
  const double expired = CounterValue(scrape, "attnserve_requests_total",
                                      {"method=\"Attend\"", "code=\"DEADLINE_EXCEEDED\""});
  const double cancelled =
      CounterValue(scrape, "attnserve_requests_total", {"method=\"Attend\"", "code=\"CANCELLED\""});
  Report("deadline", absl::StrCat("client saw ", status.error_code(), "; DEADLINE_EXCEEDED ",
                                  expired, ", CANCELLED ", cancelled));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(expired, 1) << scrape;
  EXPECT_EQ(cancelled, 0);
  EXPECT_EQ(server->Stop(SIGTERM), 0) << server->log();
}

// A mixed run repeated: after the first round has warmed every pool and cache, later rounds do
// not grow the server.
TEST(Reliability, MixedRunsDoNotGrowTheServer) {
  Connection c = Connect({});
  auto buffer = client::SharedMemoryBuffer::Create(1 << 20);
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE(client::RegisterSharedMemory(*c.stub, *c.factory, "mixed", **buffer).ok());
  auto round = [&](int seed) {
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 40; ++i) {
          ShapeSpec shape = SmallShape(16 + (i % 5) * 24);
          shape.varlen = i % 2 == 0;
          shape.return_lse = i % 3 == 0;
          v1::AttendRequest request = client::MakeRandomRequest(shape, seed * 1000 + t * 100 + i);
          if (i % 7 == 3) request.set_window_left(-5);  // an error now and then
          v1::AttendResponse response;
          (void)c.Attend(request, &response);
        }
      });
    }
    for (auto& t : threads) t.join();
    grpc::ClientContext context;
    auto stream = c.stub->AttendStream(&context);
    for (int i = 0; i < 100; ++i) {
      stream->Write(client::MakeRandomRequest(SmallShape(24), seed * 7 + i, absl::StrCat(i)));
    }
    stream->WritesDone();
    v1::AttendResponse response;
    while (stream->Read(&response)) {
    }
    (void)stream->Finish();
  };
  round(1);
  const int64_t warm = ResidentBytes(c.server->pid());
  for (int r = 2; r <= 4; ++r) round(r);
  const int64_t after = ResidentBytes(c.server->pid());
  Report("rss", absl::StrCat("after one mixed round ", warm >> 20, " MiB, after three more ",
                             after >> 20, " MiB (bound: +32 MiB)"));
  if (kRssIsMeaningful) {
    EXPECT_LT(after - warm, int64_t{32} << 20);
  }
  EXPECT_EQ(c.server->Stop(SIGTERM), 0) << c.server->log();
}

}  // namespace
}  // namespace attnserve
