#include "cuda_test_util.h"

#include <cuda_runtime_api.h>

#include <utility>

#include "attn/status_macros.h"
#include "cuda/common/cuda_status.h"
#include "gtest/gtest.h"

namespace attn::testing {
namespace {

absl::StatusOr<cuda::DeviceBuffer> UploadBytes(const void* data, size_t bytes) {
  ATTN_ASSIGN_OR_RETURN(cuda::DeviceBuffer buffer, cuda::DeviceBuffer::Allocate(bytes));
  if (bytes > 0) {
    ATTN_CUDA_RETURN_IF_ERROR(cudaMemcpy(buffer.get(), data, bytes, cudaMemcpyHostToDevice));
  }
  return buffer;
}

template <typename Ref>
Ref Rebase(Ref host_view, void* device_base) {
  return {static_cast<decltype(host_view.data)>(device_base), host_view.token_stride,
          host_view.head_stride};
}

}  // namespace

std::string NoDeviceReason() {
  const absl::StatusOr<int> devices = cuda::CountDevices();
  return devices.ok() ? std::string() : std::string(devices.status().message());
}

absl::StatusOr<DeviceForward> DeviceForward::Upload(const AttentionTensors& t) {
  DeviceForward d;
  ATTN_ASSIGN_OR_RETURN(d.q_, UploadBytes(t.q.data(), t.q.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.k_, UploadBytes(t.k.data(), t.k.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.v_, UploadBytes(t.v.data(), t.v.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.o_, UploadBytes(t.o.data(), t.o.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.lse_, UploadBytes(t.lse.data(), t.lse.size() * sizeof(float)));
  d.q_ref_ = Rebase(t.q.ref(), d.q_.get());
  d.k_ref_ = Rebase(t.k.ref(), d.k_.get());
  d.v_ref_ = Rebase(t.v.ref(), d.v_.get());
  d.o_ref_ = {d.o_.get(), t.o.token_stride(), t.o.head_stride()};
  return d;
}

ForwardArgs DeviceForward::args(void* stream, bool with_lse) {
  ForwardArgs a;
  a.q = q_ref_;
  a.k = k_ref_;
  a.v = v_ref_;
  a.o = o_ref_;
  a.lse = with_lse ? lse_.as<float>() : nullptr;
  a.stream = stream;
  return a;
}

absl::Status DeviceForward::Download(AttentionTensors& t) const {
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  ATTN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (o_.size() > 0) {
    ATTN_CUDA_RETURN_IF_ERROR(cudaMemcpy(t.o.data(), o_.get(), o_.size(), cudaMemcpyDeviceToHost));
  }
  if (lse_.size() > 0) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(t.lse.data(), lse_.get(), lse_.size(), cudaMemcpyDeviceToHost));
  }
  return absl::OkStatus();
}

absl::StatusOr<DeviceBackward> DeviceBackward::Upload(const AttentionTensors& t) {
  DeviceBackward d;
  ATTN_ASSIGN_OR_RETURN(d.q_, UploadBytes(t.q.data(), t.q.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.k_, UploadBytes(t.k.data(), t.k.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.v_, UploadBytes(t.v.data(), t.v.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.o_, UploadBytes(t.o.data(), t.o.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.d_o_, UploadBytes(t.d_o.data(), t.d_o.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.lse_, UploadBytes(t.lse.data(), t.lse.size() * sizeof(float)));
  ATTN_ASSIGN_OR_RETURN(d.dq_, UploadBytes(t.dq.data(), t.dq.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.dk_, UploadBytes(t.dk.data(), t.dk.size_bytes()));
  ATTN_ASSIGN_OR_RETURN(d.dv_, UploadBytes(t.dv.data(), t.dv.size_bytes()));
  d.args_.q = Rebase(t.q.ref(), d.q_.get());
  d.args_.k = Rebase(t.k.ref(), d.k_.get());
  d.args_.v = Rebase(t.v.ref(), d.v_.get());
  d.args_.o = Rebase(t.o.ref(), d.o_.get());
  d.args_.d_o = Rebase(t.d_o.ref(), d.d_o_.get());
  d.args_.lse = d.lse_.as<float>();
  d.args_.dq = {d.dq_.get(), t.dq.token_stride(), t.dq.head_stride()};
  d.args_.dk = {d.dk_.get(), t.dk.token_stride(), t.dk.head_stride()};
  d.args_.dv = {d.dv_.get(), t.dv.token_stride(), t.dv.head_stride()};
  return d;
}

BackwardArgs DeviceBackward::args(void* stream) {
  BackwardArgs a = args_;
  a.stream = stream;
  return a;
}

absl::Status DeviceBackward::Download(AttentionTensors& t) const {
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  ATTN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  for (auto [host, device] :
       {std::pair{&t.dq, &dq_}, std::pair{&t.dk, &dk_}, std::pair{&t.dv, &dv_}}) {
    if (device->size() == 0) continue;
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(host->data(), device->get(), device->size(), cudaMemcpyDeviceToHost));
  }
  return absl::OkStatus();
}

absl::StatusOr<DeviceBackward> DeviceBackward::UploadAfterForward(const AttentionProblem& p,
                                                                  AttentionTensors& t) {
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<Engine> cpu, CreateEngine(EngineKind::kCpuReference, {}));
  ATTN_RETURN_IF_ERROR(cpu->Forward(p, t.forward_args()));
  t.dq.Poison();
  t.dk.Poison();
  t.dv.Poison();
  return Upload(t);
}

std::unique_ptr<Engine> MustCreate(EngineKind kind, const EngineOptions& options) {
  auto engine = CreateEngine(kind, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

}  // namespace attn::testing
