#include "clients/cli/load_generator.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "server/request_decoder.h"

namespace attnserve::client {
namespace {

constexpr char kAttendMethod[] = "/attnserve.v1.AttentionService/Attend";

double Percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const size_t i = std::min(sorted.size() - 1, static_cast<size_t>(q * (sorted.size() - 1) + 0.5));
  return sorted[i];
}

}  // namespace

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

LoadGenerator::LoadGenerator(const ChannelFactory* factory,
                             const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                             std::vector<v1::AttendRequest> pool, absl::Duration timeout)
    : factory_(factory), channels_(channels), pool_(std::move(pool)), timeout_(timeout) {
  for (const auto& channel : channels_) {
    stubs_.push_back(v1::AttentionService::NewStub(channel));
    attend_methods_.push_back(std::make_unique<grpc::internal::RpcMethod>(
        kAttendMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel));
  }
  for (const v1::AttendRequest& r : pool_) {
    grpc::ByteBuffer bytes;
    bool own_buffer = false;
    const grpc::Status s =
        grpc::SerializationTraits<v1::AttendRequest>::Serialize(r, &bytes, &own_buffer);
    if (!s.ok()) bytes.Clear();  // an empty body: the server answers INVALID_ARGUMENT
    payloads_.push_back(std::move(bytes));
  }
  DecodeLimits limits;
  limits.memory_limit_bytes = int64_t{1} << 40;
  for (const v1::AttendRequest& r : pool_) {
    absl::StatusOr<DecodedRequest> d = DecodeAttendRequest(r, limits);
    flops_.push_back(d.ok() ? d->problem.forward_flops() : 0.0);
    tokens_.push_back(d.ok() ? d->tokens() : 0);
  }
}

LoadGenerator::Sample LoadGenerator::MakeSample(absl::Duration latency, size_t request,
                                                const v1::AttendResponse& response) {
  return {latency,
          request,
          response.batch().requests(),
          response.timing().queue_us(),
          response.timing().compute_us(),
          response.timing().total_us()};
}

LoadResult LoadGenerator::RunClosedLoop(int concurrency, absl::Duration duration) {
  absl::Mutex mu;
  std::vector<Sample> samples;
  std::map<std::string, int64_t> errors;
  const absl::Time start = absl::Now();
  const absl::Time stop = start + duration;
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
        const grpc::Status status =
            grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, v1::AttendResponse,
                                              grpc::ByteBuffer, grpc::protobuf::MessageLite>(
                channels_[channel].get(), *attend_methods_[channel], &context, payloads_[next],
                &response);
        const absl::Duration latency = absl::Now() - t0;
        absl::MutexLock lock(&mu);
        if (status.ok()) {
          samples.push_back(MakeSample(latency, next, response));
        } else {
          ++errors[StatusCodeName(status.error_code())];
        }
        next = (next + 1) % pool_.size();
      }
    });
  }
  for (std::thread& t : clients) t.join();
  return Summarize("closed", concurrency, absl::Now() - start, std::move(samples), errors);
}

LoadResult LoadGenerator::RunOpenLoop(double requests_per_s, absl::Duration duration) {
  struct Call {
    grpc::ClientContext context;
    v1::AttendResponse response;
    absl::Time sent;
    size_t request;
  };
  absl::Mutex mu;
  std::vector<Sample> samples;
  std::map<std::string, int64_t> errors;
  int outstanding = 0;
  std::mt19937_64 rng(12345);
  std::exponential_distribution<double> gap(requests_per_s);
  const absl::Time start = absl::Now();
  const absl::Time stop = start + duration;
  absl::Time next_send = start;
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
          absl::MutexLock lock(&mu);
          if (status.ok()) {
            samples.push_back(MakeSample(latency, call->request, call->response));
          } else {
            ++errors[StatusCodeName(status.error_code())];
          }
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
  return Summarize("open", requests_per_s, absl::Now() - start, std::move(samples), errors);
}

LoadResult LoadGenerator::Summarize(const std::string& mode, double level, absl::Duration elapsed,
                                    std::vector<Sample> samples,
                                    const std::map<std::string, int64_t>& errors) const {
  LoadResult r;
  r.mode = mode;
  r.level = level;
  r.seconds = absl::ToDoubleSeconds(elapsed);
  r.ok = static_cast<int64_t>(samples.size());
  r.errors = errors;
  std::vector<double> ms, queue_ms, compute_ms, overhead_ms, outside_ms;
  double flops = 0, tokens = 0, batch = 0;
  for (const Sample& s : samples) {
    const double e2e = absl::ToDoubleMilliseconds(s.latency);
    ms.push_back(e2e);
    queue_ms.push_back(s.queue_us / 1e3);
    compute_ms.push_back(s.compute_us / 1e3);
    overhead_ms.push_back(e2e - s.compute_us / 1e3);
    outside_ms.push_back(e2e - s.total_us / 1e3);
    flops += flops_[s.request];
    tokens += static_cast<double>(tokens_[s.request]);
    batch += s.batch_requests;
  }
  for (auto* v : {&ms, &queue_ms, &compute_ms, &overhead_ms, &outside_ms}) {
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
  r.p50_overhead_ms = Percentile(overhead_ms, 0.50);
  r.p50_outside_ms = Percentile(outside_ms, 0.50);
  r.mean_batch_requests = r.ok > 0 ? batch / r.ok : 0;
  return r;
}

std::string LoadResult::ToJson() const {
  std::string errs;
  for (const auto& [code, n] : errors) {
    absl::StrAppend(&errs, errs.empty() ? "" : ", ", "\"", code, "\": ", n);
  }
  return absl::StrFormat(
      "{\"mode\": \"%s\", \"level\": %g, \"seconds\": %.3f, \"ok\": %d, \"errors\": {%s}, "
      "\"requests_per_s\": %.2f, \"tokens_per_s\": %.1f, \"tflops\": %.6f, \"p50_ms\": %.3f, "
      "\"p90_ms\": %.3f, \"p99_ms\": %.3f, \"mean_batch_requests\": %.2f, "
      "\"p50_queue_ms\": %.3f, \"p50_compute_ms\": %.3f, \"p50_overhead_ms\": %.3f, "
      "\"p50_outside_ms\": %.3f}",
      mode, level, seconds, ok, errs, requests_per_s, tokens_per_s, tflops, p50_ms, p90_ms, p99_ms,
      mean_batch_requests, p50_queue_ms, p50_compute_ms, p50_overhead_ms, p50_outside_ms);
}

std::string LoadResult::ToText() const {
  int64_t failed = 0;
  for (const auto& [code, n] : errors) failed += n;
  return absl::StrFormat(
      "%-6s %8g  %8.1f req/s %10.0f tok/s %9.4f TFLOP/s  p50 %7.2f ms  p90 %7.2f ms  p99 %7.2f "
      "ms  batch %5.2f  compute p50 %7.3f ms  overhead p50 %7.3f ms  ok %d  errors %d",
      mode, level, requests_per_s, tokens_per_s, tflops, p50_ms, p90_ms, p99_ms,
      mean_batch_requests, p50_compute_ms, p50_overhead_ms, ok, failed);
}

}  // namespace attnserve::client
