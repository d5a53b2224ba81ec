// The shared-memory descriptor exchange both sides speak (proto/attnserve/v1/attention.proto,
// RegisterSharedMemoryRequest): a client passes a sealed memfd over a SOCK_SEQPACKET unix
// socket with the message kDescriptorHello, and the server answers "ok <token>" or
// "error <reason>".
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attnserve::wire {

inline constexpr char kDescriptorHello[] = "attnserve-fd/1";

// A socket address for a filesystem path or "@name" (the Linux abstract namespace).
// INVALID_ARGUMENT when it is empty or too long.
absl::Status MakeUnixAddress(const std::string& address, sockaddr_un* sa, socklen_t* length);

// Client side: connects to `address`, passes `fd`, and returns the server's token. The server's
// "error ..." answer comes back as FAILED_PRECONDITION carrying its reason; UNAVAILABLE when the
// socket cannot be reached or does not answer within `timeout`.
absl::StatusOr<std::string> PassDescriptor(const std::string& address, int fd,
                                           absl::Duration timeout = absl::Seconds(10));

}  // namespace attnserve::wire
