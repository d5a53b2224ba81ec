// Dynamic batching: validated requests wait in one bounded queue; lane threads pack compatible
// requests into one variable-length problem, run it as ONE engine call, and split the result
// back per request.
//
// Compatible = same engine, dtype, head counts, head_dim, mask (causal, window) and scale.
// Close policy: a lane that is free takes the compatible requests queued at that moment and
// runs them at once (work-conserving; max_queue_delay = 0, the default). Batches grow with load
// because requests pile up while every lane is busy. A positive max_queue_delay makes a free
// lane hold a batch until its query + key tokens reach max_batch_tokens, it holds
// max_batch_requests requests, or max_queue_delay has passed since its oldest request was
// accepted. A batch never exceeds max_batch_tokens, max_batch_requests or the lane's memory
// limit. Requests whose deadline has passed, or whose client cancelled, are dropped before
// compute.
//
// Each lane owns its engines (engines are not thread-safe) and its DevicePool; with several
// lanes per GPU, one lane's copies overlap another's kernel. A batch's host copies (each
// request's Q/K/V into the staging region, each O out of it) are split over `lane_threads`
// threads, the lane's own included, once they pass 1 MiB: one 4096-token request stages
// 96 MiB, which a single thread copies in ~18 ms.
//
// Finishing a batch's requests (each `done`: the RPC's response written by gRPC) costs ~6-30 us
// of CPU per request on the calling thread. When other work is already queued, the lane hands
// that to its two completion threads (a large batch split between them) and starts the next
// batch at once; when nothing waits, it finishes the requests itself, which saves a thread
// wake-up on the latency of a lone request.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attn/engine.h"
#include "attnserve/v1/attention.pb.h"
#include "cpu/thread_pool.h"
#include "server/device_pool.h"
#include "server/metrics.h"
#include "server/request_decoder.h"

namespace attnserve {

// One accepted request on its way through the batcher.
struct WorkItem {
  DecodedRequest request;                  // aliases bytes the RPC keeps alive until `done` runs
  int engine = 0;                          // index into every lane's engines
  v1::AttendResponse* response = nullptr;  // filled in before done(OK); forward requests
  v1::AttendBackwardResponse* backward_response = nullptr;  // the same, request.backward
  absl::Time accepted;
  absl::Time deadline = absl::InfiniteFuture();
  Metrics::Method method = Metrics::Method::kAttend;             // for the metrics' labels
  Metrics::PathReason path_reason = Metrics::PathReason::kAuto;  // why this engine
  std::shared_ptr<const std::atomic<bool>> cancelled;            // set when the client goes away
  // Runs exactly once, on a lane thread or one of its completion threads, after which the batcher
  // forgets the item.
  std::function<void(const absl::Status&)> done;
};

class Batcher {
 public:
  struct Options {
    int64_t max_batch_tokens = 16384;
    int max_batch_requests = 32;
    absl::Duration max_queue_delay = absl::ZeroDuration();  // 0: never hold a batch
    int queue_capacity = 256;
    int64_t memory_limit_bytes = int64_t{2} << 30;
    int lane_threads = 1;  // per lane, the lane thread included, for large copies
  };

  struct Lane {
    std::vector<std::unique_ptr<attn::Engine>> engines;
    std::unique_ptr<DevicePool> host_pool;    // staging for host engines
    std::unique_ptr<DevicePool> device_pool;  // null when the lane has no device engine
    absl::Time next_memory_sample;            // when the device memory gauges are due
  };

  // Starts one thread per lane.
  Batcher(const Options& options, std::vector<Lane> lanes, Metrics* metrics);
  ~Batcher();
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queues the item. RESOURCE_EXHAUSTED when the queue is full and UNAVAILABLE once stopping;
  // `done` is not called then.
  absl::Status Submit(std::unique_ptr<WorkItem> item);

  // Refuses new work, runs everything already queued, joins the lanes. Idempotent.
  void Stop();

  const Options& options() const { return options_; }

 private:
  using Batch = std::vector<std::unique_ptr<WorkItem>>;
  struct Launched;  // what a batch's engine call left for the responses
  // A lane's completion threads: run posted work, first posted first started, until stopped
  // (after the lane).
  class Completions {
   public:
    Completions(const std::string& name, int threads);
    ~Completions();  // runs what is left, then joins
    void Post(std::function<void()> work);
    int threads() const { return static_cast<int>(threads_.size()); }

   private:
    void Loop();
    absl::Mutex mu_;
    std::deque<std::function<void()>> work_ ABSL_GUARDED_BY(mu_);
    bool stopping_ ABSL_GUARDED_BY(mu_) = false;
    std::vector<std::thread> threads_;
  };
  struct CopyTask {
    std::byte* dst;
    const std::byte* src;
    int64_t bytes;
  };

  void LaneLoop(Lane* lane, attn::cpu::ThreadPool* helpers, Completions* completions);
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool FrontBatchFull() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Batch TakeBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunBatch(Lane& lane, attn::cpu::ThreadPool& helpers, Completions& completions, Batch batch);
  bool HasQueuedWork() const;
  absl::Status Execute(Lane& lane, attn::cpu::ThreadPool& helpers, const Batch& batch,
                       Launched* launched);
  // One AttendBackward request (never packed with others): the forward first when the client
  // sent no O and LSE, then the backward pass; fills the response.
  absl::Status ExecuteBackward(Lane& lane, attn::cpu::ThreadPool& helpers, WorkItem& item,
                               absl::Time started);
  // Fills the request's response; its O rows are left to copy from the staging region as a task
  // unless `o_written` (already copied to its shared-memory range by the device).
  static void FillResponse(const Launched& launched, const WorkItem& item, int64_t q_first,
                           bool o_written, std::vector<CopyTask>* copies);
  // The copies, on the lane thread alone when small, else in chunks over the lane's threads.
  static void RunCopies(attn::cpu::ThreadPool& helpers, const std::vector<CopyTask>& copies);

  const Options options_;
  Metrics* const metrics_;
  std::vector<Lane> lanes_;
  std::vector<std::unique_ptr<attn::cpu::ThreadPool>> helpers_;  // one per lane
  std::vector<std::unique_ptr<Completions>> completions_;        // one per lane
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> next_batch_id_{1};

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<WorkItem>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool joined_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attnserve
