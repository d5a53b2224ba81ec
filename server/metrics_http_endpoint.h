// The HTTP side of the Prometheus exporter: GET /metrics answered with the text exposition
// format that a render callback produces (prometheus-cpp's registry and serializer).
//
// Why not prometheus-cpp's Exposer: its civetweb starts worker threads with a fixed ~100 KiB
// stack, and in builds that link cuBLAS (whose static TLS alone is ~100 KiB, carved by glibc
// out of each thread's stack) pthread_create refuses that stack, so the exporter could not
// start in CUDA builds. The one thread here is created with a stack size chosen for that.
//
// That thread serves every connection from one poll() loop over non-blocking sockets, so a
// client that misbehaves costs a connection slot, never the thread: a connection must deliver
// its whole request head within `head_timeout` (one byte a second does not extend it) and take
// its response within `write_timeout`; a head over `max_head_bytes` is answered 431; at
// `max_connections` the oldest connection is closed to make room, since a scrape lasts
// milliseconds and the connection that has lasted longest is the one misbehaving. A pool of
// threads blocked in reads would instead be held by as many slow clients as it has threads.
// Rendering runs on the loop thread: it takes milliseconds and scrapes are seconds apart.
//
// HTTP/1.1 without keep-alive: every response says `Connection: close`. GET and HEAD of
// /metrics (a query string is ignored) are 200, other paths 404, other methods 405, a request
// line that does not parse 400, an HTTP version other than 1.x 505.
#pragma once

#include <pthread.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attnserve {

class MetricsHttpEndpoint {
 public:
  struct Options {
    int max_connections = 64;
    absl::Duration head_timeout = absl::Seconds(5);   // from accept to the head's last byte
    absl::Duration write_timeout = absl::Seconds(5);  // from the head to the response's last
    size_t max_head_bytes = 8192;                     // request line and headers, with CRLFs
  };

  // Listens on `address` ("host:port", "[v6-host]:port" or "port"; port 0 picks a free one)
  // and serves until destroyed. UNAVAILABLE when it cannot listen there, INVALID_ARGUMENT for
  // options out of range. `render` is called on the endpoint's thread, once per GET or HEAD.
  static absl::StatusOr<std::unique_ptr<MetricsHttpEndpoint>> Start(
      const std::string& address, std::function<std::string()> render);
  static absl::StatusOr<std::unique_ptr<MetricsHttpEndpoint>> Start(
      const std::string& address, std::function<std::string()> render, const Options& options);
  // Stops serving, closes every connection (hung ones too) and joins the thread.
  ~MetricsHttpEndpoint();

  MetricsHttpEndpoint(const MetricsHttpEndpoint&) = delete;
  MetricsHttpEndpoint& operator=(const MetricsHttpEndpoint&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpEndpoint(int listen_fd, int port, int wake_read_fd, int wake_write_fd,
                      std::function<std::string()> render, const Options& options);
  absl::Status StartThread();
  void Serve();

  const int listen_fd_;
  const int port_;
  const int wake_read_fd_;  // a byte written to the pipe stops Serve()
  const int wake_write_fd_;
  const std::function<std::string()> render_;
  const Options options_;
  pthread_t thread_{};
  bool thread_started_ = false;
};

}  // namespace attnserve
