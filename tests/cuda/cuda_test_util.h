// Helpers of the CUDA test suites: skipping cleanly without a device, and mirroring the host
// test tensors of common/host_tensor.h in device memory around an engine call.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "attn/engine.h"
#include "common/host_tensor.h"
#include "cuda/common/device_buffer.h"

namespace attn::testing {

// Empty when a CUDA device is usable; otherwise why not (for GTEST_SKIP).
std::string NoDeviceReason();

#define ATTN_SKIP_WITHOUT_CUDA()                                                         \
  do {                                                                                   \
    if (const std::string reason = ::attn::testing::NoDeviceReason(); !reason.empty()) { \
      GTEST_SKIP() << "no CUDA device, skipping: " << reason;                            \
    }                                                                                    \
  } while (0)

// Device copies of the forward tensors of an AttentionTensors: whole allocations (padding
// included, so writes outside the views show up), same strides.
class DeviceForward {
 public:
  // Uploads q, k, v and the current contents of o and lse (poison them first).
  static absl::StatusOr<DeviceForward> Upload(const AttentionTensors& t);

  // Arguments for a device engine; `stream` is passed through.
  ForwardArgs args(void* stream = nullptr, bool with_lse = true);

  // Waits for the device, then copies o and lse back into t.
  absl::Status Download(AttentionTensors& t) const;

 private:
  cuda::DeviceBuffer q_, k_, v_, o_, lse_;
  TensorRef q_ref_, k_ref_, v_ref_;
  MutableTensorRef o_ref_;
};

// Device copies of the backward tensors: q, k, v, o, d_o and the LSE as inputs, and the current
// contents of dq, dk, dv (poison them first).
class DeviceBackward {
 public:
  static absl::StatusOr<DeviceBackward> Upload(const AttentionTensors& t);
  // What a backward test starts from: O and the LSE of the CPU reference forward on t's inputs
  // (as a forward pass in the problem's dtype leaves them), dq, dk, dv poisoned (so that an
  // element never written shows), then all of it uploaded.
  static absl::StatusOr<DeviceBackward> UploadAfterForward(const AttentionProblem& p,
                                                           AttentionTensors& t);
  BackwardArgs args(void* stream = nullptr);
  // Waits for the device, then copies dq, dk, dv back into t.
  absl::Status Download(AttentionTensors& t) const;

 private:
  cuda::DeviceBuffer q_, k_, v_, o_, d_o_, lse_, dq_, dk_, dv_;
  BackwardArgs args_;
};

// An engine of `kind` with `options`; null (and a test failure) when it cannot be made.
std::unique_ptr<Engine> MustCreate(EngineKind kind, const EngineOptions& options = {});

}  // namespace attn::testing
