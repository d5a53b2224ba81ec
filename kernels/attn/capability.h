// The words kernel coverage is written in: a pass, and which (dtype, head_dim) a compiled kernel
// serves on which architectures. The fused kernels' table (cuda/fused/capabilities.h) is a list
// of FusedCapability rows; FusedCapabilities() in engine.h hands it to callers such as the
// server, which must not reach into cuda/.
#pragma once

#include <cstdint>
#include <string_view>

#include "attn/dtype.h"

namespace attn {

// kPagedForward: the forward over K/V in pages (attn/paged_kv.h).
enum class Pass : uint8_t { kForward, kBackward, kPagedForward };

constexpr std::string_view PassName(Pass pass) {
  return pass == Pass::kForward    ? "forward"
         : pass == Pass::kBackward ? "backward"
                                   : "paged forward";
}

// The instruction sets a row has kernels for, as bits of FusedCapability::archs.
struct FusedArch {
  // mma.sync: compiled for every target of the build; runs on sm_80 and later.
  static constexpr uint8_t kSm80 = 1 << 0;
  // Warpgroup MMA (wgmma) as well: Hopper only, used where the build holds sm_90a code.
  static constexpr uint8_t kSm90a = 1 << 1;
  // The warp-specialised Hopper kernel too (TMA loads, a producer warp, consumer warpgroups in
  // ping-pong): sm_90a as well. Which Hopper kernel a call runs by default is the heuristics'
  // choice per head_dim and mask (cuda/fused/heuristics.h).
  static constexpr uint8_t kSm90aTma = 1 << 2;
};

// One compiled (pass, dtype, head_dim) of the fused kernels.
struct FusedCapability {
  Pass pass;
  DType dtype;
  int head_dim;
  uint8_t archs;  // FusedArch bits
};

}  // namespace attn
