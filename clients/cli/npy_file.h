// Reads and writes NumPy .npy files (format 1.0/2.0, little-endian, C order) as attnserve
// Tensors: '<f4' is float32 and '<f2' float16. bfloat16 has no NumPy type; it travels as '<u2'
// holding the bit patterns (numpy: `a.view(np.uint16)`), read back with --npy_u2_is_bf16.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve::client {

absl::StatusOr<v1::Tensor> ReadNpy(const std::string& path, bool u2_is_bf16 = true);
absl::Status WriteNpy(const std::string& path, const v1::Tensor& tensor);

}  // namespace attnserve::client
