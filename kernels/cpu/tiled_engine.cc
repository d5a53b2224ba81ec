// The CPU tiled engine: validation and dispatch; the passes live in tiled_forward.cc and
// tiled_backward.cc.
#include <memory>

#include "attn/status_macros.h"
#include "cpu/cpu_engines.h"
#include "cpu/host_engine.h"
#include "cpu/tiled_kernels.h"

namespace attn {
namespace cpu {

std::vector<RowBlock> SplitRows(const std::vector<int32_t>& cu_seqlens, int block) {
  std::vector<RowBlock> blocks;
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const int64_t len = cu_seqlens[b + 1] - cu_seqlens[b];
    for (int64_t r = 0; r < len; r += block) {
      blocks.push_back(
          {static_cast<int>(b), r, static_cast<int>(std::min<int64_t>(block, len - r))});
    }
  }
  return blocks;
}

}  // namespace cpu

namespace {

class CpuTiledEngine final : public cpu::HostEngine {
 public:
  explicit CpuTiledEngine(const EngineOptions& options) : HostEngine(options, "attn-cpu") {}

  EngineKind kind() const override { return EngineKind::kCpuTiled; }

  absl::Status Forward(const AttentionProblem& p, const ForwardArgs& a) override {
    ATTN_RETURN_IF_ERROR(ValidateForward(p, a));
    cpu::TiledForward(p, a, pool());
    return absl::OkStatus();
  }

  absl::Status Backward(const AttentionProblem& p, const BackwardArgs& a) override {
    ATTN_RETURN_IF_ERROR(ValidateBackward(p, a));
    cpu::TiledBackward(p, a, pool());
    return absl::OkStatus();
  }

  absl::Status ForwardPaged(const AttentionProblem& p, const PagedForwardArgs& a) override {
    ATTN_RETURN_IF_ERROR(ValidatePagedForward(p, a));
    cpu::TiledForwardPaged(p, a, pool());
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Engine> MakeCpuTiledEngine(const EngineOptions& options) {
  return std::make_unique<CpuTiledEngine>(options);
}

}  // namespace attn
