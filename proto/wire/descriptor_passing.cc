#include "proto/wire/descriptor_passing.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnserve::wire {

absl::Status MakeUnixAddress(const std::string& address, sockaddr_un* sa, socklen_t* length) {
  std::memset(sa, 0, sizeof(*sa));
  sa->sun_family = AF_UNIX;
  const bool abstract = absl::StartsWith(address, "@");
  const absl::string_view name =
      abstract ? absl::string_view(address).substr(1) : absl::string_view(address);
  const size_t room = sizeof(sa->sun_path) - 1;  // abstract: the leading NUL; path: the trailing
  if (name.empty() || name.size() > room) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory socket '", address, "': must be a path or @name of 1 to ", room, " bytes"));
  }
  std::memcpy(sa->sun_path + (abstract ? 1 : 0), name.data(), name.size());
  *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + (abstract ? 1 : 0) +
                                   name.size() + (abstract ? 0 : 1));
  return absl::OkStatus();
}

absl::StatusOr<std::string> PassDescriptor(const std::string& address, int fd,
                                           absl::Duration timeout) {
  sockaddr_un sa;
  socklen_t length = 0;
  if (absl::Status s = MakeUnixAddress(address, &sa, &length); !s.ok()) return s;
  const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (sock < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{sock};
  if (connect(sock, reinterpret_cast<const sockaddr*>(&sa), length) != 0) {
    return absl::UnavailableError(absl::StrCat("shared-memory socket '", address,
                                               "': cannot connect: ", std::strerror(errno)));
  }
  iovec iov{const_cast<char*>(kDescriptorHello), sizeof(kDescriptorHello) - 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0) {
    return absl::UnavailableError(
        absl::StrCat("shared-memory socket '", address, "': cannot send: ", std::strerror(errno)));
  }
  pollfd p{sock, POLLIN, 0};
  const int ready = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  if (ready <= 0) {
    return absl::UnavailableError(absl::StrCat(
        "shared-memory socket '", address, "': no answer within ", absl::FormatDuration(timeout)));
  }
  char answer[512];
  const ssize_t n = recv(sock, answer, sizeof(answer), 0);
  if (n <= 0) {
    return absl::UnavailableError(
        absl::StrCat("shared-memory socket '", address, "': closed without an answer"));
  }
  const absl::string_view text(answer, static_cast<size_t>(n));
  if (absl::StartsWith(text, "ok ")) return std::string(text.substr(3));
  if (absl::StartsWith(text, "error ")) {
    return absl::FailedPreconditionError(
        absl::StrCat("shared-memory socket: the server refused the descriptor: ", text.substr(6)));
  }
  return absl::InternalError(absl::StrCat("shared-memory socket: unexpected answer '", text, "'"));
}

}  // namespace attnserve::wire
