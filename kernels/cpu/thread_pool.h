// A small fixed-size thread pool for the CPU engines: one blocking ParallelFor over a range of
// work items, handed out dynamically so items of uneven cost balance across threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace attn::cpu {

class ThreadPool {
 public:
  // num_threads counts the calling thread; 0 means std::thread::hardware_concurrency().
  // Helper threads are named `name`-1, `name`-2, ... (cut to Linux's 15 characters) so that
  // profilers and /proc tell the pools apart.
  explicit ThreadPool(int num_threads, std::string_view name = "attn-pool");
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads that run items, the caller included; worker indices are [0, num_workers()).
  int num_workers() const { return static_cast<int>(threads_.size()) + 1; }

  // Calls fn(worker, item) once for every item in [0, num_items) and returns when all are done.
  // A worker index is never used by two threads at once, so it can index per-thread scratch.
  // Not reentrant: one ParallelFor at a time per pool.
  void ParallelFor(int64_t num_items, absl::FunctionRef<void(int, int64_t)> fn);

 private:
  struct Job {
    absl::FunctionRef<void(int, int64_t)> fn;
    int64_t num_items;
    std::atomic<int64_t> next{0};
  };

  void WorkerLoop(int worker);
  static void RunItems(Job& job, int worker);

  absl::Mutex mu_;
  Job* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;  // helper threads still inside the current job
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace attn::cpu
