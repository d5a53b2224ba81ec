// SIGTERM / SIGINT handling without async-signal-unsafe handlers: the signals are blocked in
// every thread (Block must run before any thread starts) and one thread waits for them.
#pragma once

namespace attnserve {

class TerminationSignal {
 public:
  // Blocks SIGTERM and SIGINT in the calling thread and the threads it creates later.
  static void Block();
  // Waits for SIGTERM or SIGINT and returns its number.
  static int Wait();
};

}  // namespace attnserve
