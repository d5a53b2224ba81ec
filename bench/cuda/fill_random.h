// Fills device buffers with pseudo-random normal values in a storage dtype (benchmark inputs:
// never zeros, which run faster than real data).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "attn/dtype.h"

namespace attn::bench {

absl::Status FillRandomNormal(void* data, int64_t elements, DType dtype, uint64_t seed,
                              cudaStream_t stream);

}  // namespace attn::bench
