#include "server/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <exception>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attn/dtype.h"

namespace attnserve {
namespace {

// Latency buckets, 10 us to 50 s in 1-2.5-5 steps: a CPU launch of a few tokens takes tens of
// microseconds, a queue stuck behind a long batch tens of seconds.
const std::vector<double>& LatencyBuckets() {
  static const std::vector<double> buckets = [] {
    std::vector<double> b;
    for (double decade = 1e-5; decade < 100; decade *= 10) {
      for (double step : {1.0, 2.5, 5.0}) b.push_back(decade * step);
    }
    return b;
  }();
  return buckets;
}

// Requests per launch: powers of two up to beyond --max_batch_requests' default of 32.
const std::vector<double>& RequestBuckets() {
  static const std::vector<double> buckets = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  return buckets;
}

// Query + key tokens per launch: powers of four, 16 to 1 Mi (--max_batch_tokens: 16 Ki).
const std::vector<double>& TokenBuckets() {
  static const std::vector<double> buckets = {16,    64,    256,    1024,   4096,
                                              16384, 65536, 262144, 1048576};
  return buckets;
}

const char* PathLabel(attn::EngineKind kind) {
  switch (kind) {
    case attn::EngineKind::kCudaFused:
      return "fused";
    case attn::EngineKind::kCudaNaive:
      return "naive";
    case attn::EngineKind::kCpuReference:
    case attn::EngineKind::kCpuTiled:
      return "cpu";
  }
  return "cpu";
}

const char* ReasonLabel(Metrics::PathReason reason) {
  switch (reason) {
    case Metrics::PathReason::kRequested:
      return "requested";
    case Metrics::PathReason::kAuto:
      return "auto";
    case Metrics::PathReason::kNoGpu:
      return "no_gpu";
    case Metrics::PathReason::kUnsupportedDtype:
      return "unsupported_dtype";
    case Metrics::PathReason::kUnsupportedHeadDim:
      return "unsupported_head_dim";
    case Metrics::PathReason::kUnaligned:
      return "unaligned";
    case Metrics::PathReason::kUnsupported:
      return "unsupported";
  }
  return "unsupported";
}

const char* MethodLabel(Metrics::Method method) {
  switch (method) {
    case Metrics::Method::kAttend:
      return "Attend";
    case Metrics::Method::kAttendStream:
      return "AttendStream";
    case Metrics::Method::kAttendBackward:
      return "AttendBackward";
    case Metrics::Method::kAppendKV:
      return "AppendKV";
  }
  return "Attend";
}

const char* MemoryLabel(Metrics::Memory memory) {
  return memory == Metrics::Memory::kDevice ? "device" : "host";
}

}  // namespace

int64_t FusedIoBytes(const attn::AttentionProblem& p, bool lse) {
  const int64_t es = attn::DTypeSize(p.dtype);
  const int64_t q_rows = p.total_q() * p.num_heads * p.head_dim;      // Q read, O written
  const int64_t kv_rows = p.total_k() * p.num_kv_heads * p.head_dim;  // K and V read
  return (2 * q_rows + 2 * kv_rows) * es + (lse ? p.total_q() * p.num_heads * 4 : 0);
}

int64_t NaiveIoBytes(const attn::AttentionProblem& p, bool lse) {
  const int64_t es = attn::DTypeSize(p.dtype);
  int64_t pairs = 0;  // the full score rectangle of every sequence, one head
  for (int b = 0; b < p.batch(); ++b) pairs += p.seqlen_q(b) * p.seqlen_k(b);
  return FusedIoBytes(p, lse) + p.num_heads * pairs * (2 * 4 + 2 * es);
}

Metrics::PathReason Metrics::FallbackReason(attn::Refusal refusal) {
  switch (refusal) {
    case attn::Refusal::kUnsupportedDtype:
      return PathReason::kUnsupportedDtype;
    case attn::Refusal::kUnsupportedHeadDim:
      return PathReason::kUnsupportedHeadDim;
    case attn::Refusal::kUnaligned:
      return PathReason::kUnaligned;
    default:
      return PathReason::kUnsupported;
  }
}

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  prometheus::Registry& r = *registry_;
  build_info_ = &prometheus::BuildGauge()
                     .Name("attnserve_build_info")
                     .Help("Always 1; the labels say what is running")
                     .Register(r);
  requests_ = &prometheus::BuildCounter()
                   .Name("attnserve_requests_total")
                   .Help("Attention requests answered, by method and final gRPC status code")
                   .Register(r);
  in_flight_ = &prometheus::BuildGauge()
                    .Name("attnserve_requests_in_flight")
                    .Help("Admitted requests not yet answered (queued or running)")
                    .Register(r)
                    .Add({});
  queued_ = &prometheus::BuildGauge()
                 .Name("attnserve_requests_queued")
                 .Help("Requests waiting in the batcher queue")
                 .Register(r)
                 .Add({});
  shared_memory_regions_ = &prometheus::BuildGauge()
                                .Name("attnserve_shared_memory_regions")
                                .Help("Shared-memory regions clients have registered")
                                .Register(r)
                                .Add({});
  shared_memory_bytes_ = &prometheus::BuildGauge()
                              .Name("attnserve_shared_memory_mapped_bytes")
                              .Help("Bytes of the registered shared-memory regions")
                              .Register(r)
                              .Add({});
  sessions_open_ = &prometheus::BuildGauge()
                        .Name("attnserve_sessions_open")
                        .Help("KV sessions held (created and not yet deleted or expired)")
                        .Register(r)
                        .Add({});
  auto& session_events = prometheus::BuildCounter()
                             .Name("attnserve_sessions_total")
                             .Help("KV sessions created, deleted by their owner, or expired idle")
                             .Register(r);
  session_events_ = {&session_events.Add({{"event", "created"}}),
                     &session_events.Add({{"event", "deleted"}}),
                     &session_events.Add({{"event", "expired"}})};
  kv_pool_bytes_ = &prometheus::BuildGauge()
                        .Name("attnserve_kv_pool_bytes")
                        .Help("KV page pool per device: state=total (all pages) or in_use")
                        .Register(r);
  kv_pool_free_pages_ = &prometheus::BuildGauge()
                             .Name("attnserve_kv_pool_free_pages")
                             .Help("KV pages free per device")
                             .Register(r);
  kv_append_bytes_ = &prometheus::BuildCounter()
                          .Name("attnserve_kv_append_bytes_total")
                          .Help("Bytes of K and V appended to sessions (AppendKV and steps)")
                          .Register(r);
  kv_read_bytes_ = &prometheus::BuildCounter()
                        .Name("attnserve_kv_read_bytes_total")
                        .Help("Bytes of cached K and V that session steps attended over")
                        .Register(r);
  session_steps_ = &prometheus::BuildCounter()
                        .Name("attnserve_session_steps_total")
                        .Help("Attend steps over KV sessions (decode and prefill), per device")
                        .Register(r);
  session_batch_steps_ =
      &prometheus::BuildHistogram()
           .Name("attnserve_session_batch_steps")
           .Help("Session steps per launch")
           .Register(r)
           .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128, 256});
  auto& request_duration =
      prometheus::BuildHistogram()
          .Name("attnserve_request_duration_seconds")
          .Help("End to end time of admitted requests, admission to response, by method")
          .Register(r);
  for (int m = 0; m < kMethods; ++m) {  // every method's series exists from the start
    const Method method = static_cast<Method>(m);
    request_durations_[m] =
        &request_duration.Add({{"method", MethodLabel(method)}}, LatencyBuckets());
  }
  queue_wait_ = &prometheus::BuildHistogram()
                     .Name("attnserve_queue_wait_seconds")
                     .Help("Time from admission to the start of the request's batch")
                     .Register(r)
                     .Add({}, LatencyBuckets());
  compute_ = &prometheus::BuildHistogram()
                  .Name("attnserve_compute_seconds")
                  .Help(
                      "Engine time per launch: CUDA events on the lane stream for fused and "
                      "naive, the host clock for cpu")
                  .Register(r);
  batch_requests_ = &prometheus::BuildHistogram()
                         .Name("attnserve_batch_requests")
                         .Help("Requests per engine launch")
                         .Register(r);
  batch_tokens_ = &prometheus::BuildHistogram()
                       .Name("attnserve_batch_tokens")
                       .Help("Query plus key tokens per engine launch")
                       .Register(r);
  tokens_ = &prometheus::BuildCounter()
                 .Name("attnserve_tokens_total")
                 .Help("Tokens processed, by path and kind (query or key)")
                 .Register(r);
  flops_ = &prometheus::BuildCounter()
                .Name("attnserve_flops_total")
                .Help(
                    "FLOPs processed: 4 * head_dim * visible pairs * heads per forward launch, "
                    "2.5 times that per backward (3.5 with the forward recomputed)")
                .Register(r);
  path_ = &prometheus::BuildCounter()
               .Name("attnserve_path_total")
               .Help("Requests run per path, and why that path")
               .Register(r);
  fused_io_ = &prometheus::BuildCounter()
                   .Name("attnserve_fused_io_bytes_total")
                   .Help(
                       "Device-memory bytes the fused kernel moves for the work run on path "
                       "(Q, K, V read; O, LSE written)")
                   .Register(r);
  naive_io_ = &prometheus::BuildCounter()
                   .Name("attnserve_naive_io_bytes_equivalent_total")
                   .Help(
                       "Device-memory bytes the naive path moves for the same work (fused "
                       "bytes plus S and P written and read)")
                   .Register(r);
  pool_reserved_ = &prometheus::BuildGauge()
                        .Name("attnserve_pool_reserved_bytes")
                        .Help("Bytes the lanes' pools hold")
                        .Register(r);
  pool_in_use_ = &prometheus::BuildGauge()
                      .Name("attnserve_pool_in_use_bytes")
                      .Help("Bytes of the pools used by the batches running now")
                      .Register(r);
  pool_peak_ = &prometheus::BuildGauge()
                    .Name("attnserve_pool_in_use_peak_bytes")
                    .Help("Largest attnserve_pool_in_use_bytes seen")
                    .Register(r);
  device_total_ = &prometheus::BuildGauge()
                       .Name("attnserve_device_memory_total_bytes")
                       .Help("GPU memory, from cudaMemGetInfo")
                       .Register(r);
  device_used_ = &prometheus::BuildGauge()
                      .Name("attnserve_device_memory_used_bytes")
                      .Help("GPU memory in use by all processes (total - free, cudaMemGetInfo)")
                      .Register(r);
  device_peak_ = &prometheus::BuildGauge()
                      .Name("attnserve_device_memory_used_peak_bytes")
                      .Help("Largest attnserve_device_memory_used_bytes seen")
                      .Register(r);
}

Metrics::~Metrics() = default;

absl::Status Metrics::StartExporter(const std::string& address) {
  if (endpoint_ != nullptr) return absl::FailedPreconditionError("metrics: exporter already runs");
  auto endpoint = MetricsHttpEndpoint::Start(address, [this] { return Scrape(); });
  if (!endpoint.ok()) return endpoint.status();
  endpoint_ = *std::move(endpoint);
  exporter_port_ = endpoint_->port();
  return absl::OkStatus();
}

void Metrics::SetBuildInfo(std::string_view version, bool cuda) {
  build_info_->Add({{"version", std::string(version)}, {"cuda", cuda ? "true" : "false"}}).Set(1);
}

void Metrics::CountRequest(Method method, const absl::Status& status) {
  const int code = static_cast<int>(status.code());
  const int m = static_cast<int>(method);
  auto add = [&] {
    return &requests_->Add(
        {{"method", MethodLabel(method)}, {"code", absl::StatusCodeToString(status.code())}});
  };
  if (code < 0 || code >= kCodes || m >= kMethods) {
    add()->Increment();
    return;
  }
  std::atomic<prometheus::Counter*>& slot = request_counters_[m * kCodes + code];
  prometheus::Counter* counter = slot.load(std::memory_order_acquire);
  if (counter == nullptr) {  // Add returns the same child to every caller: a race is harmless
    counter = add();
    slot.store(counter, std::memory_order_release);
  }
  counter->Increment();
}

void Metrics::OnAccepted() { accepted_.fetch_add(1, std::memory_order_relaxed); }

void Metrics::OnRejected(Method method, const absl::Status& why) {
  rejected_.fetch_add(1, std::memory_order_relaxed);
  CountRequest(method, why);
}

void Metrics::OnQueued() {
  queued_->Increment();
  in_flight_->Increment();
}

void Metrics::OnDequeued(int n) { queued_->Decrement(n); }

void Metrics::OnBatch(int requests) {
  batches_.fetch_add(1, std::memory_order_relaxed);
  if (requests > 1) batched_requests_.fetch_add(requests, std::memory_order_relaxed);
  int seen = max_batch_requests_.load(std::memory_order_relaxed);
  while (requests > seen &&
         !max_batch_requests_.compare_exchange_weak(seen, requests, std::memory_order_relaxed)) {
  }
}

void Metrics::OnPath(attn::EngineKind engine, PathReason reason, int requests) {
  path_->Add({{"path", PathLabel(engine)}, {"reason", ReasonLabel(reason)}}).Increment(requests);
}

const Metrics::LaunchSeries& Metrics::LaunchSeriesOf(attn::EngineKind engine) {
  const int kind = static_cast<int>(engine);
  if (const LaunchSeries* known = launch_series_[kind].load(std::memory_order_acquire)) {
    return *known;
  }
  absl::MutexLock lock(&launch_series_mu_);
  std::unique_ptr<LaunchSeries>& series = launch_series_storage_[kind];
  if (series == nullptr) {
    const std::string path = PathLabel(engine);
    series = std::make_unique<LaunchSeries>(LaunchSeries{
        &compute_->Add({{"path", path}}, LatencyBuckets()),
        &batch_requests_->Add({{"path", path}}, RequestBuckets()),
        &batch_tokens_->Add({{"path", path}}, TokenBuckets()),
        &tokens_->Add({{"path", path}, {"kind", "query"}}),
        &tokens_->Add({{"path", path}, {"kind", "key"}}),
        &flops_->Add({{"path", path}}),
        &fused_io_->Add({{"path", path}}),
        &naive_io_->Add({{"path", path}}),
    });
    launch_series_[kind].store(series.get(), std::memory_order_release);
  }
  return *series;
}

void Metrics::OnLaunch(const Launch& launch) {
  const LaunchSeries& series = LaunchSeriesOf(launch.engine);
  series.compute->Observe(absl::ToDoubleSeconds(launch.compute));
  series.batch_requests->Observe(launch.requests);
  series.batch_tokens->Observe(static_cast<double>(launch.query_tokens + launch.key_tokens));
  series.query_tokens->Increment(static_cast<double>(launch.query_tokens));
  series.key_tokens->Increment(static_cast<double>(launch.key_tokens));
  series.flops->Increment(launch.flops);
  series.fused_io->Increment(static_cast<double>(launch.fused_io_bytes));
  series.naive_io->Increment(static_cast<double>(launch.naive_io_bytes));
}

void Metrics::OnFinished(Method method, const absl::Status& status, absl::Duration queue,
                         absl::Duration total) {
  (status.ok() ? completed_ : failed_).fetch_add(1, std::memory_order_relaxed);
  in_flight_->Decrement();
  CountRequest(method, status);
  queue_wait_->Observe(absl::ToDoubleSeconds(queue));
  request_durations_[static_cast<int>(method)]->Observe(absl::ToDoubleSeconds(total));
}

void Metrics::OnSession(SessionEvent event, int open) {
  session_events_[static_cast<size_t>(event)]->Increment();
  sessions_open_->Set(open);
}

void Metrics::OnKvPool(std::string_view device, int64_t total_bytes, int64_t free_bytes,
                       int64_t free_pages) {
  const std::string d(device);
  kv_pool_bytes_->Add({{"device", d}, {"state", "total"}}).Set(static_cast<double>(total_bytes));
  kv_pool_bytes_->Add({{"device", d}, {"state", "in_use"}})
      .Set(static_cast<double>(total_bytes - free_bytes));
  kv_pool_free_pages_->Add({{"device", d}}).Set(static_cast<double>(free_pages));
}

void Metrics::OnSessionAppend(std::string_view device, int64_t bytes) {
  kv_append_bytes_->Add({{"device", std::string(device)}}).Increment(static_cast<double>(bytes));
}

void Metrics::OnSessionSteps(std::string_view device, int steps, int64_t kv_bytes,
                             int64_t append_bytes) {
  const std::string d(device);
  session_steps_->Add({{"device", d}}).Increment(steps);
  kv_read_bytes_->Add({{"device", d}}).Increment(static_cast<double>(kv_bytes));
  if (append_bytes > 0) kv_append_bytes_->Add({{"device", d}}).Increment(append_bytes);
  session_batch_steps_->Observe(steps);
}

void Metrics::OnSharedMemory(int regions, uint64_t mapped_bytes) {
  shared_memory_regions_->Set(regions);
  shared_memory_bytes_->Set(static_cast<double>(mapped_bytes));
}

void Metrics::OnPoolReserved(std::string_view device, Memory memory, int64_t delta_bytes) {
  pool_reserved_->Add({{"device", std::string(device)}, {"memory", MemoryLabel(memory)}})
      .Increment(static_cast<double>(delta_bytes));
}

void Metrics::OnPoolInUse(std::string_view device, Memory memory, int64_t delta_bytes) {
  absl::MutexLock lock(&memory_mu_);
  PoolBytes& pool = pool_in_use_bytes_[{std::string(device), memory}];
  if (pool.in_use_gauge == nullptr) {
    const prometheus::Labels labels = {{"device", std::string(device)},
                                       {"memory", MemoryLabel(memory)}};
    pool.in_use_gauge = &pool_in_use_->Add(labels);
    pool.peak_gauge = &pool_peak_->Add(labels);
  }
  pool.in_use += delta_bytes;
  pool.peak = std::max(pool.peak, pool.in_use);
  pool.in_use_gauge->Set(static_cast<double>(pool.in_use));
  pool.peak_gauge->Set(static_cast<double>(pool.peak));
}

void Metrics::OnDeviceMemory(std::string_view device, int64_t used_bytes, int64_t total_bytes) {
  const prometheus::Labels labels = {{"device", std::string(device)}};
  absl::MutexLock lock(&memory_mu_);
  int64_t& peak = device_used_peak_[std::string(device)];
  peak = std::max(peak, used_bytes);
  device_total_->Add(labels).Set(static_cast<double>(total_bytes));
  device_used_->Add(labels).Set(static_cast<double>(used_bytes));
  device_peak_->Add(labels).Set(static_cast<double>(peak));
}

v1::Stats Metrics::Snapshot() const {
  v1::Stats s;
  s.set_requests_accepted(accepted_.load(std::memory_order_relaxed));
  s.set_requests_rejected(rejected_.load(std::memory_order_relaxed));
  s.set_requests_completed(completed_.load(std::memory_order_relaxed));
  s.set_requests_failed(failed_.load(std::memory_order_relaxed));
  s.set_batches(batches_.load(std::memory_order_relaxed));
  s.set_batched_requests(batched_requests_.load(std::memory_order_relaxed));
  s.set_max_batch_requests_seen(max_batch_requests_.load(std::memory_order_relaxed));
  return s;
}

std::string Metrics::Scrape() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace attnserve
