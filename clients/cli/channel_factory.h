// Connects to an attnserve server: plaintext or TLS, with the large message limits tensors need,
// and stamps the bearer token on each call.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attnserve::client {

struct ChannelOptions {
  std::string target = "127.0.0.1:50051";
  std::string tls_ca_file;      // set: TLS, trusting this CA (PEM)
  std::string tls_server_name;  // overrides the name checked against the certificate
  std::string auth_token;       // set: "authorization: Bearer <token>" on every call
  int64_t max_message_bytes = int64_t{256} << 20;
  std::vector<std::string> grpc_args;  // extra channel arguments, "name=value"
};

class ChannelFactory {
 public:
  explicit ChannelFactory(ChannelOptions options) : options_(std::move(options)) {}

  absl::StatusOr<std::shared_ptr<grpc::Channel>> Connect() const;
  // Adds the token and, when `timeout` is finite, the deadline.
  void Prepare(grpc::ClientContext* context,
               absl::Duration timeout = absl::InfiniteDuration()) const;

 private:
  ChannelOptions options_;
};

}  // namespace attnserve::client
