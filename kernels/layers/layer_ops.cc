// What every LayerOps shares (Buffer, the GEMM shape check) and the factory.
#include "layers/layer_ops.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "layers/layer_ops_internal.h"

namespace attn::layers {

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = other.data_;
    bytes_ = other.bytes_;
    release_ = std::move(other.release_);
    other.data_ = nullptr;
    other.bytes_ = 0;
    other.release_ = nullptr;
  }
  return *this;
}

void Buffer::Reset() {
  if (data_ != nullptr && release_) release_(data_);
  data_ = nullptr;
  bytes_ = 0;
}

absl::Status ValidateGemm(bool transpose_a, bool transpose_b, ConstMatrix a, ConstMatrix b,
                          float beta, Matrix c) {
  const int64_t m = transpose_a ? a.cols : a.rows, ka = transpose_a ? a.rows : a.cols;
  const int64_t kb = transpose_b ? b.cols : b.rows, n = transpose_b ? b.rows : b.cols;
  if (m != c.rows || n != c.cols || ka != kb) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: op(a) is [", m, ", ", ka, "], op(b) [",
                                                   kb, ", ", n, "], c [", c.rows, ", ", c.cols,
                                                   "]"));
  }
  if (a.dtype != b.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: a is ", std::string(DTypeName(a.dtype)),
                                                   ", b ", std::string(DTypeName(b.dtype))));
  }
  if (c.dtype != DType::kF32 && (c.dtype != a.dtype || beta != 0.f)) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: c is ", std::string(DTypeName(c.dtype)),
                                                   " (float32, or a's dtype with beta = 0)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LayerOps>> CreateLayerOps(MemorySpace space,
                                                         const LayerOpsOptions& options) {
  if (space == MemorySpace::kHost) return CreateCpuLayerOps(options);
#if defined(ATTN_HAVE_CUDA)
  return CreateCudaLayerOps(options);
#else
  return absl::UnavailableError("layer ops: this build has no CUDA support");
#endif
}

}  // namespace attn::layers
