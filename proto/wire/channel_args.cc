#include "proto/wire/channel_args.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace attnserve {

absl::StatusOr<std::vector<ChannelArg>> ParseChannelArgs(const std::vector<std::string>& specs,
                                                         const std::string& flag) {
  std::vector<ChannelArg> args;
  for (const std::string& spec : specs) {
    const size_t eq = spec.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", flag, ": '", spec, "' is not name=value (e.g. grpc.http2.max_frame_size=1048576)"));
    }
    ChannelArg arg;
    arg.name = spec.substr(0, eq);
    const std::string value = spec.substr(eq + 1);
    int number = 0;
    if (absl::SimpleAtoi(value, &number)) {
      arg.value = number;
    } else {
      arg.value = value;
    }
    args.push_back(std::move(arg));
  }
  return args;
}

}  // namespace attnserve
