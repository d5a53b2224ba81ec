#include "server/response_writer.h"

#include <string>

#include "absl/time/clock.h"

namespace attnserve {
namespace {

std::byte* Resize(std::string* bytes, int64_t size) {
  bytes->resize(static_cast<size_t>(size));
  return reinterpret_cast<std::byte*>(bytes->data());
}

void FillTiming(const Work& work, v1::Timing* t) {
  const ExecutionReport& r = work.report;
  t->set_queue_us(absl::ToInt64Microseconds(r.started - work.accepted));
  t->set_compute_us(absl::ToInt64Microseconds(r.computed - r.started));
  t->set_total_us(absl::ToInt64Microseconds(absl::Now() - work.accepted));
  if (r.kernel.has_value()) t->set_kernel_us(absl::ToInt64Microseconds(*r.kernel));
}

void DescribeTensor(attn::DType dtype, const std::vector<int64_t>& shape, v1::Tensor* t) {
  t->set_dtype(ToProtoDType(dtype));
  for (int64_t d : shape) t->add_shape(d);
}

void BindForwardOutputs(const DecodedForward& request, OutputSink* o, OutputSink* lse,
                        v1::AttendResponse* response) {
  if (request.o_out != nullptr) {
    o->fixed = request.o_out;
  } else {
    o->allocate = [response](int64_t bytes) {
      return Resize(response->mutable_o()->mutable_data(), bytes);
    };
  }
  if (request.return_lse) {
    lse->allocate = [response](int64_t bytes) {
      return Resize(response->mutable_lse()->mutable_data(), bytes);
    };
  }
}

void FillForwardResponse(const Work& work, const DecodedForward& r, v1::AttendResponse* response) {
  v1::Tensor& o = *response->mutable_o();
  DescribeTensor(r.problem.dtype, r.o_shape, &o);
  if (r.o_out_ref != nullptr) *o.mutable_shared_memory() = *r.o_out_ref;
  if (r.return_lse) {
    v1::Tensor& lse = *response->mutable_lse();
    lse.set_dtype(v1::DTYPE_FLOAT32);
    lse.add_shape(r.problem.num_heads);
    lse.add_shape(r.problem.total_q());
  }
  response->set_path(PathOf(work.report.engine));
  response->set_engine(std::string(attn::EngineKindName(work.report.engine)));
  FillTiming(work, response->mutable_timing());
  v1::BatchInfo& batch = *response->mutable_batch();
  batch.set_batch_id(work.report.batch_id);
  batch.set_requests(work.report.batch_requests);
  batch.set_tokens(work.report.batch_tokens);
}

}  // namespace

void BindOutputs(ForwardWork* work, v1::AttendResponse* response) {
  BindForwardOutputs(work->request, &work->o, &work->lse, response);
}

void BindOutputs(SessionStepWork* work, v1::AttendResponse* response) {
  BindForwardOutputs(work->request, &work->o, &work->lse, response);
}

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

void BindOutputs(BackwardWork* work, v1::AttendBackwardResponse* response) {
  work->dq.allocate = [response](int64_t bytes) {
    return Resize(response->mutable_d_q()->mutable_data(), bytes);
  };
  work->dk.allocate = [response](int64_t bytes) {
    return Resize(response->mutable_d_k()->mutable_data(), bytes);
  };
  work->dv.allocate = [response](int64_t bytes) {
    return Resize(response->mutable_d_v()->mutable_data(), bytes);
  };
}

void FillResponse(const ForwardWork& work, v1::AttendResponse* response) {
  FillForwardResponse(work, work.request, response);
}

void FillResponse(const SessionStepWork& work, v1::AttendResponse* response) {
  FillForwardResponse(work, work.request, response);
}

void FillResponse(const BackwardWork& work, v1::AttendBackwardResponse* response) {
  const DecodedBackward& r = work.request;
  const attn::DType dtype = r.problem().dtype;
  DescribeTensor(dtype, r.forward.o_shape, response->mutable_d_q());
  DescribeTensor(dtype, r.k_shape, response->mutable_d_k());
  DescribeTensor(dtype, r.k_shape, response->mutable_d_v());
  response->set_path(PathOf(work.report.engine));
  response->set_engine(std::string(attn::EngineKindName(work.report.engine)));
  response->set_deterministic(work.deterministic);
  FillTiming(work, response->mutable_timing());
}

}  // namespace attnserve
