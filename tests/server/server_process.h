// Runs the real attnserve binary on an ephemeral loopback port for the integration tests.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/time/time.h"

namespace attnserve::test_support {

// The program `built` names (a path compiled into the tests), or $`env` when set: a copied
// bundle (the GPU machine) names its own. ATTNSERVE_SERVER_BINARY, ATTNSERVE_CLIENT_BINARY.
std::string BinaryFromEnv(const char* env, const std::string& built);

class ServerProcess {
 public:
  // Starts `binary --listen=127.0.0.1:0 --port_file=... <flags>` and waits for the port;
  // $ATTNSERVE_SERVER_BINARY, when set, names the binary instead.
  // Returns false (and leaves log() with the reason) when it does not come up in time.
  bool Start(const std::string& binary, const std::vector<std::string>& flags,
             absl::Duration timeout = absl::Seconds(20));
  ~ServerProcess();

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  // The directory holding the server's files (its log); removed with this object.
  const std::string& dir() const { return dir_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }

  // Sends `signal` and waits for the exit; returns the exit status, or -1 after `timeout`
  // (the process is then killed).
  int Stop(int signal, absl::Duration timeout = absl::Seconds(30));
  void Signal(int signal);
  // Waits for the exit started by Signal.
  int Wait(absl::Duration timeout);

  // Everything the server wrote to stderr so far.
  std::string log() const;

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  std::string dir_;
};

}  // namespace attnserve::test_support
