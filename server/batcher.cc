#include "server/batcher.h"

#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"

namespace attnserve {
namespace {

constexpr int64_t kAlign = 256;
constexpr absl::Duration kMemorySampleInterval = absl::Milliseconds(100);
// Below this many bytes a batch's copies run on the lane thread alone: waking helpers costs more
// than copying a few hundred KiB. Above it, copies are split into chunks over the lane's threads.
constexpr int64_t kParallelCopyBytes = int64_t{1} << 20;
constexpr int64_t kCopyChunkBytes = int64_t{1} << 20;
// Finishing a request costs ~6 us of completion-thread CPU (H200 machine, gRPC 1.51), one after
// another: the 11th request of a batch would wait ~60 us for the ten before it. Two threads per
// lane halve that; batches under kMinSplit requests go to one thread (a wake-up costs more).
constexpr int kCompletionThreads = 2;
constexpr size_t kMinSplit = 4;

int64_t AlignUp(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

bool Compatible(const WorkItem& a, const WorkItem& b) {
  if (a.request.backward || b.request.backward) return &a == &b;  // backward runs alone
  const attn::AttentionProblem& p = a.request.problem;
  const attn::AttentionProblem& q = b.request.problem;
  return a.engine == b.engine && p.dtype == q.dtype && p.num_heads == q.num_heads &&
         p.num_kv_heads == q.num_kv_heads && p.head_dim == q.head_dim && p.causal == q.causal &&
         p.effective_window_left() == q.effective_window_left() &&
         p.effective_window_right() == q.effective_window_right() && p.scale() == q.scale();
}

// One batch's use of a lane's pool: the pool's device made current, the pool grown to the
// batch, and both counted in the pool metrics (a device pool holds a pinned host region and a
// device region of the same size), the bytes in use until the batch is done.
class PoolUse {
 public:
  PoolUse(DevicePool* pool, Metrics* metrics)
      : pool_(pool),
        metrics_(metrics),
        label_(pool->label()),
        device_(pool->space() == attn::MemorySpace::kDevice) {}
  ~PoolUse() {
    if (in_use_ > 0) Account(&Metrics::OnPoolInUse, -in_use_);
  }
  PoolUse(const PoolUse&) = delete;
  PoolUse& operator=(const PoolUse&) = delete;

  // The metrics' device label: "cuda:N" or "cpu".
  const std::string& label() const { return label_; }

  absl::Status Acquire(int64_t bytes) {
    ATTN_RETURN_IF_ERROR(pool_->Activate());
    const int64_t before = pool_->capacity();
    ATTN_RETURN_IF_ERROR(pool_->Reserve(bytes));
    if (pool_->capacity() != before) {
      Account(&Metrics::OnPoolReserved, pool_->capacity() - before);
    }
    Account(&Metrics::OnPoolInUse, bytes);
    in_use_ = bytes;
    return absl::OkStatus();
  }

 private:
  void Account(void (Metrics::*hook)(std::string_view, Metrics::Memory, int64_t), int64_t delta) {
    (metrics_->*hook)(label_, Metrics::Memory::kHost, delta);
    if (device_) (metrics_->*hook)(label_, Metrics::Memory::kDevice, delta);
  }

  DevicePool* const pool_;
  Metrics* const metrics_;
  const std::string label_;
  const bool device_;
  int64_t in_use_ = 0;
};

v1::Path PathOf(attn::EngineKind kind) {
  switch (kind) {
    case attn::EngineKind::kCudaFused:
      return v1::PATH_FUSED;
    case attn::EngineKind::kCudaNaive:
      return v1::PATH_NAIVE;
    case attn::EngineKind::kCpuReference:
    case attn::EngineKind::kCpuTiled:
      return v1::PATH_CPU;
  }
  return v1::PATH_AUTO;
}

}  // namespace

struct Batcher::Launched {
  attn::AttentionProblem problem;  // the packed problem
  int64_t q_row = 0;               // bytes of one query token's O row
  const std::byte* o = nullptr;    // the batch's O rows, or null when written in place
  const float* lse = nullptr;      // [heads, total_q], or null
  attn::EngineKind kind = attn::EngineKind::kCpuTiled;
  std::string engine_name;
  uint64_t batch_id = 0;
  int requests = 0;
  int64_t tokens = 0;
  absl::Time started, computed;
  std::optional<absl::Duration> kernel;  // the engine call, when the pool could time it
  std::vector<bool> o_direct;            // per request: O already copied to its shared-memory range
};

Batcher::Completions::Completions(const std::string& name, int threads) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { Loop(); });
    pthread_setname_np(threads_.back().native_handle(), name.substr(0, 15).c_str());
  }
}

Batcher::Completions::~Completions() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void Batcher::Completions::Post(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  work_.push_back(std::move(work));
}

void Batcher::Completions::Loop() {
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

Batcher::Batcher(const Options& options, std::vector<Lane> lanes, Metrics* metrics)
    : options_(options), metrics_(metrics), lanes_(std::move(lanes)) {
  threads_.reserve(lanes_.size());
  for (size_t i = 0; i < lanes_.size(); ++i) {
    helpers_.push_back(std::make_unique<attn::cpu::ThreadPool>(std::max(1, options_.lane_threads),
                                                               absl::StrCat("attn-copy", i)));
    completions_.push_back(
        std::make_unique<Completions>(absl::StrCat("attn-done-", i), kCompletionThreads));
    threads_.emplace_back(
        [this, i] { LaneLoop(&lanes_[i], helpers_[i].get(), completions_[i].get()); });
    pthread_setname_np(threads_.back().native_handle(), absl::StrCat("attn-lane-", i).c_str());
  }
}

Batcher::~Batcher() { Stop(); }

absl::Status Batcher::Submit(std::unique_ptr<WorkItem> item) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("server: shutting down, not accepting requests");
  if (static_cast<int>(queue_.size()) >= options_.queue_capacity) {
    return absl::ResourceExhaustedError(absl::StrCat("queue: full (", options_.queue_capacity,
                                                     " requests waiting); retry with backoff"));
  }
  queue_.push_back(std::move(item));
  metrics_->OnQueued();
  return absl::OkStatus();
}

void Batcher::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (joined_) return;
    joined_ = true;
  }
  for (std::thread& t : threads_) t.join();
  completions_.clear();  // each runs what its lane posted, then joins
}

bool Batcher::HasWorkOrStopping() const { return stopping_ || !queue_.empty(); }

bool Batcher::HasQueuedWork() const {
  absl::MutexLock lock(&mu_);
  return !queue_.empty();
}

bool Batcher::FrontBatchFull() const {
  if (stopping_ || queue_.empty()) return true;
  const WorkItem& seed = *queue_.front();
  if (seed.request.backward) return true;  // runs alone: nothing to wait for
  int count = 0;
  int64_t tokens = 0;
  for (const auto& item : queue_) {
    if (!Compatible(seed, *item)) continue;
    ++count;
    tokens += item->request.tokens();
    if (count >= options_.max_batch_requests || tokens >= options_.max_batch_tokens) return true;
  }
  return false;
}

Batcher::Batch Batcher::TakeBatch() {
  Batch batch;
  int64_t tokens = 0;
  int64_t bytes = 0;
  const WorkItem* seed = queue_.front().get();
  for (auto it = queue_.begin(); it != queue_.end();) {
    WorkItem& item = **it;
    if (!Compatible(*seed, item)) {
      ++it;
      continue;
    }
    const int64_t item_bytes = WorkingSetBytes(item.request.problem);
    // The seed always goes, even alone over the budget (validation capped it at the memory
    // limit); the others stop at the first one that does not fit, keeping FIFO order.
    if (!batch.empty() && (tokens + item.request.tokens() > options_.max_batch_tokens ||
                           bytes + item_bytes > options_.memory_limit_bytes)) {
      break;
    }
    tokens += item.request.tokens();
    bytes += item_bytes;
    batch.push_back(std::move(*it));
    it = queue_.erase(it);
    if (static_cast<int>(batch.size()) >= options_.max_batch_requests) break;
  }
  metrics_->OnDequeued(static_cast<int>(batch.size()));
  return batch;
}

void Batcher::LaneLoop(Lane* lane, attn::cpu::ThreadPool* helpers, Completions* completions) {
  while (true) {
    Batch batch;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Batcher::HasWorkOrStopping));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      // Work-conserving by default: this lane is idle, so it runs what is queued now. Under
      // load the lanes are busy and requests pile up meanwhile, which is what grows batches.
      // A positive max_queue_delay holds a batch that is not full up to that long.
      if (options_.max_queue_delay > absl::ZeroDuration()) {
        const absl::Time close_at = queue_.front()->accepted + options_.max_queue_delay;
        mu_.AwaitWithDeadline(absl::Condition(this, &Batcher::FrontBatchFull), close_at);
        if (queue_.empty()) continue;  // another lane took it
      }
      batch = TakeBatch();
    }
    RunBatch(*lane, *helpers, *completions, std::move(batch));
  }
}

void Batcher::RunBatch(Lane& lane, attn::cpu::ThreadPool& helpers, Completions& completions,
                       Batch batch) {
  const absl::Time now = absl::Now();
  Batch live;
  for (auto& item : batch) {
    absl::Status dropped;
    // The deadline first: gRPC cancels a call whose deadline passed, so an expired request is
    // usually marked cancelled too, and it must count as DEADLINE_EXCEEDED.
    if (now >= item->deadline) {
      dropped = absl::DeadlineExceededError(absl::StrCat("request: deadline passed after ",
                                                         absl::FormatDuration(now - item->accepted),
                                                         " in the queue; dropped before compute"));
    } else if (item->cancelled != nullptr && item->cancelled->load()) {
      dropped = absl::CancelledError("request: cancelled by the client before compute");
    }
    if (!dropped.ok()) {
      metrics_->OnFinished(item->method, dropped, now - item->accepted, now - item->accepted);
      item->done(dropped);
    } else {
      live.push_back(std::move(item));
    }
  }
  if (live.empty()) return;

  if (live.front()->request.backward) {  // TakeBatch never packs a backward request
    WorkItem& item = *live.front();
    metrics_->OnPath(lane.engines[item.engine]->kind(), item.path_reason);
    const absl::Status status = ExecuteBackward(lane, helpers, item, now);
    metrics_->OnBatch(1);
    metrics_->OnFinished(item.method, status, now - item.accepted, absl::Now() - item.accepted);
    item.done(status);
    return;
  }

  Launched launched;
  launched.started = now;
  launched.batch_id = next_batch_id_.fetch_add(1);
  launched.requests = static_cast<int>(live.size());
  std::vector<int64_t> q_first(live.size(), 0);  // each request's first row in the batch
  size_t run_start = 0;                          // of the requests sharing live[i]'s path reason
  for (size_t i = 0; i < live.size(); ++i) {
    launched.tokens += live[i]->request.tokens();
    if (i > 0) q_first[i] = q_first[i - 1] + live[i - 1]->request.problem.total_q();
    // One metrics update per run of requests with the same reason (a label lookup each).
    if (i + 1 == live.size() || live[i + 1]->path_reason != live[i]->path_reason) {
      metrics_->OnPath(lane.engines[live[i]->engine]->kind(), live[i]->path_reason,
                       static_cast<int>(i + 1 - run_start));
      run_start = i + 1;
    }
  }
  const absl::Status status = Execute(lane, helpers, live, &launched);
  const absl::Time end = absl::Now();
  metrics_->OnBatch(static_cast<int>(live.size()));
  if (status.ok()) {
    // Every O leaves the staging region before the next batch reuses it.
    std::vector<CopyTask> copies;
    for (size_t i = 0; i < live.size(); ++i) {
      FillResponse(launched, *live[i], q_first[i], launched.o_direct[i], &copies);
    }
    RunCopies(helpers, copies);
  }
  // Answers one share of the batch; the items (and the shared-memory regions they hold) go
  // with it.
  auto finish = [this, status, now, end](Batch& items) {
    for (auto& item : items) {
      metrics_->OnFinished(item->method, status, now - item->accepted, end - item->accepted);
      item->done(status);
    }
    items.clear();
  };
  if (!HasQueuedWork()) {  // nothing waits for this lane: answer here, no thread wake-up
    finish(live);
    return;
  }
  // With work waiting, the lane goes on to it and its completion threads answer these, the
  // batch split between them when it is large enough.
  const size_t shares =
      live.size() >= kMinSplit ? static_cast<size_t>(completions.threads()) : size_t{1};
  const size_t per_share = (live.size() + shares - 1) / shares;
  for (size_t first = 0; first < live.size(); first += per_share) {
    auto share = std::make_shared<Batch>();
    for (size_t i = first; i < std::min(live.size(), first + per_share); ++i) {
      share->push_back(std::move(live[i]));
    }
    completions.Post([finish, share] { finish(*share); });
  }
}

void Batcher::RunCopies(attn::cpu::ThreadPool& helpers, const std::vector<CopyTask>& copies) {
  int64_t total = 0;
  for (const CopyTask& c : copies) total += c.bytes;
  if (total < kParallelCopyBytes || helpers.num_workers() == 1) {
    for (const CopyTask& c : copies) std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
    return;
  }
  // Large batches (or large requests): chunks small enough to balance over the lane's threads.
  std::vector<CopyTask> chunks;
  for (const CopyTask& c : copies) {
    for (int64_t at = 0; at < c.bytes; at += kCopyChunkBytes) {
      chunks.push_back({c.dst + at, c.src + at, std::min(kCopyChunkBytes, c.bytes - at)});
    }
  }
  helpers.ParallelFor(static_cast<int64_t>(chunks.size()), [&](int, int64_t i) {
    std::memcpy(chunks[i].dst, chunks[i].src, static_cast<size_t>(chunks[i].bytes));
  });
}

void Batcher::FillResponse(const Launched& launched, const WorkItem& item, int64_t q_first,
                           bool o_written, std::vector<CopyTask>* copies) {
  const attn::AttentionProblem& p = launched.problem;
  const DecodedRequest& r = item.request;
  const int64_t nq = r.problem.total_q();
  const int64_t total_q = p.total_q();
  v1::AttendResponse& out = *item.response;
  v1::Tensor& o = *out.mutable_o();
  o.set_dtype(ToProtoDType(p.dtype));
  for (int64_t d : r.o_shape) o.add_shape(d);
  if (r.o_out_ref != nullptr) *o.mutable_shared_memory() = *r.o_out_ref;
  if (launched.o != nullptr && nq > 0 && !o_written) {
    std::byte* dst = r.o_out;
    if (dst == nullptr) {
      std::string* data = o.mutable_data();
      data->resize(static_cast<size_t>(nq * launched.q_row));
      dst = reinterpret_cast<std::byte*>(data->data());
    }
    copies->push_back({dst, launched.o + q_first * launched.q_row, nq * launched.q_row});
  }
  if (r.return_lse) {
    v1::Tensor& l = *out.mutable_lse();
    l.set_dtype(v1::DTYPE_FLOAT32);
    l.add_shape(p.num_heads);
    l.add_shape(nq);
    std::string* data = l.mutable_data();
    data->resize(static_cast<size_t>(p.num_heads * nq * 4));
    for (int h = 0; h < p.num_heads; ++h) {
      std::memcpy(data->data() + h * nq * 4, launched.lse + h * total_q + q_first, nq * 4);
    }
  }
  out.set_path(PathOf(launched.kind));
  out.set_engine(launched.engine_name);
  v1::Timing& t = *out.mutable_timing();
  t.set_queue_us(absl::ToInt64Microseconds(launched.started - item.accepted));
  t.set_compute_us(absl::ToInt64Microseconds(launched.computed - launched.started));
  t.set_total_us(absl::ToInt64Microseconds(absl::Now() - item.accepted));
  if (launched.kernel.has_value()) t.set_kernel_us(absl::ToInt64Microseconds(*launched.kernel));
  v1::BatchInfo& bi = *out.mutable_batch();
  bi.set_batch_id(launched.batch_id);
  bi.set_requests(launched.requests);
  bi.set_tokens(launched.tokens);
}

absl::Status Batcher::Execute(Lane& lane, attn::cpu::ThreadPool& helpers, const Batch& batch,
                              Launched* launched) {
  const WorkItem& first = *batch.front();
  attn::Engine& engine = *lane.engines[first.engine];

  // The packed problem: the scalars of the first request, every request's sequences in order.
  attn::AttentionProblem& p = launched->problem;
  p = first.request.problem;
  p.cu_seqlens_q.assign(1, 0);
  p.cu_seqlens_k.assign(1, 0);
  bool want_lse = false;
  for (const auto& item : batch) {
    const attn::AttentionProblem& r = item->request.problem;
    const int32_t q0 = p.cu_seqlens_q.back(), k0 = p.cu_seqlens_k.back();
    for (int b = 0; b < r.batch(); ++b) {
      p.cu_seqlens_q.push_back(q0 + r.cu_seqlens_q[b + 1]);
      p.cu_seqlens_k.push_back(k0 + r.cu_seqlens_k[b + 1]);
    }
    want_lse = want_lse || item->request.return_lse;
  }

  const int64_t es = attn::DTypeSize(p.dtype);
  const int64_t q_row = int64_t{p.num_heads} * p.head_dim * es;
  const int64_t kv_row = int64_t{p.num_kv_heads} * p.head_dim * es;
  const int64_t total_q = p.total_q(), total_k = p.total_k();

  DevicePool* pool = engine.memory_space() == attn::MemorySpace::kDevice ? lane.device_pool.get()
                                                                         : lane.host_pool.get();
  if (pool == nullptr) return absl::InternalError("batcher: lane has no pool for the engine");
  // A lone request on a host engine is not staged: the engine reads Q, K, V where the request's
  // bytes are and writes O straight into the response's bytes; the pool holds only the LSE.
  const bool in_place = pool->space() == attn::MemorySpace::kHost && batch.size() == 1;
  const int64_t q_off = 0;
  const int64_t k_off = in_place ? 0 : AlignUp(q_off + total_q * q_row);
  const int64_t v_off = in_place ? 0 : AlignUp(k_off + total_k * kv_row);
  const int64_t o_off = in_place ? 0 : AlignUp(v_off + total_k * kv_row);
  const int64_t lse_off = in_place ? 0 : AlignUp(o_off + total_q * q_row);
  const int64_t end = lse_off + (want_lse ? total_q * p.num_heads * 4 : 0);
  PoolUse use(pool, metrics_);
  ATTN_RETURN_IF_ERROR(use.Acquire(end));
  const std::string& device_label = use.label();
  const bool device_pool = pool->space() == attn::MemorySpace::kDevice;

  std::byte* host = pool->host();
  void* in_place_o = nullptr;
  if (in_place) {
    in_place_o = batch.front()->request.o_out;  // a shared-memory range, or the response's bytes
    if (in_place_o == nullptr) {
      std::string* data = batch.front()->response->mutable_o()->mutable_data();
      data->resize(static_cast<size_t>(total_q * q_row));
      in_place_o = data->data();
    }
  } else {
    // Each request's Q, K and V go to their rows of the packed tensors: packed into the staging
    // region, except that tensors in page-locked shared memory go straight to the device.
    std::vector<CopyTask> copies;
    std::vector<DevicePool::HostCopy> direct;
    int64_t q_at = q_off, k_at = k_off, v_at = v_off;
    for (const auto& item : batch) {
      const DecodedRequest& r = item->request;
      const int64_t qb = r.problem.total_q() * q_row, kb = r.problem.total_k() * kv_row;
      for (const auto& [src, at, bytes] :
           {std::tuple{r.q, q_at, qb}, std::tuple{r.k, k_at, kb}, std::tuple{r.v, v_at, kb}}) {
        if (bytes == 0) continue;
        const auto* from = reinterpret_cast<const std::byte*>(src);
        if (device_pool && r.InPinnedRegion(src, bytes)) {
          direct.push_back({const_cast<char*>(src), at, bytes});
        } else {
          copies.push_back({host + at, from, bytes});
        }
      }
      q_at += qb;
      k_at += kb;
      v_at += kb;
    }
    RunCopies(helpers, copies);
    // The packed range in one copy; the direct copies follow it on the same stream, so they
    // land last wherever the range covered their rows too.
    if (!copies.empty() || direct.empty()) ATTN_RETURN_IF_ERROR(pool->CopyToDevice(0, o_off));
    ATTN_RETURN_IF_ERROR(pool->CopyManyToDevice(direct));
  }

  std::byte* dev = pool->device();
  attn::ForwardArgs args;
  if (in_place) {
    const DecodedRequest& r = batch.front()->request;
    args.q = attn::Packed<const void*>(r.q, p.num_heads, p.head_dim);
    args.k = attn::Packed<const void*>(r.k, p.num_kv_heads, p.head_dim);
    args.v = attn::Packed<const void*>(r.v, p.num_kv_heads, p.head_dim);
    args.o = attn::Packed<void*>(in_place_o, p.num_heads, p.head_dim);
  } else {
    args.q = attn::Packed<const void*>(dev + q_off, p.num_heads, p.head_dim);
    args.k = attn::Packed<const void*>(dev + k_off, p.num_kv_heads, p.head_dim);
    args.v = attn::Packed<const void*>(dev + v_off, p.num_kv_heads, p.head_dim);
    args.o = attn::Packed<void*>(dev + o_off, p.num_heads, p.head_dim);
  }
  args.lse = want_lse ? reinterpret_cast<float*>(dev + lse_off) : nullptr;
  args.stream = pool->stream();
  ATTN_RETURN_IF_ERROR(pool->StartComputeTimer());
  ATTN_RETURN_IF_ERROR(engine.Forward(p, args));
  ATTN_RETURN_IF_ERROR(pool->StopComputeTimer());
  // O rows bound for page-locked shared memory go there directly; the rest (and the LSE) come
  // back to the staging region.
  launched->o_direct.assign(batch.size(), false);
  std::vector<DevicePool::HostCopy> o_direct;
  int64_t q_at = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const DecodedRequest& r = batch[i]->request;
    const int64_t bytes = r.problem.total_q() * q_row;
    if (device_pool && r.o_out != nullptr && r.InPinnedRegion(r.o_out, bytes)) {
      if (bytes > 0) o_direct.push_back({r.o_out, o_off + q_at, bytes});
      launched->o_direct[i] = true;
    }
    q_at += bytes;
  }
  ATTN_RETURN_IF_ERROR(pool->CopyManyToHost(o_direct));
  const bool all_direct = std::find(launched->o_direct.begin(), launched->o_direct.end(), false) ==
                          launched->o_direct.end();
  if (all_direct) {
    ATTN_RETURN_IF_ERROR(pool->CopyToHost(lse_off, end - lse_off));
  } else {
    ATTN_RETURN_IF_ERROR(pool->CopyToHost(o_off, end - o_off));
  }
  ATTN_RETURN_IF_ERROR(pool->Synchronize());
  launched->computed = absl::Now();

  Metrics::Launch launch;
  launch.engine = engine.kind();
  launch.requests = static_cast<int>(batch.size());
  launch.query_tokens = total_q;
  launch.key_tokens = total_k;
  launch.flops = p.forward_flops();
  launch.fused_io_bytes = FusedIoBytes(p, want_lse);
  launch.naive_io_bytes = NaiveIoBytes(p, want_lse);
  // Metrics never fail a batch: without the events' time the host clock stands in (copies
  // included), without cudaMemGetInfo the memory gauges keep their last values.
  const absl::StatusOr<absl::Duration> compute = pool->ComputeTime();
  if (compute.ok()) launched->kernel = *compute;
  launch.compute = compute.ok() ? *compute : launched->computed - launched->started;
  metrics_->OnLaunch(launch);
  if (device_pool && lane.next_memory_sample <= launched->computed) {
    // cudaMemGetInfo is a driver round trip; a gauge scraped every few seconds does not need
    // it per batch.
    lane.next_memory_sample = launched->computed + kMemorySampleInterval;
    int64_t used = 0, total = 0;
    if (pool->DeviceMemory(&used, &total).ok()) metrics_->OnDeviceMemory(device_label, used, total);
  }

  launched->q_row = q_row;
  launched->o = in_place ? nullptr : host + o_off;
  launched->lse = want_lse ? reinterpret_cast<const float*>(host + lse_off) : nullptr;
  launched->kind = engine.kind();
  launched->engine_name = std::string(engine.name());
  return absl::OkStatus();
}

absl::Status Batcher::ExecuteBackward(Lane& lane, attn::cpu::ThreadPool& helpers, WorkItem& item,
                                      absl::Time started) {
  attn::Engine& engine = *lane.engines[item.engine];
  const DecodedRequest& r = item.request;
  const attn::AttentionProblem& p = r.problem;
  const auto [q_bytes, kv_bytes, lse_bytes] = TensorSizesOf(p);
  const bool have_forward = r.o != nullptr;

  // Inputs first (copied to the device in one go), then the outputs (copied back in one go).
  const int64_t q_off = 0, k_off = AlignUp(q_off + q_bytes), v_off = AlignUp(k_off + kv_bytes);
  const int64_t do_off = AlignUp(v_off + kv_bytes), o_off = AlignUp(do_off + q_bytes);
  const int64_t lse_off = AlignUp(o_off + q_bytes), dq_off = AlignUp(lse_off + lse_bytes);
  const int64_t dk_off = AlignUp(dq_off + q_bytes), dv_off = AlignUp(dk_off + kv_bytes);
  const int64_t end = dv_off + kv_bytes;

  DevicePool* pool = engine.memory_space() == attn::MemorySpace::kDevice ? lane.device_pool.get()
                                                                         : lane.host_pool.get();
  if (pool == nullptr) return absl::InternalError("batcher: lane has no pool for the engine");
  PoolUse use(pool, metrics_);
  ATTN_RETURN_IF_ERROR(use.Acquire(end));

  std::byte* host = pool->host();
  auto bytes_of = [](const char* data) { return reinterpret_cast<const std::byte*>(data); };
  std::vector<CopyTask> inputs = {{host + q_off, bytes_of(r.q), q_bytes},
                                  {host + k_off, bytes_of(r.k), kv_bytes},
                                  {host + v_off, bytes_of(r.v), kv_bytes},
                                  {host + do_off, bytes_of(r.d_o), q_bytes}};
  if (have_forward) {
    inputs.push_back({host + o_off, bytes_of(r.o), q_bytes});
    inputs.push_back({host + lse_off, bytes_of(r.lse), lse_bytes});
  }
  RunCopies(helpers, inputs);
  ATTN_RETURN_IF_ERROR(pool->CopyToDevice(0, have_forward ? dq_off : o_off));

  std::byte* dev = pool->device();
  auto in = [&](int64_t off) { return reinterpret_cast<const void*>(dev + off); };
  auto out = [&](int64_t off) { return reinterpret_cast<void*>(dev + off); };
  float* lse = reinterpret_cast<float*>(dev + lse_off);
  ATTN_RETURN_IF_ERROR(pool->StartComputeTimer());
  if (!have_forward) {
    attn::ForwardArgs f;
    f.q = attn::Packed<const void*>(in(q_off), p.num_heads, p.head_dim);
    f.k = attn::Packed<const void*>(in(k_off), p.num_kv_heads, p.head_dim);
    f.v = attn::Packed<const void*>(in(v_off), p.num_kv_heads, p.head_dim);
    f.o = attn::Packed<void*>(out(o_off), p.num_heads, p.head_dim);
    f.lse = lse;
    f.stream = pool->stream();
    ATTN_RETURN_IF_ERROR(engine.Forward(p, f));
  }
  attn::BackwardArgs b;
  b.q = attn::Packed<const void*>(in(q_off), p.num_heads, p.head_dim);
  b.k = attn::Packed<const void*>(in(k_off), p.num_kv_heads, p.head_dim);
  b.v = attn::Packed<const void*>(in(v_off), p.num_kv_heads, p.head_dim);
  b.o = attn::Packed<const void*>(in(o_off), p.num_heads, p.head_dim);
  b.d_o = attn::Packed<const void*>(in(do_off), p.num_heads, p.head_dim);
  b.lse = lse;
  b.dq = attn::Packed<void*>(out(dq_off), p.num_heads, p.head_dim);
  b.dk = attn::Packed<void*>(out(dk_off), p.num_kv_heads, p.head_dim);
  b.dv = attn::Packed<void*>(out(dv_off), p.num_kv_heads, p.head_dim);
  b.stream = pool->stream();
  ATTN_RETURN_IF_ERROR(engine.Backward(p, b));
  ATTN_RETURN_IF_ERROR(pool->StopComputeTimer());
  ATTN_RETURN_IF_ERROR(pool->CopyToHost(dq_off, end - dq_off));
  ATTN_RETURN_IF_ERROR(pool->Synchronize());
  const absl::Time computed = absl::Now();

  Metrics::Launch launch;
  launch.engine = engine.kind();
  launch.requests = 1;
  launch.query_tokens = p.total_q();
  launch.key_tokens = p.total_k();
  // Recomputing S and P, then dV, dP, dS -> dQ and dK: 2.5 forwards' worth of matmul FLOPs.
  launch.flops = p.forward_flops() * (have_forward ? 2.5 : 3.5);
  const absl::StatusOr<absl::Duration> compute = pool->ComputeTime();
  launch.compute = compute.ok() ? *compute : computed - started;
  metrics_->OnLaunch(launch);

  v1::AttendBackwardResponse& response = *item.backward_response;
  std::vector<CopyTask> outputs;
  auto fill = [&](v1::Tensor* t, const std::vector<int64_t>& shape, int64_t off, int64_t bytes) {
    t->set_dtype(ToProtoDType(p.dtype));
    for (int64_t d : shape) t->add_shape(d);
    std::string* data = t->mutable_data();
    data->resize(static_cast<size_t>(bytes));
    outputs.push_back({reinterpret_cast<std::byte*>(data->data()), host + off, bytes});
  };
  fill(response.mutable_d_q(), r.o_shape, dq_off, q_bytes);
  fill(response.mutable_d_k(), r.k_shape, dk_off, kv_bytes);
  fill(response.mutable_d_v(), r.k_shape, dv_off, kv_bytes);
  RunCopies(helpers, outputs);
  response.set_path(PathOf(engine.kind()));
  response.set_engine(std::string(engine.name()));
  v1::Timing& t = *response.mutable_timing();
  t.set_queue_us(absl::ToInt64Microseconds(started - item.accepted));
  t.set_compute_us(absl::ToInt64Microseconds(computed - started));
  t.set_total_us(absl::ToInt64Microseconds(absl::Now() - item.accepted));
  if (compute.ok()) t.set_kernel_us(absl::ToInt64Microseconds(*compute));
  return absl::OkStatus();
}

}  // namespace attnserve
