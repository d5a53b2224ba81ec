// A kernel that keeps the GPU busy for a while: queued before a timed call, it lets the host
// finish issuing that call before the GPU reaches it, so that CUDA events around the call time
// the GPU's work alone (what triton.testing.do_bench's cache flush does for the anchors).
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace attn::bench {

absl::Status SpinGpu(double microseconds, cudaStream_t stream);

}  // namespace attn::bench
