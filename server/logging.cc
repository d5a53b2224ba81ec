#include "server/logging.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnserve {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

const char* LevelTag(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "D";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kWarning:
      return "W";
    case LogLevel::kError:
      return "E";
  }
  return "?";
}

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(std::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warning") return LogLevel::kWarning;
  if (name == "error") return LogLevel::kError;
  return absl::InvalidArgumentError(absl::StrCat("log_level: unknown '", std::string(name),
                                                 "' (expected debug, info, warning, error)"));
}

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

LogLine::~LogLine() {
  const std::string line =
      absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), " ",
                   LevelTag(level_), " ", out_.str(), "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace attnserve
