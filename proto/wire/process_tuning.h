// Process settings for the programs that move tensors over gRPC: the server and its client.
//
// KeepFreedMemoryInTheHeap (glibc malloc). Every request allocates and frees the same blocks: a
// few hundred KiB for a small request (gRPC read slices, the message's tensor strings, the
// response), tens of MiB per tensor for a large one. glibc's defaults hand such blocks back to
// the kernel (mmap above 128 KiB, trimming the heap top and the threads' arenas), so the next
// request faults the pages in again and the kernel zeroes them: 35 page faults and ~150 us of
// server CPU per small request on the build machine, and for a 4096-token request (96 MiB in,
// 32 MiB out) ~45 ms of its ~160 ms on the H200 machine (docs/server-performance.md). Freed
// blocks stay in the heap instead, and never go to mmap at all: blocks over 32 MiB (glibc's
// largest mmap threshold) come from the main heap and are reused. Free heap beyond 128 MiB at
// the top is still returned.
//
// SkipMutexDeadlockDetectionInOptimizedBuilds (Abseil). Debian builds Abseil without NDEBUG,
// which turns on the Mutex deadlock detector: every acquisition records lock order in one
// process-wide graph under a global spin lock. gRPC takes Mutexes on every message, so the
// detector serialises all of a process's gRPC threads: on the H200 machine it was ~20% of the
// load generator's CPU (GraphCycles, SpinLock::SpinLoop), and two client processes served 1.5x
// the requests of one with the same streams in flight. Optimised builds switch it off; debug and
// sanitizer builds (and the tests) keep it.
#pragma once

#include <cstdlib>  // defines __GLIBC__ when the C library is glibc

#include "absl/synchronization/mutex.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace attnserve {

inline void KeepFreedMemoryInTheHeap() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
#endif
}

inline void SkipMutexDeadlockDetectionInOptimizedBuilds() {
#if defined(NDEBUG)
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

}  // namespace attnserve
