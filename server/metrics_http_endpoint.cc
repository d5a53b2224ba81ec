#include "server/metrics_http_endpoint.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

using Clock = std::chrono::steady_clock;

// glibc carves a thread's static TLS (with cuBLAS linked, ~110 KiB) out of the top of its
// stack; 1 MiB holds that and the serializer's frames with room to spare.
constexpr size_t kThreadStackBytes = size_t{1} << 20;
// After its response a connection is read and discarded for this long before it is closed:
// closing with unread bytes (a request body, a client still sending an over-long head) would
// send a reset, and the client could lose the response it had not read yet.
constexpr Clock::duration kLinger = std::chrono::seconds(1);
// accept() failing for lack of descriptors or memory leaves the listening socket readable;
// polling it again at once would spin.
constexpr Clock::duration kAcceptBackoff = std::chrono::milliseconds(100);
constexpr int kAcceptsPerWake = 64;
constexpr int kListenBacklog = 128;

constexpr std::string_view kExpositionType = "text/plain; version=0.0.4; charset=utf-8";
constexpr std::string_view kTextType = "text/plain; charset=utf-8";

absl::Status Unavailable(const std::string& address, std::string_view why) {
  return absl::UnavailableError(absl::StrCat("--metrics_address=", address,
                                             ": cannot listen there (", std::string(why), ")"));
}

// Splits "host:port", "[v6]:port" or "port" into host ("" = every interface) and port.
bool SplitAddress(const std::string& address, std::string* host, std::string* port) {
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find("]:");
    if (close == std::string::npos) return false;
    *host = address.substr(1, close - 1);
    *port = address.substr(close + 2);
  } else if (const size_t colon = address.rfind(':'); colon != std::string::npos) {
    *host = address.substr(0, colon);
    *port = address.substr(colon + 1);
  } else {
    host->clear();
    *port = address;
  }
  if (*host == "0.0.0.0" || *host == "::" || *host == "*") host->clear();
  return !port->empty();
}

std::string Response(std::string_view status, std::string_view content_type, std::string_view body,
                     bool with_body, std::string_view extra_headers = "") {
  std::string out = absl::StrCat("HTTP/1.1 ", std::string(status),
                                 "\r\nContent-Type: ", std::string(content_type),
                                 "\r\nContent-Length: ", body.size(), "\r\n",
                                 std::string(extra_headers), "Connection: close\r\n\r\n");
  if (with_body) out.append(body);
  return out;
}

// Where the request head ends (just past the empty line that closes it), or npos. Lines end
// in CRLF; a bare LF is taken too (RFC 9112, section 2.2). `from` skips what was searched.
size_t HeadEnd(std::string_view in, size_t from) {
  for (size_t i = in.find('\n', from); i != std::string_view::npos; i = in.find('\n', i + 1)) {
    if (i + 1 < in.size() && in[i + 1] == '\n') return i + 2;
    if (i + 2 < in.size() && in[i + 1] == '\r' && in[i + 2] == '\n') return i + 3;
  }
  return std::string_view::npos;
}

// The response to a complete request head.
std::string Answer(std::string_view head, const std::function<std::string()>& render) {
  std::string_view line = head.substr(0, head.find('\n'));
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  // method SP request-target SP HTTP-version, single spaces (RFC 9112, section 3).
  const size_t method_end = line.find(' ');
  const size_t target_end =
      method_end == std::string_view::npos ? method_end : line.find(' ', method_end + 1);
  if (target_end == std::string_view::npos || line.find(' ', target_end + 1) != line.npos ||
      method_end == 0 || target_end == method_end + 1) {
    return Response("400 Bad Request", kTextType, "bad request line\n", true);
  }
  const std::string_view method = line.substr(0, method_end);
  std::string_view target = line.substr(method_end + 1, target_end - method_end - 1);
  const std::string_view version = line.substr(target_end + 1);
  if (version.substr(0, 5) != "HTTP/") {
    return Response("400 Bad Request", kTextType, "bad request line\n", true);
  }
  if (version.size() != 8 || version.substr(0, 7) != "HTTP/1." || version[7] < '0' ||
      version[7] > '9') {
    return Response("505 HTTP Version Not Supported", kTextType, "HTTP/1.x only\n", true);
  }
  // The absolute form (a request to a proxy) names the same resource.
  if (const size_t scheme = target.find("://");
      scheme != std::string_view::npos && target.front() != '/') {
    const size_t path = target.find('/', scheme + 3);
    target = path == std::string_view::npos ? "/" : target.substr(path);
  }
  if (target.front() != '/') {
    return Response("400 Bad Request", kTextType, "bad request target\n", true);
  }
  const std::string_view path = target.substr(0, target.find('?'));
  const bool head_only = method == "HEAD";
  if (path != "/metrics") {
    return Response("404 Not Found", kTextType, "metrics are at /metrics\n", !head_only);
  }
  if (method != "GET" && !head_only) {
    return Response("405 Method Not Allowed", kTextType, "GET or HEAD /metrics\n", true,
                    "Allow: GET, HEAD\r\n");
  }
  // The loop thread must not die with whatever the registry throws (std::bad_alloc at least).
  try {
    return Response("200 OK", kExpositionType, render(), !head_only);
  } catch (const std::exception& e) {
    return Response("500 Internal Server Error", kTextType, absl::StrCat(e.what(), "\n"), true);
  }
}

struct Connection {
  enum class State { kReadingHead, kWriting, kLingering };

  int fd = -1;  // -1 once closed
  State state = State::kReadingHead;
  Clock::time_point deadline;  // of the state it is in
  std::string in;              // the request head so far
  std::string out;             // the response
  size_t sent = 0;

  void Close() {
    if (fd >= 0) close(fd);
    fd = -1;
  }

  // Sends what the socket takes now; once all is sent, half-closes and lingers.
  void Flush() {
    while (sent < out.size()) {
      const ssize_t n = send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {
        Close();
        return;
      }
      sent += static_cast<size_t>(n);
    }
    shutdown(fd, SHUT_WR);
    std::string().swap(in);
    std::string().swap(out);
    state = State::kLingering;
    deadline = Clock::now() + kLinger;
  }

  void Respond(std::string response, Clock::duration write_timeout) {
    out = std::move(response);
    sent = 0;
    state = State::kWriting;
    deadline = Clock::now() + write_timeout;
    Flush();
  }

  // Reads what has arrived; answers once the head is complete or too long.
  void ReadHead(const MetricsHttpEndpoint::Options& options,
                const std::function<std::string()>& render) {
    char buffer[4096];
    while (true) {
      const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {  // the client gave up, or the connection broke, before a whole head
        Close();
        return;
      }
      const size_t searched = in.size() >= 2 ? in.size() - 2 : 0;
      in.append(buffer, static_cast<size_t>(n));
      const size_t end = HeadEnd(in, searched);
      const auto write_timeout = absl::ToChronoNanoseconds(options.write_timeout);
      if (end == std::string::npos ? in.size() > options.max_head_bytes
                                   : end > options.max_head_bytes) {
        Respond(
            Response("431 Request Header Fields Too Large", kTextType,
                     absl::StrCat("the request head exceeds ", options.max_head_bytes, " bytes\n"),
                     true),
            write_timeout);
        return;
      }
      if (end != std::string::npos) {
        Respond(Answer(std::string_view(in).substr(0, end), render), write_timeout);
        return;
      }
    }
  }

  // Reads and drops what the client still sends, until it closes.
  void Discard() {
    char buffer[4096];
    while (true) {
      const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {
        Close();
        return;
      }
    }
  }

  void Expire(const MetricsHttpEndpoint::Options& options) {
    if (state == State::kReadingHead) {
      Respond(
          Response("408 Request Timeout", kTextType, "the request head came too slowly\n", true),
          absl::ToChronoNanoseconds(options.write_timeout));
    } else {
      Close();
    }
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpEndpoint>> MetricsHttpEndpoint::Start(
    const std::string& address, std::function<std::string()> render) {
  return Start(address, std::move(render), Options());
}

absl::StatusOr<std::unique_ptr<MetricsHttpEndpoint>> MetricsHttpEndpoint::Start(
    const std::string& address, std::function<std::string()> render, const Options& options) {
  // Timeouts up to an hour keep every deadline, and poll()'s timeout in ms, far from overflow.
  auto in_range = [](absl::Duration d) { return d > absl::ZeroDuration() && d <= absl::Hours(1); };
  if (options.max_connections < 1 || !in_range(options.head_timeout) ||
      !in_range(options.write_timeout) || options.max_head_bytes < 16) {
    return absl::InvalidArgumentError(
        "metrics endpoint: needs max_connections >= 1, timeouts in (0, 1h] and "
        "max_head_bytes >= 16");
  }
  std::string host, port;
  if (!SplitAddress(address, &host, &port)) return Unavailable(address, "expected host:port");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc =
          getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
      rc != 0) {
    return Unavailable(address, gai_strerror(rc));
  }
  int fd = -1;
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, kListenBacklog) != 0) {
      last_error = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return Unavailable(address, last_error);

  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
  const int bound_port = bound.ss_family == AF_INET6
                             ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                             : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    close(fd);
    return Unavailable(address, std::strerror(errno));
  }
  std::unique_ptr<MetricsHttpEndpoint> endpoint(
      new MetricsHttpEndpoint(fd, bound_port, wake[0], wake[1], std::move(render), options));
  if (absl::Status started = endpoint->StartThread(); !started.ok()) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_address=", address, ": ", started.message()));
  }
  return endpoint;
}

MetricsHttpEndpoint::MetricsHttpEndpoint(int listen_fd, int port, int wake_read_fd,
                                         int wake_write_fd, std::function<std::string()> render,
                                         const Options& options)
    : listen_fd_(listen_fd),
      port_(port),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      render_(std::move(render)),
      options_(options) {}

absl::Status MetricsHttpEndpoint::StartThread() {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  int rc = pthread_attr_setstacksize(&attr, kThreadStackBytes);
  if (rc == 0) {
    rc = pthread_create(
        &thread_, &attr,
        [](void* self) -> void* {
          static_cast<MetricsHttpEndpoint*>(self)->Serve();
          return nullptr;
        },
        this);
  }
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot start the endpoint's thread (", std::strerror(rc), ")"));
  }
  thread_started_ = true;
  pthread_setname_np(thread_, "attn-metrics");
  return absl::OkStatus();
}

MetricsHttpEndpoint::~MetricsHttpEndpoint() {
  if (thread_started_) {
    const char stop = 1;
    while (write(wake_write_fd_, &stop, 1) < 0 && errno == EINTR) {
    }
    pthread_join(thread_, nullptr);
  }
  close(listen_fd_);
  close(wake_read_fd_);
  close(wake_write_fd_);
}

void MetricsHttpEndpoint::Serve() {
  const Clock::duration head_timeout = absl::ToChronoNanoseconds(options_.head_timeout);
  std::vector<Connection> connections;  // in accept order, so the oldest is first
  std::vector<pollfd> fds;
  Clock::time_point accept_resumes;
  while (true) {
    Clock::time_point now = Clock::now();
    for (Connection& c : connections) {
      if (now >= c.deadline) c.Expire(options_);
    }
    std::erase_if(connections, [](const Connection& c) { return c.fd < 0; });

    const bool accepting = now >= accept_resumes;
    fds.assign(
        {{wake_read_fd_, POLLIN, 0}, {listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0}});
    Clock::time_point wake_at = accepting ? Clock::time_point::max() : accept_resumes;
    for (const Connection& c : connections) {
      const bool writing = c.state == Connection::State::kWriting;
      fds.push_back({c.fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0});
      wake_at = std::min(wake_at, c.deadline);
    }
    int timeout_ms = -1;
    if (wake_at != Clock::time_point::max()) {
      timeout_ms = static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(
                                        std::max(wake_at - now, Clock::duration::zero()))
                                        .count());
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents != 0) break;

    for (size_t i = 0; i < connections.size(); ++i) {
      if (fds[i + 2].revents == 0) continue;
      Connection& c = connections[i];
      switch (c.state) {
        case Connection::State::kReadingHead:
          c.ReadHead(options_, render_);
          break;
        case Connection::State::kWriting:
          c.Flush();
          break;
        case Connection::State::kLingering:
          c.Discard();
          break;
      }
    }
    std::erase_if(connections, [](const Connection& c) { return c.fd < 0; });

    if ((fds[1].revents & POLLIN) == 0) continue;
    now = Clock::now();
    for (int i = 0; i < kAcceptsPerWake; ++i) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) accept_resumes = now + kAcceptBackoff;
        break;
      }
      if (connections.size() >= static_cast<size_t>(options_.max_connections)) {
        connections.front().Close();
        connections.erase(connections.begin());
      }
      Connection& c = connections.emplace_back();
      c.fd = fd;
      c.deadline = now + head_timeout;
    }
  }
  for (Connection& c : connections) c.Close();
}

}  // namespace attnserve
