#include "server/completions.h"

#include <pthread.h>

#include <utility>

namespace attnserve {

Completions::Completions(const std::string& name, int threads) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { Loop(); });
    pthread_setname_np(threads_.back().native_handle(), name.substr(0, 15).c_str());
  }
}

Completions::~Completions() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void Completions::Post(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  work_.push_back(std::move(work));
}

void Completions::Loop() {
  while (true) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Completions* c)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) { return c->stopping_ || !c->work_.empty(); },
          this));
      if (work_.empty()) return;  // stopping, and everything posted has run
      work = std::move(work_.front());
      work_.pop_front();
    }
    work();
  }
}

}  // namespace attnserve
