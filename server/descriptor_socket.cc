#include "server/descriptor_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/wire/descriptor_passing.h"

namespace attnserve {
namespace {

// More descriptors than this in one message are a malformed request; the control buffer still
// has room for them so that every one received is closed.
constexpr int kMaxDescriptorsPerMessage = 8;

absl::Status ErrnoUnavailable(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

absl::StatusOr<std::string> RandomToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

void Reply(int connection_fd, const std::string& text) {
  // The client waits for exactly one message; if it went away there is nobody to tell.
  (void)send(connection_fd, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

}  // namespace

void UniqueFd::Reset() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

absl::Status DescriptorSocket::CheckDescriptor(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor: fstat failed: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        "descriptor: not a memory object; pass a memfd (memfd_create with MFD_ALLOW_SEALING)");
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_ACCMODE) != O_RDWR) {
    return absl::InvalidArgumentError(
        "descriptor: must be open for reading and writing (the server writes O into it)");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::InvalidArgumentError(
        "descriptor: cannot be sealed; pass a memfd created with MFD_ALLOW_SEALING");
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(
        "descriptor: not sealed against shrinking; seal it first with "
        "fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) (a region that shrinks would fault the server)");
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return absl::InvalidArgumentError(
        "descriptor: sealed against writes; the server writes O into the region");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DescriptorSocket>> DescriptorSocket::Start(const Options& options) {
  std::string address = options.address;
  if (address.empty()) {
    absl::StatusOr<std::string> suffix = RandomToken();
    if (!suffix.ok()) return suffix.status();
    address = absl::StrCat("@attnserve.", getpid(), ".", suffix->substr(0, 8));
  }
  sockaddr_un sa;
  socklen_t length = 0;
  if (absl::Status s = wire::MakeUnixAddress(address, &sa, &length); !s.ok()) return s;
  UniqueFd listen_fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listen_fd.valid()) return ErrnoUnavailable("--shared_memory_socket: socket");
  std::string bound_path;
  if (!absl::StartsWith(address, "@")) {
    // A socket left by an earlier run is replaced; any other file is not ours to remove.
    struct stat st {};
    if (lstat(address.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(address.c_str());
    bound_path = address;
  }
  if (bind(listen_fd.get(), reinterpret_cast<const sockaddr*>(&sa), length) != 0) {
    return ErrnoUnavailable(absl::StrCat("--shared_memory_socket: cannot bind '", address, "'"));
  }
  // Anyone on the host may hand over a descriptor: it only ever grants what the sender holds,
  // and the token it gets back is useless without the identity that registers it.
  if (!bound_path.empty()) chmod(bound_path.c_str(), 0666);
  if (listen(listen_fd.get(), 64) != 0) {
    return ErrnoUnavailable(
        absl::StrCat("--shared_memory_socket: cannot listen on '", address, "'"));
  }
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) return ErrnoUnavailable("pipe2");
  std::unique_ptr<DescriptorSocket> socket(
      new DescriptorSocket(options, std::move(listen_fd), address, bound_path,
                           UniqueFd(pipe_fds[0]), UniqueFd(pipe_fds[1])));
  socket->thread_ = std::thread([s = socket.get()] { s->Serve(); });
  return socket;
}

DescriptorSocket::DescriptorSocket(const Options& options, UniqueFd listen_fd, std::string address,
                                   std::string bound_path, UniqueFd wake_read, UniqueFd wake_write)
    : options_(options),
      listen_fd_(std::move(listen_fd)),
      address_(std::move(address)),
      bound_path_(std::move(bound_path)),
      wake_read_(std::move(wake_read)),
      wake_write_(std::move(wake_write)) {}

DescriptorSocket::~DescriptorSocket() {
  const char byte = 0;
  (void)write(wake_write_.get(), &byte, 1);
  if (thread_.joinable()) thread_.join();
  if (!bound_path_.empty()) unlink(bound_path_.c_str());
}

void DescriptorSocket::Serve() {
  struct Connection {
    UniqueFd fd;
    absl::Time deadline;
  };
  std::vector<Connection> connections;
  while (true) {
    std::vector<pollfd> fds = {{wake_read_.get(), POLLIN, 0}, {listen_fd_.get(), POLLIN, 0}};
    absl::Time next_deadline = absl::InfiniteFuture();
    for (const Connection& c : connections) {
      fds.push_back({c.fd.get(), POLLIN, 0});
      next_deadline = std::min(next_deadline, c.deadline);
    }
    int timeout_ms = -1;
    if (next_deadline != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(
          std::max<int64_t>(0, absl::ToInt64Milliseconds(next_deadline - absl::Now()) + 1));
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) return;
    if (fds[0].revents != 0) return;  // the destructor asked us to stop
    const absl::Time now = absl::Now();
    std::vector<Connection> kept;
    for (size_t i = 0; i < connections.size(); ++i) {
      if (fds[i + 2].revents != 0) {
        Answer(connections[i].fd.get());  // then closed as it goes out of scope
      } else if (connections[i].deadline > now) {
        kept.push_back(std::move(connections[i]));
      }
    }
    connections = std::move(kept);
    if (fds[1].revents & POLLIN) {
      while (true) {
        UniqueFd c(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!c.valid()) break;
        if (static_cast<int>(connections.size()) >= options_.max_connections) {
          Reply(c.get(), "error busy: too many connections waiting; retry");
          continue;
        }
        connections.push_back({std::move(c), now + options_.connection_deadline});
      }
    }
  }
}

void DescriptorSocket::Answer(int connection_fd) {
  absl::StatusOr<std::string> token = Accept(connection_fd);
  Reply(connection_fd, token.ok() ? absl::StrCat("ok ", *token)
                                  : absl::StrCat("error ", token.status().message()));
}

absl::StatusOr<std::string> DescriptorSocket::Accept(int connection_fd) {
  char data[64];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxDescriptorsPerMessage)];
  iovec iov{data, sizeof(data)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(connection_fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("recvmsg: ", std::strerror(errno)));
  std::vector<UniqueFd> received;  // every descriptor that arrived is closed unless kept
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      received.emplace_back(fd);
    }
  }
  if (std::string_view(data, static_cast<size_t>(n)) != wire::kDescriptorHello) {
    return absl::InvalidArgumentError(absl::StrCat("message: expected '", wire::kDescriptorHello,
                                                   "' with one descriptor attached"));
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0 || received.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("message: expected exactly one descriptor (SCM_RIGHTS), got ", received.size(),
                     (msg.msg_flags & MSG_CTRUNC) != 0 ? " and more" : ""));
  }
  if (absl::Status s = CheckDescriptor(received[0].get()); !s.ok()) return s;
  ucred peer{};
  socklen_t peer_length = sizeof(peer);
  if (getsockopt(connection_fd, SOL_SOCKET, SO_PEERCRED, &peer, &peer_length) != 0) {
    return absl::InternalError(absl::StrCat("SO_PEERCRED: ", std::strerror(errno)));
  }
  absl::StatusOr<std::string> token = RandomToken();
  if (!token.ok()) return token.status();
  absl::MutexLock lock(&mu_);
  ExpireLocked(absl::Now());
  int from_uid = 0;
  for (const auto& [t, p] : pending_) from_uid += p.uid == peer.uid ? 1 : 0;
  if (from_uid >= options_.max_pending_per_uid ||
      static_cast<int>(pending_.size()) >= options_.max_pending) {
    return absl::ResourceExhaustedError(
        absl::StrCat("busy: ", from_uid, " descriptors from uid ", peer.uid,
                     " wait to be registered; register them (RegisterSharedMemory) or let them "
                     "expire"));
  }
  pending_[*token] =
      Pending{std::move(received[0]), peer.uid, absl::Now() + options_.token_lifetime};
  return *token;
}

void DescriptorSocket::ExpireLocked(absl::Time now) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    it = it->second.expires <= now ? pending_.erase(it) : std::next(it);
  }
}

absl::StatusOr<UniqueFd> DescriptorSocket::Claim(const std::string& token) {
  absl::MutexLock lock(&mu_);
  ExpireLocked(absl::Now());
  auto it = pending_.find(token);
  if (it == pending_.end()) {
    return absl::NotFoundError(
        absl::StrCat("fd_token: unknown, already used or expired (a token registers once, within ",
                     absl::FormatDuration(options_.token_lifetime), ")"));
  }
  UniqueFd fd = std::move(it->second.fd);
  pending_.erase(it);
  return fd;
}

int DescriptorSocket::pending() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(pending_.size());
}

}  // namespace attnserve
