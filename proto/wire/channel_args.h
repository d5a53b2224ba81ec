// gRPC channel arguments given on the command line as "name=value" (server and client flags
// --grpc_arg), for tuning the transport without a rebuild: flow-control windows, read chunk
// sizes, frame sizes, keepalive and ping policy. A value that parses as an integer is passed as
// an integer argument, anything else as a string.
#pragma once

#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"

namespace attnserve {

struct ChannelArg {
  std::string name;
  std::variant<int, std::string> value;
};

// INVALID_ARGUMENT naming `flag` and the spec when one has no '=' or an empty name.
absl::StatusOr<std::vector<ChannelArg>> ParseChannelArgs(const std::vector<std::string>& specs,
                                                         const std::string& flag);

}  // namespace attnserve
