// The Prometheus exporter: the IO formulas and reason mapping, then the real attnserve binary
// (CPU engine) with --metrics_address on an ephemeral loopback port, driven by the client
// library, scraped over plain HTTP before and after: every counter must move by exactly what
// the requests sent account for, and `promtool check metrics` must accept the scrape.
#include "server/metrics.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attn/problem.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "clients/cli/channel_factory.h"
#include "clients/cli/request_factory.h"
#include "tests/server/server_process.h"

namespace attnserve {
namespace {

using test_support::ServerProcess;
using Samples = std::map<std::string, double>;

// GET http://127.0.0.1:`port``path` with HTTP/1.0 (the server closes after the response);
// returns the body of a 200 answer.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to port ", port, " failed"));
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("send failed");
  }
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = recv(fd, buffer, sizeof(buffer), 0)) > 0;) response.append(buffer, n);
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (body == std::string::npos || !absl::StartsWith(response, "HTTP/1.")) {
    return absl::DataLossError(absl::StrCat("not an HTTP response: ", response.substr(0, 200)));
  }
  if (response.find(" 200 ") > response.find("\r\n")) {
    return absl::FailedPreconditionError(response.substr(0, response.find("\r\n")));
  }
  return response.substr(body + 4);
}

// Text exposition -> {"name{labels}": value}.
Samples Parse(const std::string& text) {
  Samples samples;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    samples[line.substr(0, space)] = std::strtod(line.c_str() + space + 1, nullptr);
  }
  return samples;
}

double Get(const Samples& s, const std::string& key) {
  const auto it = s.find(key);
  return it == s.end() ? 0.0 : it->second;
}

std::string MakeTempDir() {
  std::string dir = (std::filesystem::temp_directory_path() / "attn_metrics_XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) return "";
  return dir;
}

std::string ReadPort(const std::string& file) {
  std::ifstream in(file);
  std::string port;
  in >> port;
  return port;
}

// A server with the exporter on a free port, and a client stub for it.
struct ExportingServer {
  std::string dir;
  ServerProcess server;
  int metrics_port = 0;
  std::unique_ptr<client::ChannelFactory> factory;
  std::unique_ptr<v1::AttentionService::Stub> stub;

  // Fails the test (ASSERT) when the server or its exporter does not come up.
  void Start() {
    dir = MakeTempDir();
    ASSERT_FALSE(dir.empty());
    const std::string port_file = dir + "/metrics_port";
    ASSERT_TRUE(server.Start(
        ATTN_SERVER_BINARY,
        {"--cpu_threads=1", "--metrics_address=127.0.0.1:0", "--metrics_port_file=" + port_file}))
        << server.log();
    metrics_port = std::atoi(ReadPort(port_file).c_str());
    ASSERT_GT(metrics_port, 0);
    client::ChannelOptions options;
    options.target = server.target();
    factory = std::make_unique<client::ChannelFactory>(options);
    stub = v1::AttentionService::NewStub(*factory->Connect());
  }
};

TEST(MetricsFormulas, FusedAndNaiveIoBytes) {
  // Two sequences (3 x 5 and 4 x 2 tokens), 4 query heads, 2 KV heads, head_dim 8, bf16.
  attn::AttentionProblem p;
  p.dtype = attn::DType::kBF16;
  p.num_heads = 4;
  p.num_kv_heads = 2;
  p.head_dim = 8;
  p.cu_seqlens_q = {0, 3, 7};
  p.cu_seqlens_k = {0, 5, 7};
  const int64_t q = 7 * 4 * 8 * 2, kv = 7 * 2 * 8 * 2, lse = 7 * 4 * 4;
  EXPECT_EQ(FusedIoBytes(p, false), 2 * q + 2 * kv);
  EXPECT_EQ(FusedIoBytes(p, true), 2 * q + 2 * kv + lse);
  // S float32 written and read, P bf16 written and read, over 3*5 + 4*2 pairs per head.
  EXPECT_EQ(NaiveIoBytes(p, true), FusedIoBytes(p, true) + 4 * (15 + 8) * (4 + 4 + 2 + 2));
}

TEST(MetricsFormulas, FallbackReasonsAreBounded) {
  using R = Metrics::PathReason;
  EXPECT_EQ(Metrics::FallbackReason(attn::Refusal::kUnsupportedDtype), R::kUnsupportedDtype);
  EXPECT_EQ(Metrics::FallbackReason(attn::Refusal::kUnsupportedHeadDim), R::kUnsupportedHeadDim);
  EXPECT_EQ(Metrics::FallbackReason(attn::Refusal::kUnaligned), R::kUnaligned);
  EXPECT_EQ(Metrics::FallbackReason(attn::Refusal::kTooLarge), R::kUnsupported);
  EXPECT_EQ(Metrics::FallbackReason(attn::Refusal::kOther), R::kUnsupported);
}

// The GPU-only gauges, through the hooks the lanes call (no GPU needed).
TEST(MetricsHooks, MemoryGaugesSumLanesAndKeepPeaks) {
  Metrics m;
  EXPECT_FALSE(absl::StrContains(m.Scrape(), "attnserve_device_memory_used_bytes{"));
  using M = Metrics::Memory;
  m.OnPoolReserved("cuda:1", M::kDevice, 4 << 20);
  m.OnPoolReserved("cuda:1", M::kDevice, 2 << 20);  // a second lane
  m.OnPoolInUse("cuda:1", M::kDevice, 3000);
  m.OnPoolInUse("cuda:1", M::kDevice, 5000);
  m.OnPoolInUse("cuda:1", M::kDevice, -3000);
  m.OnDeviceMemory("cuda:1", 700, 1000);
  m.OnDeviceMemory("cuda:1", 400, 1000);
  const Samples s = Parse(m.Scrape());
  EXPECT_EQ(Get(s, R"(attnserve_pool_reserved_bytes{device="cuda:1",memory="device"})"), 6 << 20);
  EXPECT_EQ(Get(s, R"(attnserve_pool_in_use_bytes{device="cuda:1",memory="device"})"), 5000);
  EXPECT_EQ(Get(s, R"(attnserve_pool_in_use_peak_bytes{device="cuda:1",memory="device"})"), 8000);
  EXPECT_EQ(Get(s, R"(attnserve_device_memory_used_bytes{device="cuda:1"})"), 400);
  EXPECT_EQ(Get(s, R"(attnserve_device_memory_used_peak_bytes{device="cuda:1"})"), 700);
  EXPECT_EQ(Get(s, R"(attnserve_device_memory_total_bytes{device="cuda:1"})"), 1000);
}

TEST(MetricsHooks, QueueAndInFlightGauges) {
  Metrics m;
  m.OnQueued();
  m.OnQueued();
  m.OnDequeued(2);
  m.OnFinished(Metrics::Method::kAttend, absl::OkStatus(), absl::Milliseconds(1),
               absl::Milliseconds(3));
  Samples s = Parse(m.Scrape());
  EXPECT_EQ(Get(s, "attnserve_requests_queued"), 0);
  EXPECT_EQ(Get(s, "attnserve_requests_in_flight"), 1);
  EXPECT_EQ(Get(s, R"(attnserve_request_duration_seconds_bucket{method="Attend",le="0.0025"})"), 0);
  EXPECT_EQ(Get(s, R"(attnserve_request_duration_seconds_bucket{method="Attend",le="0.005"})"), 1);
  // Each method's latency is a series of its own, there (at 0) before its first request.
  EXPECT_EQ(s.count("attnserve_request_duration_seconds_count"), 0);
  EXPECT_EQ(s.count(R"(attnserve_request_duration_seconds_count{method="AttendBackward"})"), 1);
  EXPECT_EQ(Get(s, R"(attnserve_request_duration_seconds_count{method="AttendBackward"})"), 0);
  m.OnFinished(Metrics::Method::kAttendStream, absl::DeadlineExceededError("late"),
               absl::Seconds(2), absl::Seconds(2));
  s = Parse(m.Scrape());
  EXPECT_EQ(Get(s, R"(attnserve_request_duration_seconds_count{method="Attend"})"), 1);
  EXPECT_EQ(Get(s, R"(attnserve_request_duration_seconds_count{method="AttendStream"})"), 1);
  EXPECT_EQ(Get(s, R"(attnserve_request_duration_seconds_sum{method="AttendStream"})"), 2);
  // The queue wait stays one series for every method.
  EXPECT_EQ(Get(s, "attnserve_queue_wait_seconds_count"), 2);
  EXPECT_EQ(Get(s, "attnserve_requests_in_flight"), 0);
  EXPECT_EQ(Get(s, R"(attnserve_requests_total{code="DEADLINE_EXCEEDED",method="AttendStream"})"),
            1);
  EXPECT_EQ(m.Snapshot().requests_failed(), 1);
}

// Two sequences of 17 queries over 33 keys, 4 query heads on 2 KV heads, d = 32 (float32).
client::ShapeSpec TwoSequenceGqaShape() {
  client::ShapeSpec s;
  s.batch = 2;
  s.seqlen_q = 17;
  s.seqlen_k = 33;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 32;
  return s;
}

TEST(MetricsExporter, CountersMoveByWhatTheRequestsAccountFor) {
  ExportingServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start());
  ServerProcess& server = s.server;
  const std::string& dir = s.dir;
  const int metrics_port = s.metrics_port;
  client::ChannelFactory& factory = *s.factory;
  auto& stub = s.stub;
  EXPECT_TRUE(absl::StrContains(server.log(), absl::StrCat("metrics on port ", metrics_port)))
      << server.log();

  absl::StatusOr<std::string> before_text = HttpGet(metrics_port, "/metrics");
  ASSERT_TRUE(before_text.ok()) << before_text.status();
  const Samples before = Parse(*before_text);

  // Unary requests that succeed, all with the LSE so the IO formula is exact after packing.
  client::ShapeSpec shape = TwoSequenceGqaShape();
  shape.causal = true;
  shape.return_lse = true;
  constexpr int kOk = 5;
  attn::AttentionProblem one =
      attn::DenseProblem(attn::DType::kF32, 2, 17, 33, 4, 2, 32, /*causal=*/true);
  for (int i = 0; i < kOk; ++i) {
    grpc::ClientContext context;
    factory.Prepare(&context, absl::Seconds(30));
    v1::AttendResponse response;
    const grpc::Status status =
        stub->Attend(&context, client::MakeRandomRequest(shape, i, "ok"), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  // Two refused at admission: a short tensor, and a path this server does not have.
  {
    v1::AttendRequest bad = client::MakeRandomRequest(shape, 99, "short");
    bad.mutable_q()->mutable_data()->resize(8);
    grpc::ClientContext context;
    factory.Prepare(&context, absl::Seconds(30));
    v1::AttendResponse response;
    EXPECT_EQ(stub->Attend(&context, bad, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    client::ShapeSpec fused = shape;
    fused.path = v1::PATH_FUSED;
    grpc::ClientContext context;
    factory.Prepare(&context, absl::Seconds(30));
    v1::AttendResponse response;
    EXPECT_EQ(stub->Attend(&context, client::MakeRandomRequest(fused, 98, "fused"), &response)
                  .error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Two on one stream, each counted under AttendStream, asking for the CPU path by name.
  {
    client::ShapeSpec cpu = shape;
    cpu.path = v1::PATH_CPU;
    grpc::ClientContext context;
    factory.Prepare(&context, absl::Seconds(30));
    auto stream = stub->AttendStream(&context);
    ASSERT_TRUE(stream->Write(client::MakeRandomRequest(cpu, 50, "s0")));
    ASSERT_TRUE(stream->Write(client::MakeRandomRequest(cpu, 51, "s1")));
    stream->WritesDone();
    v1::AttendResponse response;
    int answered = 0;
    while (stream->Read(&response)) {
      EXPECT_FALSE(response.has_error()) << response.error().message();
      ++answered;
    }
    EXPECT_TRUE(stream->Finish().ok());
    EXPECT_EQ(answered, 2);
  }

  absl::StatusOr<std::string> after_text = HttpGet(metrics_port, "/metrics");
  ASSERT_TRUE(after_text.ok()) << after_text.status();
  const Samples after = Parse(*after_text);
  auto delta = [&](const std::string& key) { return Get(after, key) - Get(before, key); };

  constexpr int kRan = kOk + 2;
  EXPECT_EQ(delta(R"(attnserve_requests_total{code="OK",method="Attend"})"), kOk);
  EXPECT_EQ(delta(R"(attnserve_requests_total{code="INVALID_ARGUMENT",method="Attend"})"), 2);
  EXPECT_EQ(delta(R"(attnserve_requests_total{code="OK",method="AttendStream"})"), 2);
  EXPECT_EQ(Get(after, "attnserve_requests_in_flight"), 0);
  EXPECT_EQ(Get(after, "attnserve_requests_queued"), 0);
  // Latency by method: the refused requests were never admitted, so only those that ran count.
  EXPECT_EQ(delta(R"(attnserve_request_duration_seconds_count{method="Attend"})"), kOk);
  EXPECT_EQ(delta(R"(attnserve_request_duration_seconds_count{method="AttendStream"})"), 2);
  EXPECT_EQ(delta(R"(attnserve_request_duration_seconds_count{method="AttendBackward"})"), 0);
  EXPECT_GT(delta(R"(attnserve_request_duration_seconds_sum{method="Attend"})"), 0);
  EXPECT_EQ(delta(R"(attnserve_request_duration_seconds_bucket{method="Attend",le="+Inf"})"), kOk);
  EXPECT_EQ(after.count("attnserve_request_duration_seconds_count"), 0);
  EXPECT_EQ(delta("attnserve_queue_wait_seconds_count"), kRan);

  EXPECT_EQ(delta(R"(attnserve_path_total{path="cpu",reason="no_gpu"})"), kOk);
  EXPECT_EQ(delta(R"(attnserve_path_total{path="cpu",reason="requested"})"), 2);
  EXPECT_EQ(delta(R"(attnserve_tokens_total{kind="query",path="cpu"})"), kRan * 2 * 17);
  EXPECT_EQ(delta(R"(attnserve_tokens_total{kind="key",path="cpu"})"), kRan * 2 * 33);
  EXPECT_DOUBLE_EQ(delta(R"(attnserve_flops_total{path="cpu"})"), kRan * one.forward_flops());
  EXPECT_EQ(delta(R"(attnserve_fused_io_bytes_total{path="cpu"})"), kRan * FusedIoBytes(one, true));
  EXPECT_EQ(delta(R"(attnserve_naive_io_bytes_equivalent_total{path="cpu"})"),
            kRan * NaiveIoBytes(one, true));
  const double launches = delta(R"(attnserve_compute_seconds_count{path="cpu"})");
  EXPECT_GE(launches, 1);
  EXPECT_LE(launches, kRan);
  EXPECT_GT(delta(R"(attnserve_compute_seconds_sum{path="cpu"})"), 0);
  EXPECT_EQ(delta(R"(attnserve_batch_requests_count{path="cpu"})"), launches);
  EXPECT_EQ(delta(R"(attnserve_batch_requests_sum{path="cpu"})"), kRan);
  EXPECT_EQ(delta(R"(attnserve_batch_tokens_sum{path="cpu"})"), kRan * 2 * (17 + 33));

  EXPECT_GT(Get(after, R"(attnserve_pool_reserved_bytes{device="cpu",memory="host"})"), 0);
  EXPECT_EQ(Get(after, R"(attnserve_pool_in_use_bytes{device="cpu",memory="host"})"), 0);
  // What a batch stages depends on the batcher (a lone request on a host engine may need only
  // its LSE there), so only "something was used" is exact.
  EXPECT_GT(Get(after, R"(attnserve_pool_in_use_peak_bytes{device="cpu",memory="host"})"), 0);
  EXPECT_EQ(Get(after, R"(attnserve_build_info{cuda="false",version="0.1.0"})"), 1);
  // A CPU-only server exports no device numbers at all, and every series is the server's own
  // (the endpoint adds none of its own, unlike prometheus-cpp's Exposer and its exposer_*).
  for (const auto& [key, value] : after) {
    EXPECT_TRUE(absl::StartsWith(key, "attnserve_")) << key;
    EXPECT_FALSE(absl::StartsWith(key, "attnserve_device_memory")) << key;
    EXPECT_EQ(key.find("cuda:"), std::string::npos) << key;
  }

#ifdef ATTN_PROMTOOL
  const std::string scrape = dir + "/scrape.txt";
  std::ofstream(scrape) << *after_text;
  const std::string command =
      absl::StrCat(ATTN_PROMTOOL, " check metrics < ", scrape, " > ", dir, "/promtool.txt 2>&1");
  const int rc = std::system(command.c_str());
  std::ifstream lint(dir + "/promtool.txt");
  const std::string lint_text((std::istreambuf_iterator<char>(lint)), {});
  EXPECT_EQ(rc, 0) << "promtool check metrics:\n" << lint_text;
#endif
  EXPECT_EQ(server.Stop(SIGTERM), 0) << server.log();
  std::filesystem::remove_all(dir);
}

TEST(MetricsExporter, BackwardIsCountedUnderItsOwnMethod) {
  ExportingServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start());
  ServerProcess& server = s.server;
  const int metrics_port = s.metrics_port;
  client::ChannelFactory& factory = *s.factory;
  auto& stub = s.stub;
  absl::StatusOr<std::string> before_text = HttpGet(metrics_port, "/metrics");
  ASSERT_TRUE(before_text.ok()) << before_text.status();
  const Samples before = Parse(*before_text);

  const client::ShapeSpec shape = TwoSequenceGqaShape();
  const attn::AttentionProblem one =
      attn::DenseProblem(attn::DType::kF32, 2, 17, 33, 4, 2, 32, /*causal=*/false);
  {  // no O and LSE: the server runs the forward too
    grpc::ClientContext context;
    factory.Prepare(&context, absl::Seconds(30));
    v1::AttendBackwardResponse response;
    const grpc::Status status = stub->AttendBackward(
        &context, client::MakeRandomBackwardRequest(shape, 1, "bw"), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  {
    v1::AttendBackwardRequest bad = client::MakeRandomBackwardRequest(shape, 2, "bw-bad");
    bad.clear_d_o();
    grpc::ClientContext context;
    factory.Prepare(&context, absl::Seconds(30));
    v1::AttendBackwardResponse response;
    EXPECT_EQ(stub->AttendBackward(&context, bad, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  absl::StatusOr<std::string> after_text = HttpGet(metrics_port, "/metrics");
  ASSERT_TRUE(after_text.ok()) << after_text.status();
  const Samples after = Parse(*after_text);
  auto delta = [&](const std::string& key) { return Get(after, key) - Get(before, key); };
  EXPECT_EQ(delta(R"(attnserve_requests_total{code="OK",method="AttendBackward"})"), 1);
  EXPECT_EQ(delta(R"(attnserve_requests_total{code="INVALID_ARGUMENT",method="AttendBackward"})"),
            1);
  EXPECT_EQ(delta(R"(attnserve_requests_total{code="OK",method="Attend"})"), 0);
  // The one admitted backward request is timed under its own method, not with the forwards.
  EXPECT_EQ(delta(R"(attnserve_request_duration_seconds_count{method="AttendBackward"})"), 1);
  EXPECT_GT(delta(R"(attnserve_request_duration_seconds_sum{method="AttendBackward"})"), 0);
  EXPECT_EQ(delta(R"(attnserve_request_duration_seconds_count{method="Attend"})"), 0);
  EXPECT_DOUBLE_EQ(delta(R"(attnserve_flops_total{path="cpu"})"), 3.5 * one.forward_flops());
  EXPECT_EQ(delta(R"(attnserve_tokens_total{kind="query",path="cpu"})"), 2 * 17);
  EXPECT_EQ(delta(R"(attnserve_fused_io_bytes_total{path="cpu"})"), 0);
  EXPECT_EQ(delta(R"(attnserve_compute_seconds_count{path="cpu"})"), 1);
  EXPECT_EQ(Get(after, "attnserve_requests_in_flight"), 0);
  EXPECT_EQ(Get(after, R"(attnserve_pool_in_use_bytes{device="cpu",memory="host"})"), 0);
  EXPECT_EQ(server.Stop(SIGTERM), 0) << server.log();
  std::filesystem::remove_all(s.dir);
}

TEST(MetricsExporter, AnAddressThatCannotBeBoundStopsTheServer) {
  ServerProcess server;
  // TEST-NET-3: never an address of this machine.
  EXPECT_FALSE(server.Start(ATTN_SERVER_BINARY,
                            {"--cpu_threads=1", "--metrics_address=203.0.113.7:9464"},
                            absl::Seconds(15)));
  EXPECT_TRUE(absl::StrContains(server.log(), "--metrics_address=203.0.113.7:9464"))
      << server.log();
}

TEST(MetricsExporter, AnEmptyAddressDisablesIt) {
  ServerProcess server;
  ASSERT_TRUE(server.Start(ATTN_SERVER_BINARY, {"--cpu_threads=1", "--metrics_address="}))
      << server.log();
  EXPECT_FALSE(absl::StrContains(server.log(), "metrics on port")) << server.log();
  EXPECT_EQ(server.Stop(SIGTERM), 0) << server.log();
}

}  // namespace
}  // namespace attnserve
