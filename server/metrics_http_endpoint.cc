#include "server/metrics_http_endpoint.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

constexpr size_t kMaxRequestBytes = 8192;

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

void SetTimeout(int fd, int option, int seconds) {
  timeval tv{};
  tv.tv_sec = seconds;
  setsockopt(fd, SOL_SOCKET, option, &tv, sizeof(tv));
}

bool SendAll(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t sent = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    data.remove_prefix(static_cast<size_t>(sent));
  }
  return true;
}

std::string Response(std::string_view status, std::string_view content_type, std::string_view body,
                     bool with_body) {
  return absl::StrCat("HTTP/1.1 ", std::string(status),
                      "\r\nContent-Type: ", std::string(content_type),
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n",
                      with_body ? std::string(body) : "");
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpEndpoint>> MetricsHttpEndpoint::Start(
    const std::string& address, std::function<std::string()> render) {
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
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 16) != 0) {
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
  return std::unique_ptr<MetricsHttpEndpoint>(
      new MetricsHttpEndpoint(fd, bound_port, wake[0], wake[1], std::move(render)));
}

MetricsHttpEndpoint::MetricsHttpEndpoint(int listen_fd, int port, int wake_read_fd,
                                         int wake_write_fd, std::function<std::string()> render)
    : listen_fd_(listen_fd),
      port_(port),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      render_(std::move(render)),
      thread_([this] { Serve(); }) {}

MetricsHttpEndpoint::~MetricsHttpEndpoint() {
  const char stop = 1;
  while (write(wake_write_fd_, &stop, 1) < 0 && errno == EINTR) {
  }
  thread_.join();
  close(listen_fd_);
  close(wake_read_fd_);
  close(wake_write_fd_);
}

void MetricsHttpEndpoint::Serve() {
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_fd_, POLLIN, 0}};
  while (true) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int connection = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;
    Answer(connection);
    close(connection);
  }
}

void MetricsHttpEndpoint::Answer(int fd) {
  // A scraper that stalls cannot hold the endpoint for long.
  SetTimeout(fd, SO_RCVTIMEO, 2);
  SetTimeout(fd, SO_SNDTIMEO, 5);
  std::string request;
  char buffer[1024];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    const ssize_t got = recv(fd, buffer, sizeof(buffer), 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    request.append(buffer, static_cast<size_t>(got));
  }
  const std::string_view line = std::string_view(request).substr(0, request.find("\r\n"));
  const size_t method_end = line.find(' ');
  const size_t path_end = line.find(' ', method_end == std::string_view::npos ? 0 : method_end + 1);
  if (method_end == std::string_view::npos || path_end == std::string_view::npos) {
    SendAll(fd, Response("400 Bad Request", "text/plain", "bad request\n", true));
    return;
  }
  const std::string_view method = line.substr(0, method_end);
  std::string_view path = line.substr(method_end + 1, path_end - method_end - 1);
  path = path.substr(0, path.find('?'));
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    SendAll(fd, Response("405 Method Not Allowed", "text/plain", "GET /metrics\n", true));
  } else if (path != "/metrics") {
    SendAll(fd, Response("404 Not Found", "text/plain", "metrics are at /metrics\n", !head));
  } else {
    SendAll(fd, Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", render_(), !head));
  }
}

}  // namespace attnserve
