// The one place where absl::Status becomes grpc::Status (and back, for clients).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace attnserve {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace attnserve
