// SIGTERM / SIGINT (stop) and SIGHUP (re-read the token file) without async-signal-unsafe
// handlers: the signals are blocked in every thread (Block must run before any thread starts)
// and one thread waits for them.
#pragma once

namespace attnserve {

class TerminationSignal {
 public:
  // Blocks SIGTERM, SIGINT and SIGHUP in the calling thread and the threads it creates later.
  static void Block();
  // Waits for one of them and returns its number.
  static int Wait();
};

}  // namespace attnserve
