// The named problems every engine test iterates (CPU and CUDA suites alike).
//
// Not the full cross product, but a covering set: each of the lengths 1, 17, 177 and 1013, query
// length above and below key length, causal and not, sliding windows, GQA ratios 1, 2 and 8,
// head dims 32, 64, 80, 96, 128 and 256, dense and variable-length batches (with empty
// sequences), padded strides, a custom softmax scale, and each dtype, appear in several cases.
// Sizes are chosen so the float64 reference runs the whole sweep, forward and backward, in
// seconds on two cores.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "attn/problem.h"

namespace attn::testing {

struct SweepCase {
  std::string name;  // a valid GoogleTest parameter name: [A-Za-z0-9_]
  AttentionProblem problem;
  bool padded = false;  // run with padded (non-packed) strides, see HostTensor
};

std::vector<SweepCase> StandardSweep();

// GoogleTest prints parameters with this (instead of a byte dump).
void PrintTo(const SweepCase& c, std::ostream* os);

}  // namespace attn::testing
