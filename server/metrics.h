// The server's metrics: the hooks the service, the batcher and the lanes call as requests and
// batches move through, kept in a prometheus-cpp registry that an optional HTTP exporter serves
// at /metrics, plus the few counters GetServerInfo reports. Names, labels and PromQL examples
// are in docs/metrics.md; keep the two in step.
//
// Every hook is thread-safe and cheap (atomics, and a label lookup under prometheus-cpp's own
// family mutex); none blocks on I/O.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attn/engine.h"
#include "attn/problem.h"
#include "attnserve/v1/attention.pb.h"
#include "server/metrics_http_endpoint.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace attnserve {

// Device-memory bytes the fused kernel must move for `p`: Q, K, V read once, O written, and the
// float32 LSE written when `lse` (the kernel's compulsory traffic; K/V tiles re-read by several
// query tiles mostly hit L2 and are not counted).
int64_t FusedIoBytes(const attn::AttentionProblem& p, bool lse);
// The same plus what the naive path adds: S (float32) written by Q K^T and read by the softmax,
// P (storage dtype, over S) written by the softmax and read by P V, over the full
// seqlen_q x seqlen_k rectangle of every (sequence, head), as cuBLAS computes it:
//   FusedIoBytes + num_heads * sum_b(seqlen_q(b) * seqlen_k(b)) * (2 * 4 + 2 * sizeof(dtype)).
int64_t NaiveIoBytes(const attn::AttentionProblem& p, bool lse);

class Metrics {
 public:
  enum class Method : uint8_t { kAttend, kAttendStream, kAttendBackward, kAppendKV };
  // Why a request ran on the path it ran on (the `reason` label).
  enum class PathReason : uint8_t {
    kRequested,           // the request named the path
    kAuto,                // AUTO took its first choice
    kNoGpu,               // AUTO on a server without a GPU engine
    kUnsupportedDtype,    // AUTO fell past a GPU engine that does not take the dtype
    kUnsupportedHeadDim,  // ... the head_dim
    kUnaligned,           // ... the tensors' alignment
    kUnsupported,         // ... for another reason
  };
  enum class Memory : uint8_t { kDevice, kHost };

  // Maps the reason an engine refused a problem (attn::Support) to the bounded reason set.
  static PathReason FallbackReason(attn::Refusal refusal);

  // One engine call over a packed batch, after it completed.
  struct Launch {
    attn::EngineKind engine = attn::EngineKind::kCpuTiled;
    int requests = 0;
    int64_t query_tokens = 0;
    int64_t key_tokens = 0;
    double flops = 0;
    int64_t fused_io_bytes = 0;
    int64_t naive_io_bytes = 0;
    absl::Duration compute;  // CUDA events for device engines, the host clock otherwise
  };

  Metrics();
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves the registry at http://`address`/metrics ("host:port"; port 0 picks a free one).
  // UNAVAILABLE when it cannot listen there. At most once.
  absl::Status StartExporter(const std::string& address);
  // The exporter's bound port; 0 when it is not running.
  int exporter_port() const { return exporter_port_; }

  void SetBuildInfo(std::string_view version, bool cuda);

  // A request passed validation and was queued.
  void OnAccepted();
  // A request was turned away before queueing (queue full, draining, invalid, unauthenticated).
  void OnRejected(Method method, const absl::Status& why);
  // The batcher queue gained one request / lost `n` to a batch (called under its lock).
  void OnQueued();
  void OnDequeued(int n);
  // A batch of `requests` reached a lane (GetServerInfo's batch statistics).
  void OnBatch(int requests);
  // `requests` requests are about to run on `engine`, chosen for `reason`.
  void OnPath(attn::EngineKind engine, PathReason reason, int requests = 1);
  void OnLaunch(const Launch& launch);
  // A queued request finished (ok or not).
  void OnFinished(Method method, const absl::Status& status, absl::Duration queue,
                  absl::Duration total);

  // Pool accounting, summed over the lanes that share `device` ("cuda:N" or "cpu").
  void OnPoolReserved(std::string_view device, Memory memory, int64_t delta_bytes);
  void OnPoolInUse(std::string_view device, Memory memory, int64_t delta_bytes);
  // cudaMemGetInfo's view of a GPU.
  void OnDeviceMemory(std::string_view device, int64_t used_bytes, int64_t total_bytes);
  // The registered shared-memory regions, after a change.
  void OnSharedMemory(int regions, uint64_t mapped_bytes);

  // KV sessions: one was created, deleted or expired; `open` are left.
  enum class SessionEvent : uint8_t { kCreated, kDeleted, kExpired };
  void OnSession(SessionEvent event, int open);
  // A device's page pool, after a change.
  void OnKvPool(std::string_view device, int64_t total_bytes, int64_t free_bytes,
                int64_t free_pages);
  // An AppendKV chunk moved `bytes` of K and V into the pool.
  void OnSessionAppend(std::string_view device, int64_t bytes);
  // One launch of `steps` session steps read `kv_bytes` of cached K/V and appended
  // `append_bytes`.
  void OnSessionSteps(std::string_view device, int steps, int64_t kv_bytes, int64_t append_bytes);

  v1::Stats Snapshot() const;
  // The registry in Prometheus text format, as /metrics serves it.
  std::string Scrape() const;
  // The registry itself, for the families other parts of the server keep (training jobs:
  // server/training/training_metrics.h).
  prometheus::Registry& registry() { return *registry_; }

 private:
  void CountRequest(Method method, const absl::Status& status);

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpEndpoint> endpoint_;
  int exporter_port_ = 0;

  prometheus::Family<prometheus::Gauge>* build_info_;
  prometheus::Family<prometheus::Counter>* requests_;
  // requests_'s child per (method, status code), looked up once: Family::Add hashes the labels
  // under the family's lock, and every request ends with this count.
  static constexpr int kMethods = static_cast<int>(Method::kAppendKV) + 1, kCodes = 17;
  std::array<std::atomic<prometheus::Counter*>, kMethods * kCodes> request_counters_{};
  // Every per-launch series of one path, looked up once per engine kind (OnLaunch runs per batch).
  struct LaunchSeries {
    prometheus::Histogram* compute;
    prometheus::Histogram* batch_requests;
    prometheus::Histogram* batch_tokens;
    prometheus::Counter* query_tokens;
    prometheus::Counter* key_tokens;
    prometheus::Counter* flops;
    prometheus::Counter* fused_io;
    prometheus::Counter* naive_io;
  };
  static constexpr int kEngineKinds = static_cast<int>(attn::EngineKind::kCudaNaive) + 1;
  const LaunchSeries& LaunchSeriesOf(attn::EngineKind engine);
  absl::Mutex launch_series_mu_;
  std::array<std::atomic<const LaunchSeries*>, kEngineKinds> launch_series_{};
  std::array<std::unique_ptr<LaunchSeries>, kEngineKinds> launch_series_storage_
      ABSL_GUARDED_BY(launch_series_mu_);
  prometheus::Gauge* in_flight_;
  prometheus::Gauge* queued_;
  prometheus::Gauge* shared_memory_regions_;
  prometheus::Gauge* shared_memory_bytes_;
  prometheus::Gauge* sessions_open_;
  std::array<prometheus::Counter*, 3> session_events_{};  // by SessionEvent
  prometheus::Family<prometheus::Gauge>* kv_pool_bytes_;
  prometheus::Family<prometheus::Gauge>* kv_pool_free_pages_;
  prometheus::Family<prometheus::Counter>* kv_append_bytes_;
  prometheus::Family<prometheus::Counter>* kv_read_bytes_;
  prometheus::Family<prometheus::Counter>* session_steps_;
  prometheus::Histogram* session_batch_steps_;
  std::array<prometheus::Histogram*, kMethods> request_durations_{};  // by Method
  prometheus::Histogram* queue_wait_;
  prometheus::Family<prometheus::Histogram>* compute_;
  prometheus::Family<prometheus::Histogram>* batch_requests_;
  prometheus::Family<prometheus::Histogram>* batch_tokens_;
  prometheus::Family<prometheus::Counter>* tokens_;
  prometheus::Family<prometheus::Counter>* flops_;
  prometheus::Family<prometheus::Counter>* path_;
  prometheus::Family<prometheus::Counter>* fused_io_;
  prometheus::Family<prometheus::Counter>* naive_io_;
  prometheus::Family<prometheus::Gauge>* pool_reserved_;
  prometheus::Family<prometheus::Gauge>* pool_in_use_;
  prometheus::Family<prometheus::Gauge>* pool_peak_;
  prometheus::Family<prometheus::Gauge>* device_total_;
  prometheus::Family<prometheus::Gauge>* device_used_;
  prometheus::Family<prometheus::Gauge>* device_peak_;

  // In-use bytes and their peak per (device, memory), and device used-memory peaks.
  absl::Mutex memory_mu_;
  struct PoolBytes {
    int64_t in_use = 0;
    int64_t peak = 0;
    prometheus::Gauge* in_use_gauge = nullptr;  // looked up once: every batch moves these
    prometheus::Gauge* peak_gauge = nullptr;
  };
  std::map<std::pair<std::string, Memory>, PoolBytes> pool_in_use_bytes_
      ABSL_GUARDED_BY(memory_mu_);
  std::map<std::string, int64_t> device_used_peak_ ABSL_GUARDED_BY(memory_mu_);

  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> completed_{0};
  std::atomic<uint64_t> failed_{0};
  std::atomic<uint64_t> batches_{0};
  std::atomic<uint64_t> batched_requests_{0};
  std::atomic<int> max_batch_requests_{0};
};

}  // namespace attnserve
