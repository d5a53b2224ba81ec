// The unix socket where same-host clients hand the server descriptors of memory objects they
// opened themselves (the shared-memory protocol in proto/attnserve/v1/attention.proto,
// RegisterSharedMemoryRequest). Passing the descriptor, not a name, means the server maps only
// what the client could open with its own rights; requiring a memfd sealed against shrinking
// means a registered range can never vanish under a running copy (which would fault the whole
// server with SIGBUS).
//
// One thread polls the listening socket and the connections that have not yet sent their
// message; each connection gets one message, one answer ("ok <token>" or "error <reason>") and is
// closed, or is closed at its deadline. A token is claimed once, by RegisterSharedMemory, within
// its lifetime; unclaimed descriptors are closed when they expire.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

// An owned file descriptor, closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = other.Release();
    }
    return *this;
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void Reset();

 private:
  int fd_ = -1;
};

class DescriptorSocket {
 public:
  struct Options {
    // A filesystem path, or "@name" for the abstract namespace; empty: an abstract name made
    // from the process id.
    std::string address;
    absl::Duration token_lifetime = absl::Seconds(60);
    absl::Duration connection_deadline = absl::Seconds(2);  // to send the one message
    int max_connections = 64;                               // waiting for their message
    int max_pending_per_uid = 64;                           // unclaimed descriptors
    int max_pending = 1024;
  };

  // Binds and starts serving. UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<DescriptorSocket>> Start(const Options& options);
  ~DescriptorSocket();  // stops the thread; closes every unclaimed descriptor
  DescriptorSocket(const DescriptorSocket&) = delete;
  DescriptorSocket& operator=(const DescriptorSocket&) = delete;

  // As clients should write it: a path, or "@name".
  const std::string& address() const { return address_; }

  // The descriptor a token stands for; NOT_FOUND for an unknown, used or expired token.
  absl::StatusOr<UniqueFd> Claim(const std::string& token);
  int pending() const;

  // Checks that `fd` is what a region may be made of: a regular file opened read-write,
  // sealed against shrinking and not against writes. INVALID_ARGUMENT saying what is missing.
  static absl::Status CheckDescriptor(int fd);

 private:
  struct Pending {
    UniqueFd fd;
    uid_t uid = 0;
    absl::Time expires;
  };
  DescriptorSocket(const Options& options, UniqueFd listen_fd, std::string address,
                   std::string bound_path, UniqueFd wake_read, UniqueFd wake_write);
  void Serve();
  // Reads one connection's message and answers it.
  void Answer(int connection_fd);
  absl::StatusOr<std::string> Accept(int connection_fd);
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const UniqueFd listen_fd_;
  const std::string address_;
  const std::string bound_path_;  // a filesystem socket to unlink at the end, or empty
  const UniqueFd wake_read_, wake_write_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
