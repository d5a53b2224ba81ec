// The HTTP side of the Prometheus exporter: GET /metrics answered with the text exposition
// format that a render callback produces (prometheus-cpp's registry and serializer).
//
// Why not prometheus-cpp's Exposer: its civetweb starts worker threads with a fixed ~100 KiB
// stack, and in builds that link cuBLAS (whose static TLS alone is ~100 KiB) pthread_create
// refuses that stack, so the exporter could not start in CUDA builds. Scrapes are rare and
// small: one thread answers one connection at a time and closes it after the response.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace attnserve {

class MetricsHttpEndpoint {
 public:
  // Listens on `address` ("host:port", "[v6-host]:port" or "port"; port 0 picks a free one)
  // and serves until destroyed. UNAVAILABLE when it cannot listen there.
  static absl::StatusOr<std::unique_ptr<MetricsHttpEndpoint>> Start(
      const std::string& address, std::function<std::string()> render);
  ~MetricsHttpEndpoint();  // stops serving and joins the thread

  MetricsHttpEndpoint(const MetricsHttpEndpoint&) = delete;
  MetricsHttpEndpoint& operator=(const MetricsHttpEndpoint&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpEndpoint(int listen_fd, int port, int wake_read_fd, int wake_write_fd,
                      std::function<std::string()> render);
  void Serve();
  void Answer(int connection_fd);

  const int listen_fd_;
  const int port_;
  const int wake_read_fd_;  // a byte written to the pipe stops Serve()
  const int wake_write_fd_;
  const std::function<std::string()> render_;
  std::thread thread_;
};

}  // namespace attnserve
