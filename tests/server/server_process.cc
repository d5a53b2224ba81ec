#include "tests/server/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/time/clock.h"

extern char** environ;

namespace attnserve::test_support {

std::string BinaryFromEnv(const char* env, const std::string& built) {
  const char* from_env = std::getenv(env);
  return from_env != nullptr && *from_env != '\0' ? from_env : built;
}

bool ServerProcess::Start(const std::string& built_binary, const std::vector<std::string>& flags,
                          absl::Duration timeout) {
  const std::string binary = BinaryFromEnv("ATTNSERVE_SERVER_BINARY", built_binary);
  char templ[] = "/tmp/attnserve_test_XXXXXX";
  dir_ = mkdtemp(templ);
  const std::string port_file = dir_ + "/port";
  std::vector<std::string> args = {binary, "--listen=127.0.0.1:0", "--port_file=" + port_file};
  args.insert(args.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const std::string log_path = dir_ + "/stderr.log";
  posix_spawn_file_actions_addopen(&actions, 2, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  const int rc = posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    pid_ = -1;
    return false;
  }
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream in(port_file);
    if (in >> port_ && port_ > 0) return true;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return false;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) Stop(SIGKILL, absl::Seconds(5));
  if (!dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
}

void ServerProcess::Signal(int signal) {
  if (pid_ > 0) kill(pid_, signal);
}

int ServerProcess::Wait(absl::Duration timeout) {
  if (pid_ <= 0) return -1;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
  return -1;
}

int ServerProcess::Stop(int signal, absl::Duration timeout) {
  Signal(signal);
  return Wait(timeout);
}

std::string ServerProcess::log() const {
  std::ifstream in(dir_ + "/stderr.log");
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

}  // namespace attnserve::test_support
