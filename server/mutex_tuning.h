// Abseil Mutex settings for the server and its client.
//
// Debian builds Abseil without NDEBUG, which turns on the Mutex deadlock detector: every
// acquisition records lock order in one process-wide graph under a global spin lock. gRPC takes
// Mutexes on every message, so the detector serialises all of a process's gRPC threads: on the
// H200 machine it was ~20% of the load generator's CPU (GraphCycles, SpinLock::SpinLoop), and
// two client processes served 1.5x the requests of one with the same streams in flight.
// Optimised builds switch it off; debug and sanitizer builds (and the tests) keep it.
#pragma once

#include "absl/synchronization/mutex.h"

namespace attnserve {

inline void SkipMutexDeadlockDetectionInOptimizedBuilds() {
#if defined(NDEBUG)
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

}  // namespace attnserve
