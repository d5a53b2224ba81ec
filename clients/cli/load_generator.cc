#include "clients/cli/load_generator.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "proto/wire/request_decoder.h"

namespace attnserve::client {
namespace {

constexpr char kAttendMethod[] = "/attnserve.v1.AttentionService/Attend";
constexpr char kAttendStreamMethod[] = "/attnserve.v1.AttentionService/AttendStream";

std::string JsonEscape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out;
}

// User + system CPU seconds of this process so far.
double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

double Percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const size_t i = std::min(sorted.size() - 1, static_cast<size_t>(q * (sorted.size() - 1) + 0.5));
  return sorted[i];
}

}  // namespace

// Reports one level's progress from a thread of its own until Stop.
class LoadGenerator::ProgressWatch {
 public:
  ProgressWatch(const LoadGenerator& generator, LevelProgress level, Tally* tally)
      : level_(std::move(level)), tally_(tally), report_(generator.progress_) {
    if (!report_) return;
    const absl::Duration every = generator.progress_every_;
    const absl::Time start = absl::Now();
    thread_ = std::thread([this, every, start] {
      while (!stop_.WaitForNotificationWithTimeout(every)) Report(absl::Now() - start, false);
      Report(absl::Now() - start, true);
    });
  }
  ~ProgressWatch() { Stop(); }

  // The last report (done) and the thread's end.
  void Stop() {
    if (!thread_.joinable()) return;
    stop_.Notify();
    thread_.join();
  }

 private:
  void Report(absl::Duration elapsed, bool done) {
    LevelProgress now = level_;
    now.elapsed = elapsed;
    now.done = done;
    {
      absl::MutexLock lock(&tally_->mu);
      now.ok = static_cast<int64_t>(tally_->samples.size());
      for (const auto& [code, n] : tally_->errors) now.errors += n;
    }
    report_(now);
  }

  const LevelProgress level_;
  Tally* const tally_;
  const std::function<void(const LevelProgress&)> report_;
  absl::Notification stop_;
  std::thread thread_;
};

void LoadGenerator::SetProgress(absl::Duration every,
                                std::function<void(const LevelProgress&)> report) {
  progress_every_ = every;
  progress_ = std::move(report);
}

void LoadGenerator::ShowProgress(FILE* out, absl::Duration every) {
  if (every <= absl::ZeroDuration()) return;
  const bool terminal = isatty(fileno(out)) != 0;
  SetProgress(terminal ? std::min(every, absl::Milliseconds(250)) : every,
              [out, terminal](const LevelProgress& p) {
                if (terminal) {
                  std::fprintf(out, "\r\033[K%s", p.done ? "" : p.ToText().c_str());
                } else if (!p.done) {
                  std::fprintf(out, "%s\n", p.ToText().c_str());
                }
                std::fflush(out);
              });
}

std::string LevelProgress::ToText() const {
  const double seconds = absl::ToDoubleSeconds(elapsed);
  return absl::StrFormat("bench: %s %s, %g %s: %.1f s of %.1f s%s, %d ok (%.0f req/s), %d errors",
                         mode, rpc, level, mode == "open" ? "req/s offered" : "in flight", seconds,
                         absl::ToDoubleSeconds(duration),
                         elapsed > duration ? ", waiting for the last answers" : "", ok,
                         seconds > 0 ? ok / seconds : 0.0, errors);
}

std::string StatusCodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i <= 16 ? kNames[i] : absl::StrCat("CODE_", i);
}

int64_t LoadGenerator::SharedMemoryBytes(const std::vector<v1::AttendRequest>& pool,
                                         int output_slots) {
  int64_t bytes = 0, largest_o = 0;
  for (const v1::AttendRequest& r : pool) {
    for (const v1::Tensor* t : {&r.q(), &r.k(), &r.v()}) {
      bytes = SharedMemoryAlignUp(bytes) + static_cast<int64_t>(t->data().size());
    }
    largest_o = std::max(largest_o, static_cast<int64_t>(r.q().data().size()));
  }
  return SharedMemoryAlignUp(bytes) + output_slots * SharedMemoryAlignUp(largest_o);
}

LoadGenerator::LoadGenerator(const ChannelFactory* factory,
                             const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                             std::vector<v1::AttendRequest> pool, absl::Duration timeout,
                             const SharedMemoryTensors* shared_memory)
    : factory_(factory), channels_(channels), pool_(std::move(pool)), timeout_(timeout) {
  // Sizes first, from the tensors' own bytes.
  DecodeLimits limits;
  limits.memory_limit_bytes = int64_t{1} << 40;
  for (const v1::AttendRequest& r : pool_) {
    absl::StatusOr<DecodedForward> d = DecodeAttendRequest(r, limits);
    flops_.push_back(d.ok() ? d->problem.forward_flops() : 0.0);
    tokens_.push_back(d.ok() ? d->tokens() : 0);
  }
  if (shared_memory != nullptr) {
    SharedMemoryBuffer& buffer = *shared_memory->buffer;
    int64_t offset = 0, largest_o = 0;
    for (v1::AttendRequest& r : pool_) {
      largest_o = std::max(largest_o, static_cast<int64_t>(r.q().data().size()));
      for (v1::Tensor* t : {r.mutable_q(), r.mutable_k(), r.mutable_v()}) {
        // Sized by SharedMemoryBytes: a tensor that does not fit keeps its bytes.
        (void)MoveToSharedMemory(t, shared_memory->region, buffer, &offset);
      }
    }
    const int64_t slot_bytes = SharedMemoryAlignUp(largest_o);
    int64_t at = SharedMemoryAlignUp(offset);
    for (int i = 0; i < shared_memory->output_slots && at + slot_bytes <= buffer.size(); ++i) {
      v1::AttendRequest o_only;
      v1::SharedMemoryRef& ref = *o_only.mutable_o_shared_memory();
      ref.set_region(shared_memory->region);
      ref.set_offset(static_cast<uint64_t>(at));
      // Every pooled request has the same O size in a bench pool (one shape); the ref must name
      // the exact size, so a mixed pool sends O back in the response instead.
      ref.set_byte_size(static_cast<uint64_t>(largest_o));
      o_slots_.push_back(grpc::Slice(o_only.SerializeAsString()));
      at += slot_bytes;
    }
    for (const v1::AttendRequest& r : pool_) {
      if (static_cast<int64_t>(r.q().shared_memory().byte_size()) != largest_o) o_slots_.clear();
    }
  }
  for (const auto& channel : channels_) {
    stubs_.push_back(v1::AttentionService::NewStub(channel));
    attend_methods_.push_back(std::make_unique<grpc::internal::RpcMethod>(
        kAttendMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel));
    stream_methods_.push_back(std::make_unique<grpc::internal::RpcMethod>(
        kAttendStreamMethod, grpc::internal::RpcMethod::BIDI_STREAMING, channel));
  }
  auto serialize = [](const v1::AttendRequest& r) {
    grpc::ByteBuffer bytes;
    bool own_buffer = false;
    const grpc::Status s =
        grpc::SerializationTraits<v1::AttendRequest>::Serialize(r, &bytes, &own_buffer);
    if (!s.ok()) bytes.Clear();  // an empty body: the server answers INVALID_ARGUMENT
    return bytes;
  };
  for (const v1::AttendRequest& r : pool_) {
    payloads_.push_back(serialize(r));
    v1::AttendRequest body = r;
    body.clear_request_id();
    std::vector<grpc::Slice> slices;
    if (!serialize(body).Dump(&slices).ok()) slices.clear();
    bodies_.push_back(std::move(slices));
  }
}

void LoadGenerator::AppendBody(size_t request, int slot, std::vector<grpc::Slice>* message) const {
  message->insert(message->end(), bodies_[request].begin(), bodies_[request].end());
  if (slot >= 0 && slot < static_cast<int>(o_slots_.size())) message->push_back(o_slots_[slot]);
}

LoadGenerator::Sample LoadGenerator::MakeSample(absl::Duration latency, size_t request,
                                                const v1::AttendResponse& response) {
  return {latency,
          request,
          response.batch().requests(),
          response.timing().queue_us(),
          response.timing().compute_us(),
          response.timing().total_us(),
          response.timing().kernel_us()};
}

LoadResult LoadGenerator::RunClosedLoop(int concurrency, absl::Duration duration) {
  Tally tally;
  tally.cpu_at_start = ProcessCpuSeconds();
  const absl::Time start = absl::Now();
  const absl::Time stop = start + duration;
  ProgressWatch progress(*this, {"closed", "unary", static_cast<double>(concurrency), {}, duration},
                         &tally);
  std::vector<std::thread> clients;
  for (int c = 0; c < concurrency; ++c) {
    clients.emplace_back([&, c] {
      size_t next = static_cast<size_t>(c) % pool_.size();
      while (absl::Now() < stop) {
        grpc::ClientContext context;
        factory_->Prepare(&context, timeout_);
        v1::AttendResponse response;
        const absl::Time t0 = absl::Now();
        const size_t channel = c % channels_.size();
        grpc::ByteBuffer with_slot;
        if (!o_slots_.empty()) {
          std::vector<grpc::Slice> message;
          AppendBody(next, c, &message);
          with_slot = grpc::ByteBuffer(message.data(), message.size());
        }
        const grpc::Status status =
            grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, v1::AttendResponse,
                                              grpc::ByteBuffer, grpc::protobuf::MessageLite>(
                channels_[channel].get(), *attend_methods_[channel], &context,
                o_slots_.empty() ? payloads_[next] : with_slot, &response);
        const absl::Duration latency = absl::Now() - t0;
        absl::MutexLock lock(&tally.mu);
        if (status.ok()) {
          tally.samples.push_back(MakeSample(latency, next, response));
        } else {
          tally.Error(StatusCodeName(status.error_code()), status.error_message());
        }
        next = (next + 1) % pool_.size();
      }
    });
  }
  for (std::thread& t : clients) t.join();
  progress.Stop();
  return Summarize("closed", "unary", concurrency, absl::Now() - start, tally);
}

LoadResult LoadGenerator::RunClosedLoopStream(int concurrency, int streams,
                                              absl::Duration duration) {
  streams = std::clamp(streams, 1, std::max(1, concurrency));
  Tally tally;
  tally.cpu_at_start = ProcessCpuSeconds();
  const absl::Time start = absl::Now();
  const absl::Time stop = start + duration;
  ProgressWatch progress(
      *this, {"closed", "stream", static_cast<double>(concurrency), {}, duration}, &tally);
  std::vector<std::thread> threads;
  int first_slot = 0;
  for (int s = 0; s < streams; ++s) {
    const int depth = concurrency / streams + (s < concurrency % streams ? 1 : 0);
    threads.emplace_back([this, s, depth, first_slot, stop, &tally] {
      RunStream(s, depth, first_slot, stop, &tally);
    });
    first_slot += depth;
  }
  for (std::thread& t : threads) t.join();
  progress.Stop();
  LoadResult r = Summarize("closed", "stream", concurrency, absl::Now() - start, tally);
  r.streams = streams;
  return r;
}

void LoadGenerator::RunStream(int stream, int depth, int first_slot, absl::Time stop,
                              Tally* tally) {
  const size_t channel = static_cast<size_t>(stream) % channels_.size();
  grpc::ClientContext context;
  // The deadline covers the whole stream: the load, then the last responses.
  factory_->Prepare(&context, (stop - absl::Now()) + timeout_);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, v1::AttendResponse>> call(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, v1::AttendResponse>::Create(
          channels_[channel].get(), *stream_methods_[channel], &context));

  // Slot i is one request in flight at a time, tagged request_id = i. One thread runs the loop:
  // it fills every slot, then sends a slot's next request as soon as its answer is read, so no
  // thread hand-off sits between an answer and the next request.
  struct Slot {
    grpc::Slice id;  // the serialized message holding only request_id; fixed
    bool busy = false;
    absl::Time sent;
    size_t request = 0;
  };
  std::vector<Slot> slots(static_cast<size_t>(depth));
  for (int i = 0; i < depth; ++i) {
    v1::AttendRequest id_only;
    id_only.set_request_id(absl::StrCat(i));
    slots[i].id = grpc::Slice(id_only.SerializeAsString());
  }
  size_t next = static_cast<size_t>(stream) % pool_.size();
  int in_flight = 0;
  bool broken = false;
  auto send = [&](int i) {
    Slot& s = slots[i];
    std::vector<grpc::Slice> message;
    message.reserve(2 + bodies_[next].size());
    message.push_back(s.id);
    AppendBody(next, first_slot + i, &message);
    const grpc::ByteBuffer bytes(message.data(), message.size());
    s.busy = true;
    s.request = next;
    s.sent = absl::Now();
    next = (next + 1) % pool_.size();
    if (!call->Write(bytes)) {  // the stream failed; Finish says why
      s.busy = false;
      broken = true;
      return;
    }
    ++in_flight;
  };
  for (int i = 0; i < depth && !broken && absl::Now() < stop; ++i) send(i);

  v1::AttendResponse response;
  while (in_flight > 0 && call->Read(&response)) {
    const absl::Time now = absl::Now();
    int slot = -1;
    if (!absl::SimpleAtoi(response.request_id(), &slot) || slot < 0 || slot >= depth ||
        !slots[slot].busy) {  // a second answer to one request would be the server's bug
      absl::MutexLock lock(&tally->mu);
      tally->Error("UNMATCHED_RESPONSE",
                   absl::StrCat("request_id '", response.request_id(), "' not in flight"));
      continue;
    }
    Slot& s = slots[slot];
    s.busy = false;
    --in_flight;
    {
      absl::MutexLock lock(&tally->mu);
      if (response.has_error()) {
        tally->Error(StatusCodeName(static_cast<grpc::StatusCode>(response.error().code())),
                     response.error().message());
      } else {
        tally->samples.push_back(MakeSample(now - s.sent, s.request, response));
      }
    }
    if (!broken && now < stop) send(slot);
  }
  call->WritesDone();
  while (call->Read(&response)) {
  }
  const grpc::Status status = call->Finish();
  if (in_flight > 0) {  // sent but never answered
    absl::MutexLock tally_lock(&tally->mu);
    tally->Error(StatusCodeName(status.ok() ? grpc::StatusCode::UNKNOWN : status.error_code()),
                 absl::StrCat("stream ended with ", in_flight,
                              " requests unanswered: ", status.error_message()),
                 in_flight);
  }
}

LoadResult LoadGenerator::RunOpenLoop(double requests_per_s, absl::Duration duration) {
  struct Call {
    grpc::ClientContext context;
    v1::AttendResponse response;
    absl::Time sent;
    size_t request;
  };
  absl::Mutex mu;
  Tally tally;
  tally.cpu_at_start = ProcessCpuSeconds();
  int outstanding = 0;
  std::mt19937_64 rng(12345);
  std::exponential_distribution<double> gap(requests_per_s);
  const absl::Time start = absl::Now();
  const absl::Time stop = start + duration;
  absl::Time next_send = start;
  ProgressWatch progress(*this, {"open", "unary", requests_per_s, {}, duration}, &tally);
  size_t next = 0;
  while (next_send < stop) {
    absl::SleepFor(next_send - absl::Now());
    auto* call = new Call;
    call->request = next;
    call->sent = absl::Now();
    factory_->Prepare(&call->context, timeout_);
    {
      absl::MutexLock lock(&mu);
      ++outstanding;
    }
    stubs_[next % stubs_.size()]->async()->Attend(
        &call->context, &pool_[next], &call->response, [&, call](grpc::Status status) {
          const absl::Duration latency = absl::Now() - call->sent;
          {
            absl::MutexLock lock(&tally.mu);
            if (status.ok()) {
              tally.samples.push_back(MakeSample(latency, call->request, call->response));
            } else {
              tally.Error(StatusCodeName(status.error_code()), status.error_message());
            }
          }
          absl::MutexLock lock(&mu);
          --outstanding;
          delete call;
        });
    next = (next + 1) % pool_.size();
    next_send += absl::Seconds(gap(rng));
  }
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &outstanding));
  }
  progress.Stop();
  return Summarize("open", "unary", requests_per_s, absl::Now() - start, tally);
}

LoadResult LoadGenerator::Summarize(const std::string& mode, const std::string& rpc, double level,
                                    absl::Duration elapsed, Tally& tally) const {
  absl::MutexLock lock(&tally.mu);
  const std::vector<Sample>& samples = tally.samples;
  LoadResult r;
  r.mode = mode;
  r.rpc = rpc;
  r.level = level;
  r.seconds = absl::ToDoubleSeconds(elapsed);
  r.ok = static_cast<int64_t>(samples.size());
  r.errors = tally.errors;
  r.first_errors = tally.first_errors;
  r.client_cpu_s = ProcessCpuSeconds() - tally.cpu_at_start;
  r.shared_memory = !pool_.empty() && pool_.front().q().has_shared_memory();
  std::vector<double> ms, queue_ms, compute_ms, kernel_ms, overhead_ms, outside_ms;
  double flops = 0, tokens = 0, batch = 0;
  for (const Sample& s : samples) {
    const double e2e = absl::ToDoubleMilliseconds(s.latency);
    ms.push_back(e2e);
    queue_ms.push_back(s.queue_us / 1e3);
    compute_ms.push_back(s.compute_us / 1e3);
    kernel_ms.push_back(s.kernel_us / 1e3);
    overhead_ms.push_back(e2e - s.kernel_us / 1e3);
    outside_ms.push_back(e2e - s.total_us / 1e3);
    flops += flops_[s.request];
    tokens += static_cast<double>(tokens_[s.request]);
    batch += s.batch_requests;
  }
  for (auto* v : {&ms, &queue_ms, &compute_ms, &kernel_ms, &overhead_ms, &outside_ms}) {
    std::sort(v->begin(), v->end());
  }
  if (r.seconds > 0) {
    r.requests_per_s = r.ok / r.seconds;
    r.tokens_per_s = tokens / r.seconds;
    r.tflops = flops / r.seconds / 1e12;
  }
  r.p50_ms = Percentile(ms, 0.50);
  r.p90_ms = Percentile(ms, 0.90);
  r.p99_ms = Percentile(ms, 0.99);
  r.p50_queue_ms = Percentile(queue_ms, 0.50);
  r.p50_compute_ms = Percentile(compute_ms, 0.50);
  r.p50_kernel_ms = Percentile(kernel_ms, 0.50);
  r.p50_overhead_ms = Percentile(overhead_ms, 0.50);
  r.p50_outside_ms = Percentile(outside_ms, 0.50);
  r.mean_batch_requests = r.ok > 0 ? batch / r.ok : 0;
  return r;
}

std::string LoadResult::ToJson() const {
  std::string errs, messages;
  for (const auto& [code, n] : errors) {
    absl::StrAppend(&errs, errs.empty() ? "" : ", ", "\"", code, "\": ", n);
  }
  for (const auto& [code, message] : first_errors) {
    absl::StrAppend(&messages, messages.empty() ? "" : ", ", "\"", code, "\": \"",
                    JsonEscape(message), "\"");
  }
  return absl::StrFormat(
      "{\"mode\": \"%s\", \"rpc\": \"%s\", \"streams\": %d, \"shared_memory\": %s, "
      "\"level\": %g, \"seconds\": %.3f, "
      "\"ok\": %d, \"errors\": {%s}, \"requests_per_s\": %.2f, \"tokens_per_s\": %.1f, "
      "\"tflops\": %.6f, \"p50_ms\": %.3f, \"p90_ms\": %.3f, \"p99_ms\": %.3f, "
      "\"mean_batch_requests\": %.2f, \"p50_queue_ms\": %.3f, \"p50_compute_ms\": %.3f, "
      "\"p50_kernel_ms\": %.4f, \"p50_overhead_ms\": %.3f, \"p50_outside_ms\": %.3f, "
      "\"client_cpu_s\": %.3f, \"first_errors\": {%s}}",
      mode, rpc, streams, shared_memory ? "true" : "false", level, seconds, ok, errs,
      requests_per_s, tokens_per_s, tflops, p50_ms, p90_ms, p99_ms, mean_batch_requests,
      p50_queue_ms, p50_compute_ms, p50_kernel_ms, p50_overhead_ms, p50_outside_ms, client_cpu_s,
      messages);
}

std::string LoadResult::ToText() const {
  int64_t failed = 0;
  for (const auto& [code, n] : errors) failed += n;
  return absl::StrFormat(
      "%-6s %-6s %8g  %8.1f req/s %10.0f tok/s %9.4f TFLOP/s  p50 %7.2f ms  p90 %7.2f ms  p99 "
      "%7.2f ms  batch %5.2f  compute p50 %7.3f ms  kernel p50 %7.3f ms  overhead p50 %7.3f ms  "
      "ok %d  errors %d",
      mode, rpc, level, requests_per_s, tokens_per_s, tflops, p50_ms, p90_ms, p99_ms,
      mean_batch_requests, p50_compute_ms, p50_kernel_ms, p50_overhead_ms, ok, failed);
}

}  // namespace attnserve::client
