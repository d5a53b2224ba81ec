#include "cpu/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <string>

namespace attn::cpu {

ThreadPool::ThreadPool(int num_threads, std::string_view name) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  num_threads = std::max(num_threads, 1);
  threads_.reserve(num_threads - 1);
  for (int w = 1; w < num_threads; ++w) {
    threads_.emplace_back([this, w] { WorkerLoop(w); });
    const std::string thread_name = (std::string(name) + "-" + std::to_string(w)).substr(0, 15);
    pthread_setname_np(threads_.back().native_handle(), thread_name.c_str());
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::RunItems(Job& job, int worker) {
  for (;;) {
    const int64_t item = job.next.fetch_add(1, std::memory_order_relaxed);
    if (item >= job.num_items) return;
    job.fn(worker, item);
  }
}

void ThreadPool::WorkerLoop(int worker) {
  // What the wake-up condition reads: the pool and the last generation this worker ran.
  struct Waiter {
    ThreadPool* pool;
    uint64_t seen;
  };
  Waiter waiter{this, 0};
  const auto has_work = +[](Waiter* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return w->pool->stop_ || w->pool->generation_ != w->seen;
  };
  for (;;) {
    Job* job = nullptr;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(has_work, &waiter));
      if (stop_) return;
      waiter.seen = generation_;
      job = job_;
    }
    RunItems(*job, worker);
    absl::MutexLock lock(&mu_);
    --pending_;
  }
}

void ThreadPool::ParallelFor(int64_t num_items, absl::FunctionRef<void(int, int64_t)> fn) {
  if (num_items <= 0) return;
  Job job{fn, num_items};
  if (threads_.empty() || num_items == 1) {
    RunItems(job, 0);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    job_ = &job;
    pending_ = static_cast<int>(threads_.size());
    ++generation_;
  }
  RunItems(job, 0);
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](ThreadPool* p) ABSL_NO_THREAD_SAFETY_ANALYSIS { return p->pending_ == 0; }, this));
  job_ = nullptr;
}

}  // namespace attn::cpu
