#include "server/lane.h"

#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attn/status_macros.h"

namespace attnserve {
namespace {

constexpr absl::Duration kMemorySampleInterval = absl::Milliseconds(100);
// Below this many bytes a batch's copies run on the lane thread alone: waking helpers costs more
// than copying a few hundred KiB. Above it, copies are split into chunks over the copy threads.
constexpr int64_t kParallelCopyBytes = int64_t{1} << 20;
constexpr int64_t kCopyChunkBytes = int64_t{1} << 20;
// Finishing a request costs ~6 us of completion-thread CPU (H200 machine, gRPC 1.51), one after
// another: the 11th request of a batch would wait ~60 us for the ten before it. Two threads per
// lane halve that; batches under kMinSplit requests go to one thread (a wake-up costs more).
constexpr int kCompletionThreads = 2;
constexpr size_t kMinSplit = 4;

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

}  // namespace

std::atomic<uint64_t> Lane::next_batch_id_{1};

Lane::Lane(int index, Parts parts, int copy_threads, Batcher* batcher, Metrics* metrics)
    : index_(index),
      parts_(std::move(parts)),
      batcher_(batcher),
      metrics_(metrics),
      copy_threads_(std::max(1, copy_threads), absl::StrCat("attn-copy", index)),
      completions_(absl::StrCat("attn-done-", index), kCompletionThreads) {
  thread_ = std::thread([this] { Loop(); });
  pthread_setname_np(thread_.native_handle(), absl::StrCat("attn-lane-", index_).c_str());
}

Lane::~Lane() {
  if (thread_.joinable()) thread_.join();
}

void Lane::Loop() {
  while (true) {
    Batch batch = batcher_->Next(parts_.device_slot);
    if (batch.empty()) return;
    Run(std::move(batch));
  }
}

DevicePool* Lane::PoolFor(const attn::Engine& engine) {
  return engine.memory_space() == attn::MemorySpace::kDevice ? parts_.device_pool.get()
                                                             : parts_.host_pool.get();
}

void Lane::Run(Batch batch) {
  const absl::Time now = absl::Now();
  Batch live;
  for (auto& work : batch) {
    absl::Status dropped;
    // The deadline first: gRPC cancels a call whose deadline passed, so an expired request is
    // usually marked cancelled too, and it must count as DEADLINE_EXCEEDED.
    if (now >= work->deadline) {
      dropped = absl::DeadlineExceededError(absl::StrCat("request: deadline passed after ",
                                                         absl::FormatDuration(now - work->accepted),
                                                         " in the queue; dropped before compute"));
    } else if (work->cancelled != nullptr && work->cancelled->load()) {
      dropped = absl::CancelledError("request: cancelled by the client before compute");
    }
    if (!dropped.ok()) {
      metrics_->OnFinished(work->method, dropped, now - work->accepted, now - work->accepted);
      work->done(dropped, *work);
    } else {
      live.push_back(std::move(work));
    }
  }
  if (live.empty()) return;

  ExecutionReport report;
  report.started = now;
  report.batch_id = next_batch_id_.fetch_add(1);
  report.batch_requests = static_cast<int>(live.size());
  for (const auto& work : live) report.batch_tokens += work->tokens;
  report.engine = parts_.engines[live.front()->engine]->kind();
  // One metrics update per run of requests with the same reason (a label lookup each).
  size_t run_start = 0;
  for (size_t i = 0; i < live.size(); ++i) {
    if (i + 1 == live.size() || live[i + 1]->path_reason != live[i]->path_reason) {
      metrics_->OnPath(report.engine, live[i]->path_reason, static_cast<int>(i + 1 - run_start));
      run_start = i + 1;
    }
  }

  absl::Status status;
  switch (live.front()->kind) {
    case WorkKind::kBackward:  // never batched
      status = RunBackward(static_cast<BackwardWork&>(*live.front()), &report);
      break;
    case WorkKind::kAppend:  // never batched
      status = RunAppend(static_cast<AppendWork&>(*live.front()), &report);
      break;
    case WorkKind::kSessionStep: {
      std::vector<SessionStepWork*> steps;
      for (auto& work : live) steps.push_back(static_cast<SessionStepWork*>(work.get()));
      status = RunSessionSteps(steps, &report);
      break;
    }
    case WorkKind::kForward: {
      std::vector<ForwardWork*> forwards;
      std::vector<OutputPlan> plans;
      for (auto& work : live) {
        auto* f = static_cast<ForwardWork*>(work.get());
        forwards.push_back(f);
        plans.push_back({f->request.problem.total_q(), &f->o, &f->lse, false});
      }
      Launched launched;
      status = RunForward(forwards, &report, &launched);
      // Every O leaves the staging region before the next batch reuses it.
      if (status.ok()) {
        for (size_t i = 0; i < plans.size(); ++i) plans[i].o_direct = launched.o_direct[i];
        CopyOutputs(launched, plans);
      }
      break;
    }
  }
  // What the batch wrote is in place (appends committed): the next work of its sessions may go.
  batcher_->Release(live);
  metrics_->OnBatch(static_cast<int>(live.size()));
  for (auto& work : live) work->report = report;
  Finish(std::move(live), status, now);
}

void Lane::Finish(Batch live, const absl::Status& status, absl::Time started) {
  const absl::Time end = absl::Now();
  // Answers one share of the batch; the work (and the shared-memory regions it holds) goes with
  // it.
  auto finish = [this, status, started, end](Batch& works) {
    for (auto& work : works) {
      const absl::Status& s = work->failure.ok() ? status : work->failure;
      metrics_->OnFinished(work->method, s, started - work->accepted, end - work->accepted);
      work->done(s, *work);
    }
    works.clear();
  };
  if (!batcher_->HasQueuedWork()) {  // nothing waits for this lane: answer here, no wake-up
    finish(live);
    return;
  }
  // With work waiting, the lane goes on to it and its completion threads answer these, the
  // batch split between them when it is large enough.
  const size_t shares =
      live.size() >= kMinSplit ? static_cast<size_t>(completions_.threads()) : size_t{1};
  const size_t per_share = (live.size() + shares - 1) / shares;
  for (size_t first = 0; first < live.size(); first += per_share) {
    auto share = std::make_shared<Batch>();
    for (size_t i = first; i < std::min(live.size(), first + per_share); ++i) {
      share->push_back(std::move(live[i]));
    }
    completions_.Post([finish, share] { finish(*share); });
  }
}

void Lane::RunCopies(const std::vector<CopyTask>& copies) {
  int64_t total = 0;
  for (const CopyTask& c : copies) total += c.bytes;
  if (total < kParallelCopyBytes || copy_threads_.num_workers() == 1) {
    for (const CopyTask& c : copies) std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
    return;
  }
  // Large batches (or large requests): chunks small enough to balance over the copy threads.
  std::vector<CopyTask> chunks;
  for (const CopyTask& c : copies) {
    for (int64_t at = 0; at < c.bytes; at += kCopyChunkBytes) {
      chunks.push_back({c.dst + at, c.src + at, std::min(kCopyChunkBytes, c.bytes - at)});
    }
  }
  copy_threads_.ParallelFor(static_cast<int64_t>(chunks.size()), [&](int, int64_t i) {
    std::memcpy(chunks[i].dst, chunks[i].src, static_cast<size_t>(chunks[i].bytes));
  });
}

void Lane::CopyOutputs(const Launched& launched, const std::vector<OutputPlan>& plans) {
  const attn::AttentionProblem& p = launched.problem;
  const int64_t total_q = p.total_q();
  std::vector<CopyTask> copies;
  int64_t q_first = 0;
  for (const OutputPlan& plan : plans) {
    const int64_t nq = plan.rows;
    if (launched.o != nullptr && nq > 0 && !plan.o_direct) {
      copies.push_back({plan.o->Get(nq * launched.q_row), launched.o + q_first * launched.q_row,
                        nq * launched.q_row});
    }
    if (plan.lse != nullptr && plan.lse->wanted()) {
      std::byte* lse = plan.lse->Get(p.num_heads * nq * 4);
      for (int h = 0; h < p.num_heads; ++h) {
        std::memcpy(lse + h * nq * 4, launched.lse + h * total_q + q_first,
                    static_cast<size_t>(nq * 4));
      }
    }
    q_first += nq;
  }
  RunCopies(copies);
}

void Lane::SampleDeviceMemory(DevicePool& pool, const std::string& label, absl::Time now) {
  if (next_memory_sample_ > now) return;
  // cudaMemGetInfo is a driver round trip; a gauge scraped every few seconds does not need it
  // per batch.
  next_memory_sample_ = now + kMemorySampleInterval;
  int64_t used = 0, total = 0;
  if (pool.DeviceMemory(&used, &total).ok()) metrics_->OnDeviceMemory(label, used, total);
}

absl::Status Lane::RunForward(const std::vector<ForwardWork*>& batch, ExecutionReport* report,
                              Launched* launched) {
  const ForwardWork& first = *batch.front();
  attn::Engine& engine = *parts_.engines[first.engine];

  std::vector<const attn::AttentionProblem*> problems;
  bool want_lse = false;
  for (const ForwardWork* work : batch) {
    problems.push_back(&work->request.problem);
    want_lse = want_lse || work->lse.wanted();
  }
  attn::AttentionProblem& p = launched->problem;
  p = PackProblems(problems);

  const int64_t es = attn::DTypeSize(p.dtype);
  const int64_t q_row = int64_t{p.num_heads} * p.head_dim * es;
  const int64_t kv_row = int64_t{p.num_kv_heads} * p.head_dim * es;
  const int64_t total_q = p.total_q(), total_k = p.total_k();

  DevicePool* pool = PoolFor(engine);
  if (pool == nullptr) return absl::InternalError("lane: no pool for the engine");
  // A lone request on a host engine is not staged: the engine reads Q, K, V where the request's
  // bytes are and writes O straight to its sink; the pool holds only the LSE.
  const bool in_place = pool->space() == attn::MemorySpace::kHost && batch.size() == 1;
  const ForwardStaging at = ForwardStaging::For(p, want_lse, in_place);
  PoolUse use(pool, metrics_);
  ATTN_RETURN_IF_ERROR(use.Acquire(at.end));
  const bool device_pool = pool->space() == attn::MemorySpace::kDevice;

  std::byte* host = pool->host();
  void* in_place_o = nullptr;
  if (in_place) {
    in_place_o = first.o.Get(total_q * q_row);
  } else {
    // Each request's Q, K and V go to their rows of the packed tensors: packed into the staging
    // region, except that tensors in page-locked shared memory go straight to the device.
    std::vector<CopyTask> copies;
    std::vector<DevicePool::HostCopy> direct;
    int64_t q_at = at.q, k_at = at.k, v_at = at.v;
    for (const ForwardWork* work : batch) {
      const DecodedForward& r = work->request;
      const int64_t qb = r.problem.total_q() * q_row, kb = r.problem.total_k() * kv_row;
      for (const auto& [src, to, bytes] :
           {std::tuple{r.q, q_at, qb}, std::tuple{r.k, k_at, kb}, std::tuple{r.v, v_at, kb}}) {
        if (bytes == 0) continue;
        const auto* from = reinterpret_cast<const std::byte*>(src);
        if (device_pool && r.InPinnedRegion(src, bytes)) {
          direct.push_back({const_cast<char*>(src), to, bytes});
        } else {
          copies.push_back({host + to, from, bytes});
        }
      }
      q_at += qb;
      k_at += kb;
      v_at += kb;
    }
    RunCopies(copies);
    // The packed range in one copy; the direct copies follow it on the same stream, so they
    // land last wherever the range covered their rows too.
    if (!copies.empty() || direct.empty()) ATTN_RETURN_IF_ERROR(pool->CopyToDevice(0, at.o));
    ATTN_RETURN_IF_ERROR(pool->CopyManyToDevice(direct));
  }

  std::byte* dev = pool->device();
  attn::ForwardArgs args;
  if (in_place) {
    const DecodedForward& r = first.request;
    args.q = attn::Packed<const void*>(r.q, p.num_heads, p.head_dim);
    args.k = attn::Packed<const void*>(r.k, p.num_kv_heads, p.head_dim);
    args.v = attn::Packed<const void*>(r.v, p.num_kv_heads, p.head_dim);
    args.o = attn::Packed<void*>(in_place_o, p.num_heads, p.head_dim);
  } else {
    args.q = attn::Packed<const void*>(dev + at.q, p.num_heads, p.head_dim);
    args.k = attn::Packed<const void*>(dev + at.k, p.num_kv_heads, p.head_dim);
    args.v = attn::Packed<const void*>(dev + at.v, p.num_kv_heads, p.head_dim);
    args.o = attn::Packed<void*>(dev + at.o, p.num_heads, p.head_dim);
  }
  args.lse = want_lse ? reinterpret_cast<float*>(dev + at.lse) : nullptr;
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
    const ForwardWork& work = *batch[i];
    const int64_t bytes = work.request.problem.total_q() * q_row;
    if (device_pool && work.o.fixed != nullptr &&
        work.request.InPinnedRegion(work.o.fixed, bytes)) {
      if (bytes > 0) o_direct.push_back({work.o.fixed, at.o + q_at, bytes});
      launched->o_direct[i] = true;
    }
    q_at += bytes;
  }
  ATTN_RETURN_IF_ERROR(pool->CopyManyToHost(o_direct));
  const bool all_direct = std::find(launched->o_direct.begin(), launched->o_direct.end(), false) ==
                          launched->o_direct.end();
  if (all_direct) {
    ATTN_RETURN_IF_ERROR(pool->CopyToHost(at.lse, at.end - at.lse));
  } else {
    ATTN_RETURN_IF_ERROR(pool->CopyToHost(at.o, at.end - at.o));
  }
  ATTN_RETURN_IF_ERROR(pool->Synchronize());
  report->computed = absl::Now();

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
  if (compute.ok()) report->kernel = *compute;
  launch.compute = compute.ok() ? *compute : report->computed - report->started;
  metrics_->OnLaunch(launch);
  if (device_pool) SampleDeviceMemory(*pool, use.label(), report->computed);

  launched->q_row = q_row;
  launched->o = in_place ? nullptr : host + at.o;
  launched->lse = want_lse ? reinterpret_cast<const float*>(host + at.lse) : nullptr;
  return absl::OkStatus();
}

absl::Status Lane::RunBackward(BackwardWork& work, ExecutionReport* report) {
  attn::Engine& engine = *parts_.engines[work.engine];
  const DecodedBackward& r = work.request;
  const DecodedForward& f = r.forward;
  const attn::AttentionProblem& p = f.problem;
  const TensorSizes sizes = TensorSizesOf(p);
  const bool have_forward = r.o != nullptr;
  const BackwardStaging at = BackwardStaging::For(p);

  DevicePool* pool = PoolFor(engine);
  if (pool == nullptr) return absl::InternalError("lane: no pool for the engine");
  PoolUse use(pool, metrics_);
  ATTN_RETURN_IF_ERROR(use.Acquire(at.end));

  std::byte* host = pool->host();
  auto bytes_of = [](const char* data) { return reinterpret_cast<const std::byte*>(data); };
  std::vector<CopyTask> inputs = {{host + at.q, bytes_of(f.q), sizes.q},
                                  {host + at.k, bytes_of(f.k), sizes.kv},
                                  {host + at.v, bytes_of(f.v), sizes.kv},
                                  {host + at.d_o, bytes_of(r.d_o), sizes.q}};
  if (have_forward) {
    inputs.push_back({host + at.o, bytes_of(r.o), sizes.q});
    inputs.push_back({host + at.lse, bytes_of(r.lse), sizes.lse});
  }
  RunCopies(inputs);
  ATTN_RETURN_IF_ERROR(pool->CopyToDevice(0, have_forward ? at.dq : at.o));

  std::byte* dev = pool->device();
  auto in = [&](int64_t off) { return reinterpret_cast<const void*>(dev + off); };
  auto out = [&](int64_t off) { return reinterpret_cast<void*>(dev + off); };
  float* lse = reinterpret_cast<float*>(dev + at.lse);
  ATTN_RETURN_IF_ERROR(pool->StartComputeTimer());
  if (!have_forward) {
    attn::ForwardArgs fa;
    fa.q = attn::Packed<const void*>(in(at.q), p.num_heads, p.head_dim);
    fa.k = attn::Packed<const void*>(in(at.k), p.num_kv_heads, p.head_dim);
    fa.v = attn::Packed<const void*>(in(at.v), p.num_kv_heads, p.head_dim);
    fa.o = attn::Packed<void*>(out(at.o), p.num_heads, p.head_dim);
    fa.lse = lse;
    fa.stream = pool->stream();
    ATTN_RETURN_IF_ERROR(engine.Forward(p, fa));
  }
  attn::BackwardArgs b;
  b.q = attn::Packed<const void*>(in(at.q), p.num_heads, p.head_dim);
  b.k = attn::Packed<const void*>(in(at.k), p.num_kv_heads, p.head_dim);
  b.v = attn::Packed<const void*>(in(at.v), p.num_kv_heads, p.head_dim);
  b.o = attn::Packed<const void*>(in(at.o), p.num_heads, p.head_dim);
  b.d_o = attn::Packed<const void*>(in(at.d_o), p.num_heads, p.head_dim);
  b.lse = lse;
  b.dq = attn::Packed<void*>(out(at.dq), p.num_heads, p.head_dim);
  b.dk = attn::Packed<void*>(out(at.dk), p.num_kv_heads, p.head_dim);
  b.dv = attn::Packed<void*>(out(at.dv), p.num_kv_heads, p.head_dim);
  b.stream = pool->stream();
  b.deterministic = work.deterministic;
  ATTN_RETURN_IF_ERROR(engine.Backward(p, b));
  ATTN_RETURN_IF_ERROR(pool->StopComputeTimer());
  ATTN_RETURN_IF_ERROR(pool->CopyToHost(at.dq, at.end - at.dq));
  ATTN_RETURN_IF_ERROR(pool->Synchronize());
  report->computed = absl::Now();

  Metrics::Launch launch;
  launch.engine = engine.kind();
  launch.requests = 1;
  launch.query_tokens = p.total_q();
  launch.key_tokens = p.total_k();
  // Recomputing S and P, then dV, dP, dS -> dQ and dK: 2.5 forwards' worth of matmul FLOPs.
  launch.flops = p.forward_flops() * (have_forward ? 2.5 : 3.5);
  const absl::StatusOr<absl::Duration> compute = pool->ComputeTime();
  if (compute.ok()) report->kernel = *compute;
  launch.compute = compute.ok() ? *compute : report->computed - report->started;
  metrics_->OnLaunch(launch);

  RunCopies({{work.dq.Get(sizes.q), host + at.dq, sizes.q},
             {work.dk.Get(sizes.kv), host + at.dk, sizes.kv},
             {work.dv.Get(sizes.kv), host + at.dv, sizes.kv}});
  return absl::OkStatus();
}

absl::Status Lane::RunAppend(AppendWork& work, ExecutionReport* report) {
  Session& session = work.append->session();
  KvPagePool* kv = parts_.kv_pool;
  if (kv == nullptr || &session.pool() != kv) {
    return absl::InternalError("lane: an append reached a lane of another device");
  }
  ATTN_ASSIGN_OR_RETURN(std::vector<SessionAppend::RowSpan> spans, work.append->Extend(work.rows));
  const int64_t row = session.row_bytes();
  const int64_t bytes = work.rows * row;
  if (kv->space() == attn::MemorySpace::kHost) {  // the pages are host memory: copy straight in
    std::vector<CopyTask> copies;
    for (const SessionAppend::RowSpan& s : spans) {
      const int64_t from = s.first_row * row, n = s.rows * row;
      copies.push_back(
          {kv->base() + s.k_offset, reinterpret_cast<const std::byte*>(work.k) + from, n});
      copies.push_back(
          {kv->base() + s.v_offset, reinterpret_cast<const std::byte*>(work.v) + from, n});
    }
    RunCopies(copies);
  } else {
    DevicePool* pool = parts_.device_pool.get();
    if (pool == nullptr) return absl::InternalError("lane: no device pool for the KV pages");
    PoolUse use(pool, metrics_);
    ATTN_RETURN_IF_ERROR(use.Acquire(2 * bytes + kStagingAlign));
    const int64_t v_at = (bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign;
    RunCopies({{pool->host(), reinterpret_cast<const std::byte*>(work.k), bytes},
               {pool->host() + v_at, reinterpret_cast<const std::byte*>(work.v), bytes}});
    ATTN_RETURN_IF_ERROR(pool->CopyToDevice(0, v_at + bytes));
    std::vector<DevicePool::RegionCopy> scatter;
    for (const SessionAppend::RowSpan& s : spans) {
      const int64_t from = s.first_row * row, n = s.rows * row;
      scatter.push_back({from, kv->base() + s.k_offset, n});
      scatter.push_back({v_at + from, kv->base() + s.v_offset, n});
    }
    ATTN_RETURN_IF_ERROR(pool->CopyFromRegion(scatter));
    ATTN_RETURN_IF_ERROR(pool->Synchronize());
  }
  report->computed = absl::Now();
  metrics_->OnSessionAppend(kv->label(), 2 * bytes);
  return absl::OkStatus();
}

absl::Status Lane::RunSessionSteps(const std::vector<SessionStepWork*>& batch,
                                   ExecutionReport* report) {
  KvPagePool* kv = parts_.kv_pool;
  if (kv == nullptr) return absl::InternalError("lane: session steps on a lane without pages");
  attn::Engine& engine = *parts_.engines[batch.front()->engine];
  DevicePool* pool = PoolFor(engine);
  if (pool == nullptr) return absl::InternalError("lane: no pool for the engine");

  // Each step's view of its session: the committed keys, or (appending) the keys it adds too.
  struct Step {
    SessionStepWork* work;
    std::unique_ptr<SessionAppend> append;
    std::vector<SessionAppend::RowSpan> spans;
    Session::Snapshot keys;
  };
  std::vector<Step> steps;
  for (SessionStepWork* work : batch) {
    Step step{work, nullptr, {}, {}};
    if (&work->session->pool() != kv) {
      work->failure = absl::InternalError("lane: a session step reached a lane of another device");
      continue;
    }
    if (work->append) {
      absl::StatusOr<std::unique_ptr<SessionAppend>> open =
          SessionAppend::Open(work->session.shared());
      absl::StatusOr<std::vector<SessionAppend::RowSpan>> spans =
          open.ok() ? (*open)->Extend(work->request.problem.total_k()) : open.status();
      if (!spans.ok()) {
        work->failure = spans.status();
        continue;
      }
      step.spans = *std::move(spans);
      step.append = *std::move(open);
      step.keys = step.append->Pending();
    } else {
      step.keys = work->session->Read();
    }
    steps.push_back(std::move(step));
  }
  if (steps.empty()) return absl::OkStatus();  // every step failed on its own

  // One variable-length problem over every step: its query rows, its session's keys.
  const SessionStepWork& first = *steps.front().work;
  attn::AttentionProblem p = first.request.problem;
  p.cu_seqlens_q.assign(1, 0);
  p.cu_seqlens_k.assign(1, 0);
  int max_blocks = 1;
  int64_t appended_rows = 0;
  bool want_lse = false;
  for (const Step& step : steps) {
    p.cu_seqlens_q.push_back(p.cu_seqlens_q.back() +
                             static_cast<int32_t>(step.work->request.problem.total_q()));
    p.cu_seqlens_k.push_back(p.cu_seqlens_k.back() + static_cast<int32_t>(step.keys.tokens));
    max_blocks = std::max(max_blocks, static_cast<int>(step.keys.pages.size()));
    appended_rows += step.work->request.problem.total_k();
    want_lse = want_lse || step.work->lse.wanted();
  }
  const Session& geometry = *first.session.get();
  const int64_t es = attn::DTypeSize(p.dtype);
  const int64_t q_row = int64_t{p.num_heads} * p.head_dim * es;
  const int64_t kv_row = geometry.row_bytes();
  const int64_t total_q = p.total_q();
  auto align = [](int64_t n) { return (n + kStagingAlign - 1) / kStagingAlign * kStagingAlign; };
  // Staging: Q, the appended K and V rows, the block table; then O and the LSE.
  const int64_t q_at = 0;
  const int64_t k_at = align(q_at + total_q * q_row);
  const int64_t v_at = align(k_at + appended_rows * kv_row);
  const int64_t table_at = align(v_at + appended_rows * kv_row);
  const int64_t o_at = align(table_at + int64_t{p.batch()} * max_blocks * 4);
  const int64_t lse_at = align(o_at + total_q * q_row);
  const int64_t end = lse_at + (want_lse ? total_q * p.num_heads * 4 : 0);
  PoolUse use(pool, metrics_);
  ATTN_RETURN_IF_ERROR(use.Acquire(end));
  std::byte* host = pool->host();

  std::vector<CopyTask> copies;
  std::vector<DevicePool::RegionCopy> scatter;
  auto* table = reinterpret_cast<int32_t*>(host + table_at);
  int64_t q_rows = 0, kv_rows = 0;
  for (size_t b = 0; b < steps.size(); ++b) {
    const Step& step = steps[b];
    const DecodedForward& r = step.work->request;
    const int64_t nq = r.problem.total_q(), nk = r.problem.total_k();
    copies.push_back(
        {host + q_at + q_rows * q_row, reinterpret_cast<const std::byte*>(r.q), nq * q_row});
    if (nk > 0) {
      copies.push_back(
          {host + k_at + kv_rows * kv_row, reinterpret_cast<const std::byte*>(r.k), nk * kv_row});
      copies.push_back(
          {host + v_at + kv_rows * kv_row, reinterpret_cast<const std::byte*>(r.v), nk * kv_row});
      for (const SessionAppend::RowSpan& s : step.spans) {
        const int64_t n = s.rows * kv_row, from = (kv_rows + s.first_row) * kv_row;
        scatter.push_back({k_at + from, kv->base() + s.k_offset, n});
        scatter.push_back({v_at + from, kv->base() + s.v_offset, n});
      }
    }
    int32_t* row = table + b * max_blocks;
    std::copy(step.keys.pages.begin(), step.keys.pages.end(), row);
    std::fill(row + step.keys.pages.size(), row + max_blocks, 0);
    q_rows += nq;
    kv_rows += nk;
  }
  RunCopies(copies);
  ATTN_RETURN_IF_ERROR(pool->CopyToDevice(0, o_at));
  ATTN_RETURN_IF_ERROR(pool->CopyFromRegion(scatter));

  std::byte* dev = pool->device();
  attn::PagedForwardArgs args;
  args.q = attn::Packed<const void*>(dev + q_at, p.num_heads, p.head_dim);
  args.kv.pages = kv->base();
  args.kv.page_stride = kv->page_bytes() / es;
  args.kv.page_tokens = geometry.page_tokens();
  args.kv.num_pages = kv->num_pages();
  args.kv.block_table = reinterpret_cast<const int32_t*>(dev + table_at);
  args.kv.max_blocks = max_blocks;
  args.o = attn::Packed<void*>(dev + o_at, p.num_heads, p.head_dim);
  args.lse = want_lse ? reinterpret_cast<float*>(dev + lse_at) : nullptr;
  args.stream = pool->stream();
  ATTN_RETURN_IF_ERROR(pool->StartComputeTimer());
  ATTN_RETURN_IF_ERROR(engine.ForwardPaged(p, args));
  ATTN_RETURN_IF_ERROR(pool->StopComputeTimer());
  ATTN_RETURN_IF_ERROR(pool->CopyToHost(o_at, end - o_at));
  ATTN_RETURN_IF_ERROR(pool->Synchronize());
  report->computed = absl::Now();
  for (Step& step : steps) {
    // A session deleted while its step ran: the answer stands (it attended over what the
    // session held), the appended row goes with the session.
    if (step.append != nullptr) step.append->Commit().IgnoreError();
    step.work->keys = step.keys.tokens;
  }

  Metrics::Launch launch;
  launch.engine = engine.kind();
  launch.requests = static_cast<int>(steps.size());
  launch.query_tokens = total_q;
  launch.key_tokens = p.total_k();
  launch.flops = p.forward_flops();
  launch.fused_io_bytes = FusedIoBytes(p, want_lse);
  launch.naive_io_bytes = NaiveIoBytes(p, want_lse);
  const absl::StatusOr<absl::Duration> compute = pool->ComputeTime();
  if (compute.ok()) report->kernel = *compute;
  launch.compute = compute.ok() ? *compute : report->computed - report->started;
  metrics_->OnLaunch(launch);
  metrics_->OnSessionSteps(kv->label(), static_cast<int>(steps.size()), 2 * p.total_k() * kv_row,
                           2 * appended_rows * kv_row);
  if (pool->space() == attn::MemorySpace::kDevice) {
    SampleDeviceMemory(*pool, use.label(), report->computed);
  }

  Launched launched;
  launched.problem = p;
  launched.q_row = q_row;
  launched.o = host + o_at;
  launched.lse = want_lse ? reinterpret_cast<const float*>(host + lse_at) : nullptr;
  std::vector<OutputPlan> plans;
  for (const Step& step : steps) {
    plans.push_back({step.work->request.problem.total_q(), &step.work->o, &step.work->lse, false});
  }
  CopyOutputs(launched, plans);
  return absl::OkStatus();
}

}  // namespace attnserve
