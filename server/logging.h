// A tiny leveled logger for the server (Abseil 20220623 has no absl/log): one line per message,
// to stderr, with UTC time and level.
//
//   ATTN_LOG(kInfo) << "listening on " << address;
#pragma once

#include <sstream>
#include <string_view>

#include "absl/status/statusor.h"

namespace attnserve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Accepts debug, info, warning, error.
absl::StatusOr<LogLevel> ParseLogLevel(std::string_view name);
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

// Collects one message and writes it, whole, when destroyed.
class LogLine {
 public:
  explicit LogLine(LogLevel level) : level_(level) {}
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  std::ostream& stream() { return out_; }

 private:
  LogLevel level_;
  std::ostringstream out_;
};

}  // namespace attnserve

#define ATTN_LOG(level)                                         \
  if (!::attnserve::LogEnabled(::attnserve::LogLevel::level)) { \
  } else                                                        \
    ::attnserve::LogLine(::attnserve::LogLevel::level).stream()
