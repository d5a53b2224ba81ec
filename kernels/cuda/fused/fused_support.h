// Which problems the fused kernels run (the table of capabilities.h, plus the launch limits a
// Supports answer can know without tensors), with the reason when they do not.
#pragma once

#include "attn/capability.h"
#include "attn/engine.h"
#include "attn/problem.h"

namespace attn::cuda {

// Yes when `pass` of the fused engine runs this problem. Refusals: kInvalidProblem,
// kUnsupportedDtype and kUnsupportedHeadDim (UNIMPLEMENTED, naming what the table covers), and
// kTooLarge beyond the grid: batch or num_kv_heads over 65535 for the backward, batch or
// num_heads for the paged forward.
Support FusedSupports(Pass pass, const AttentionProblem& p);

}  // namespace attn::cuda
