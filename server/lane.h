// A lane: one thread with its own engines (engines are not thread-safe), its own DevicePool and
// stream, copy helpers and completion threads. It takes batches from the Batcher and runs each
// as ONE engine call: each request's Q, K and V into its rows of the packed tensors (the staging
// layout below), the engine, each O back to where its request wants it. With several lanes per
// GPU, one lane's copies overlap another's kernel.
//
// A batch's host copies are split over `copy_threads` threads, the lane's own included, once
// they pass 1 MiB: one 4096-token request stages 96 MiB, which a single thread copies in ~18 ms.
//
// Finishing a batch's requests costs ~6-30 us of CPU per request on the calling thread. When
// other work is already queued, the lane hands that to its two completion threads (a large
// batch split between them) and starts the next batch at once; when nothing waits, it finishes
// the requests itself, which saves a thread wake-up on the latency of a lone request.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attn/engine.h"
#include "cpu/thread_pool.h"
#include "server/batcher.h"
#include "server/completions.h"
#include "server/device_pool.h"
#include "server/kv_page_pool.h"
#include "server/metrics.h"
#include "server/staging.h"
#include "server/work.h"

namespace attnserve {

class Lane {
 public:
  struct Parts {
    std::vector<std::unique_ptr<attn::Engine>> engines;  // in the service's engine order
    std::unique_ptr<DevicePool> host_pool;               // staging for host engines
    std::unique_ptr<DevicePool> device_pool;             // null when the lane has no device engine
    int device_slot = 0;                                 // which lanes' work it takes
    KvPagePool* kv_pool = nullptr;                       // its device's session pages, or null
  };

  // Starts the lane's thread, which runs what `batcher` hands out until it returns an empty
  // batch. `copy_threads` >= 1 counts the lane's own thread.
  Lane(int index, Parts parts, int copy_threads, Batcher* batcher, Metrics* metrics);
  ~Lane();  // joins (after Batcher::Stop), then the completion threads finish what is posted
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

 private:
  // What a forward batch's engine call left in the pool for the copies out.
  struct Launched {
    attn::AttentionProblem problem;  // the packed problem
    int64_t q_row = 0;               // bytes of one query token's O row
    const std::byte* o = nullptr;    // the batch's O rows in the staging region, or null
    const float* lse = nullptr;      // [heads, total_q], or null
    std::vector<bool> o_direct;      // per request: O already in its shared-memory range
  };
  struct CopyTask {
    std::byte* dst;
    const std::byte* src;
    int64_t bytes;
  };
  // One request's outputs: its query rows and where they go.
  struct OutputPlan {
    int64_t rows = 0;
    const OutputSink* o = nullptr;
    const OutputSink* lse = nullptr;
    bool o_direct = false;  // already in its shared-memory range
  };

  void Loop();
  void Run(Batch batch);
  absl::Status RunForward(const std::vector<ForwardWork*>& batch, ExecutionReport* report,
                          Launched* launched);
  absl::Status RunBackward(BackwardWork& work, ExecutionReport* report);
  // Session steps: appended rows into their pages, then one paged engine call.
  absl::Status RunSessionSteps(const std::vector<SessionStepWork*>& batch, ExecutionReport* report);
  // One AppendKV chunk into the pages of its open append.
  absl::Status RunAppend(AppendWork& work, ExecutionReport* report);
  // Each request's O rows and LSE into its sinks, from the staging region.
  void CopyOutputs(const Launched& launched, const std::vector<OutputPlan>& plans);
  void Finish(Batch batch, const absl::Status& status, absl::Time started);
  // The copies, on the lane thread alone when small, else in chunks over the copy threads.
  void RunCopies(const std::vector<CopyTask>& copies);
  DevicePool* PoolFor(const attn::Engine& engine);
  void SampleDeviceMemory(DevicePool& pool, const std::string& label, absl::Time now);

  const int index_;
  Parts parts_;
  Batcher* const batcher_;
  Metrics* const metrics_;
  attn::cpu::ThreadPool copy_threads_;
  Completions completions_;
  absl::Time next_memory_sample_;  // when the device memory gauges are due
  static std::atomic<uint64_t> next_batch_id_;
  std::thread thread_;
};

}  // namespace attnserve
