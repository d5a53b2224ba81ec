// What both CPU engines share: host memory, every valid problem, and a pool of worker threads.
#pragma once

#include <string_view>

#include "attn/engine.h"
#include "cpu/thread_pool.h"

namespace attn::cpu {

class HostEngine : public Engine {
 public:
  MemorySpace memory_space() const final { return MemorySpace::kHost; }
  Support SupportsForward(const AttentionProblem& p) const final { return ValidProblemSupport(p); }
  Support SupportsBackward(const AttentionProblem& p) const final { return ValidProblemSupport(p); }
  Support SupportsPagedForward(const AttentionProblem& p) const final {
    return ValidProblemSupport(p);
  }
  // Gathers each sequence's keys and values out of their pages, then runs Forward: what an
  // engine without a paged pass of its own (the float64 reference) does.
  absl::Status ForwardPaged(const AttentionProblem& p, const PagedForwardArgs& a) override;

 protected:
  // `pool_name` names the worker threads (see ThreadPool).
  HostEngine(const EngineOptions& options, std::string_view pool_name)
      : pool_(options.num_threads, pool_name) {}

  ThreadPool& pool() { return pool_; }

 private:
  ThreadPool pool_;
};

}  // namespace attn::cpu
