// The /metrics HTTP endpoint on its own, over real loopback sockets: the responses it gives,
// and that clients which misbehave (silent, one byte a second, never reading, too long a head,
// too many at once) neither delay a normal scrape nor hold up the endpoint's destruction.
#include "server/metrics_http_endpoint.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnserve {
namespace {

constexpr char kBody[] = "# TYPE up gauge\nup 1\n";
// Generous for a loaded two-core CI machine; the old endpoint took seconds.
constexpr absl::Duration kPromptly = absl::Seconds(1);

// Static TLS of the size that cuBLAS brings into a CUDA build, twice over: glibc carves it out
// of every thread's stack, which is why civetweb's ~100 KiB worker stacks could not start.
thread_local char tls_ballast[192 << 10];

std::unique_ptr<MetricsHttpEndpoint> StartOrDie(
    MetricsHttpEndpoint::Options options = {},
    std::function<std::string()> render = [] { return std::string(kBody); }) {
  auto endpoint = MetricsHttpEndpoint::Start("127.0.0.1:0", std::move(render), options);
  EXPECT_TRUE(endpoint.ok()) << endpoint.status();
  return endpoint.ok() ? *std::move(endpoint) : nullptr;
}

// One client connection over loopback.
class Client {
 public:
  explicit Client(int port) : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd_);
      fd_ = -1;
    }
  }
  ~Client() {
    if (fd_ >= 0) close(fd_);
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  bool connected() const { return fd_ >= 0; }

  bool Send(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t sent = send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (sent <= 0) return false;
      bytes.remove_prefix(static_cast<size_t>(sent));
    }
    return true;
  }

  // Reads until the server closes the connection (EOF or reset) or `timeout` passes; `closed`
  // says which.
  std::string ReadAll(absl::Duration timeout, bool* closed = nullptr) {
    const absl::Time deadline = absl::Now() + timeout;
    std::string got;
    char buffer[16384];
    while (true) {
      const absl::Duration left = deadline - absl::Now();
      pollfd p{fd_, POLLIN, 0};
      if (left <= absl::ZeroDuration() ||
          poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) {
        if (closed != nullptr) *closed = false;
        return got;
      }
      const ssize_t n = recv(fd_, buffer, sizeof(buffer), 0);
      if (n <= 0) {
        if (closed != nullptr) *closed = true;
        return got;
      }
      got.append(buffer, static_cast<size_t>(n));
    }
  }

  bool ClosedWithin(absl::Duration timeout) {
    bool closed = false;
    ReadAll(timeout, &closed);
    return closed;
  }

 private:
  int fd_;
};

struct Response {
  int status = 0;  // 0: nothing that parses as an HTTP response came back
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
  absl::Duration took;

  std::string header(const std::string& name) const {
    const auto it = headers.find(name);
    return it == headers.end() ? "" : it->second;
  }
};

Response Parse(const std::string& raw) {
  Response r;
  const size_t head_end = raw.find("\r\n\r\n");
  if (head_end == std::string::npos) return r;
  std::vector<std::string> lines = absl::StrSplit(raw.substr(0, head_end), "\r\n");
  std::vector<std::string> status_line = absl::StrSplit(lines[0], absl::MaxSplits(' ', 2));
  if (status_line.size() < 2 || status_line[0] != "HTTP/1.1" ||
      !absl::SimpleAtoi(status_line[1], &r.status)) {
    return r;
  }
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == std::string::npos) continue;
    r.headers[absl::AsciiStrToLower(lines[i].substr(0, colon))] =
        std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
  }
  r.body = raw.substr(head_end + 4);
  return r;
}

// Sends `request` on a fresh connection and reads the answer until the server closes.
Response Exchange(int port, std::string_view request) {
  const absl::Time start = absl::Now();
  Client client(port);
  if (!client.connected() || !client.Send(request)) return {};
  Response r = Parse(client.ReadAll(absl::Seconds(10)));
  r.took = absl::Now() - start;
  return r;
}

Response Scrape(int port) {
  return Exchange(port, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n");
}

// Clients that send a request one byte a second, from a thread of their own, until stopped.
class Drippers {
 public:
  Drippers(int port, int count) {
    for (int i = 0; i < count; ++i) clients_.push_back(std::make_unique<Client>(port));
    thread_ = std::thread([this] {
      const std::string request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: yes\r\n";
      for (size_t i = 0; !stop_.WaitForNotificationWithTimeout(absl::Seconds(1)); ++i) {
        for (auto& c : clients_) c->Send(std::string_view(&request[i % request.size()], 1));
        sent_.fetch_add(1);
      }
    });
  }
  ~Drippers() {
    stop_.Notify();
    thread_.join();
  }
  // Bytes each client has sent so far.
  int sent() const { return sent_.load(); }
  Client& client(int i) { return *clients_[i]; }

 private:
  std::vector<std::unique_ptr<Client>> clients_;
  absl::Notification stop_;
  std::atomic<int> sent_{0};
  std::thread thread_;
};

TEST(MetricsHttpEndpoint, ServesTheRenderedTextAtMetrics) {
  auto endpoint = StartOrDie();
  ASSERT_NE(endpoint, nullptr);
  ASSERT_GT(endpoint->port(), 0);
  const Response r = Scrape(endpoint->port());
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.header("content-type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(r.header("content-length"), absl::StrCat(sizeof(kBody) - 1));
  EXPECT_EQ(r.header("connection"), "close");
  EXPECT_EQ(r.body, kBody);
  // A query string does not change the resource, nor does the absolute form; HTTP/1.0 clients
  // and bare LF line ends are answered too.
  for (const char* request :
       {"GET /metrics?x=1 HTTP/1.0\r\n\r\n", "GET http://127.0.0.1:9464/metrics HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/1.0\n\n"}) {
    const Response r = Exchange(endpoint->port(), request);
    EXPECT_EQ(r.status, 200) << absl::CEscape(request);
    EXPECT_EQ(r.body, kBody) << absl::CEscape(request);
  }
}

TEST(MetricsHttpEndpoint, HeadHasTheHeadersButNoBody) {
  auto endpoint = StartOrDie();
  ASSERT_NE(endpoint, nullptr);
  const Response r = Exchange(endpoint->port(), "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.header("content-length"), absl::StrCat(sizeof(kBody) - 1));
  EXPECT_EQ(r.body, "");
}

TEST(MetricsHttpEndpoint, OtherPathsAre404AndOtherMethods405) {
  auto endpoint = StartOrDie();
  ASSERT_NE(endpoint, nullptr);
  for (const char* path : {"/", "/metricsx", "/metrics/", "/favicon.ico"}) {
    const Response r = Exchange(endpoint->port(), absl::StrCat("GET ", path, " HTTP/1.1\r\n\r\n"));
    EXPECT_EQ(r.status, 404) << path;
    EXPECT_EQ(r.header("connection"), "close") << path;
  }
  for (const char* method : {"POST", "PUT", "DELETE", "OPTIONS"}) {
    const Response r = Exchange(
        endpoint->port(), absl::StrCat(method, " /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n"));
    EXPECT_EQ(r.status, 405) << method;
    EXPECT_EQ(r.header("allow"), "GET, HEAD") << method;
  }
}

TEST(MetricsHttpEndpoint, MalformedRequestsAre400) {
  auto endpoint = StartOrDie();
  ASSERT_NE(endpoint, nullptr);
  for (const char* request :
       {"\r\n\r\n", "GET\r\n\r\n", "GET /metrics\r\n\r\n", "GET /metrics SPDY/3\r\n\r\n",
        "GET  /metrics HTTP/1.1\r\n\r\n", "GET metrics HTTP/1.1\r\n\r\n"}) {
    EXPECT_EQ(Exchange(endpoint->port(), request).status, 400) << absl::CEscape(request);
  }
  EXPECT_EQ(Exchange(endpoint->port(), "GET /metrics HTTP/2.0\r\n\r\n").status, 505);
}

TEST(MetricsHttpEndpoint, AnOverLongHeadIs431) {
  auto endpoint = StartOrDie();
  ASSERT_NE(endpoint, nullptr);
  const std::string request =
      absl::StrCat("GET /metrics HTTP/1.1\r\nX-Pad: ", std::string(16384, 'a'), "\r\n\r\n");
  const Response r = Exchange(endpoint->port(), request);
  EXPECT_EQ(r.status, 431);
  EXPECT_EQ(r.header("connection"), "close");
  // A head just under the limit is still served.
  const std::string fits =
      absl::StrCat("GET /metrics HTTP/1.1\r\nX-Pad: ", std::string(7000, 'a'), "\r\n\r\n");
  EXPECT_EQ(Exchange(endpoint->port(), fits).status, 200);
}

TEST(MetricsHttpEndpoint, SlowAndSilentClientsDoNotDelayAScrape) {
  auto endpoint = StartOrDie();
  ASSERT_NE(endpoint, nullptr);
  std::vector<std::unique_ptr<Client>> silent;
  for (int i = 0; i < 4; ++i) silent.push_back(std::make_unique<Client>(endpoint->port()));
  Drippers drippers(endpoint->port(), 4);
  absl::SleepFor(absl::Milliseconds(1500));  // every dripper has sent a byte
  ASSERT_GE(drippers.sent(), 1);
  for (int i = 0; i < 3; ++i) {
    const Response r = Scrape(endpoint->port());
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.body, kBody);
    EXPECT_LT(r.took, kPromptly);
  }
}

TEST(MetricsHttpEndpoint, AHeadNotInByTheDeadlineEndsTheConnection) {
  MetricsHttpEndpoint::Options options;
  options.head_timeout = absl::Milliseconds(1500);
  auto endpoint = StartOrDie(options);
  ASSERT_NE(endpoint, nullptr);
  const absl::Time start = absl::Now();
  Client silent(endpoint->port());
  Drippers drippers(endpoint->port(), 1);
  // The dripper's bytes do not extend the deadline: it is for the whole head.
  bool closed = false;
  const Response r = Parse(drippers.client(0).ReadAll(absl::Seconds(5), &closed));
  EXPECT_TRUE(closed);
  EXPECT_EQ(r.status, 408);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1400));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500) + kPromptly);
  EXPECT_TRUE(silent.ClosedWithin(absl::Seconds(1)));
}

TEST(MetricsHttpEndpoint, ConnectionsBeyondTheBoundEvictTheOldest) {
  MetricsHttpEndpoint::Options options;
  options.max_connections = 4;
  auto endpoint = StartOrDie(options);
  ASSERT_NE(endpoint, nullptr);
  std::vector<std::unique_ptr<Client>> silent;
  for (int i = 0; i < options.max_connections; ++i) {
    silent.push_back(std::make_unique<Client>(endpoint->port()));
    absl::SleepFor(absl::Milliseconds(20));  // accepted in this order
  }
  const Response r = Scrape(endpoint->port());
  EXPECT_EQ(r.status, 200);
  EXPECT_LT(r.took, kPromptly);
  EXPECT_TRUE(silent[0]->ClosedWithin(absl::Seconds(1)));
  for (int i = 1; i < options.max_connections; ++i) {
    EXPECT_FALSE(silent[i]->ClosedWithin(absl::Milliseconds(50))) << i;
  }
}

TEST(MetricsHttpEndpoint, ConcurrentScrapesAreAllAnswered) {
  std::atomic<int> renders{0};
  auto endpoint = StartOrDie({}, [&renders] {
    renders.fetch_add(1);
    return std::string(kBody);
  });
  ASSERT_NE(endpoint, nullptr);
  constexpr int kThreads = 8, kEach = 25;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) {
        const Response r = Scrape(endpoint->port());
        if (r.status == 200 && r.body == kBody) ok.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads * kEach);
  EXPECT_EQ(renders.load(), kThreads * kEach);
}

TEST(MetricsHttpEndpoint, AClientThatDoesNotReadDoesNotDelayAScrape) {
  // Large enough to fill both socket buffers, so the response cannot all be sent.
  const std::string big(64 << 20, 'x');
  std::atomic<bool> small{false};
  auto endpoint =
      StartOrDie({}, [&] { return small.load() ? std::string(kBody) : std::string(big); });
  ASSERT_NE(endpoint, nullptr);
  Client stalled(endpoint->port());
  ASSERT_TRUE(stalled.Send("GET /metrics HTTP/1.1\r\n\r\n"));
  absl::SleepFor(absl::Milliseconds(300));
  small = true;
  const Response r = Scrape(endpoint->port());
  EXPECT_EQ(r.status, 200);
  EXPECT_LT(r.took, kPromptly);
}

TEST(MetricsHttpEndpoint, DestructionWithHungConnectionsIsPrompt) {
  const std::string big(64 << 20, 'x');
  auto endpoint = StartOrDie({}, [&] { return big; });
  ASSERT_NE(endpoint, nullptr);
  auto drippers = std::make_unique<Drippers>(endpoint->port(), 3);
  std::vector<std::unique_ptr<Client>> silent;
  for (int i = 0; i < 4; ++i) silent.push_back(std::make_unique<Client>(endpoint->port()));
  Client stalled(endpoint->port());
  ASSERT_TRUE(stalled.Send("GET /metrics HTTP/1.1\r\n\r\n"));
  absl::SleepFor(absl::Milliseconds(1500));

  // Destroyed on a thread of its own, so that a destructor that hangs fails the test instead
  // of timing it out.
  absl::Notification destroyed;
  const absl::Time start = absl::Now();
  std::thread destroyer([&] {
    endpoint.reset();
    destroyed.Notify();
  });
  EXPECT_TRUE(destroyed.WaitForNotificationWithTimeout(kPromptly));
  EXPECT_LT(absl::Now() - start, kPromptly);
  if (!destroyed.HasBeenNotified()) drippers.reset();  // what held it, so that it can end
  destroyer.join();
  for (auto& c : silent) EXPECT_TRUE(c->ClosedWithin(absl::Seconds(1)));
  if (drippers != nullptr) {
    EXPECT_TRUE(drippers->client(0).ClosedWithin(absl::Seconds(1)));
  }
}

TEST(MetricsHttpEndpoint, StartsWithALargeStaticTlsInTheProcess) {
  volatile char* ballast = tls_ballast;  // keeps the ballast in the binary
  ballast[sizeof(tls_ballast) - 1] = 1;
  auto endpoint = StartOrDie();
  ASSERT_NE(endpoint, nullptr);
  EXPECT_EQ(Scrape(endpoint->port()).status, 200);
}

TEST(MetricsHttpEndpoint, AnAddressItCannotListenOnIsUnavailableAndOptionsAreChecked) {
  auto render = [] { return std::string(); };
  for (const char* address : {"203.0.113.7:9464", "127.0.0.1:", "127.0.0.1:notaport"}) {
    auto endpoint = MetricsHttpEndpoint::Start(address, render);
    ASSERT_FALSE(endpoint.ok()) << address;
    EXPECT_EQ(endpoint.status().code(), absl::StatusCode::kUnavailable) << address;
    EXPECT_TRUE(absl::StrContains(endpoint.status().message(), address))
        << endpoint.status().message();
  }
  MetricsHttpEndpoint::Options no_connections;
  no_connections.max_connections = 0;
  EXPECT_EQ(MetricsHttpEndpoint::Start("127.0.0.1:0", render, no_connections).status().code(),
            absl::StatusCode::kInvalidArgument);
  MetricsHttpEndpoint::Options forever;
  forever.head_timeout = absl::InfiniteDuration();
  EXPECT_EQ(MetricsHttpEndpoint::Start("127.0.0.1:0", render, forever).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto first = MetricsHttpEndpoint::Start("127.0.0.1:0", render);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MetricsHttpEndpoint::Start(absl::StrCat("127.0.0.1:", (*first)->port()), render);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attnserve
