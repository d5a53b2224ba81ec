#include "cuda/fused/fused_support.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/fused/capabilities.h"

namespace attn::cuda {
namespace {

// CMake generated one instantiation file per row it read from the table; a row it missed
// would be a kernel without code.
static_assert(std::size(kFusedKernels) == ATTN_FUSED_GENERATED_ROWS,
              "kernels/cuda/fused/CMakeLists.txt did not read every row of kFusedKernels: keep "
              "one row a line");

// "float16 and bfloat16": the dtypes `pass` covers.
std::string CoveredDTypes(Pass pass) {
  std::vector<std::string> names;
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    if (HasFusedDType(pass, t)) names.emplace_back(DTypeName(t));
  }
  if (names.size() < 2) return absl::StrJoin(names, "");
  const std::string last = names.back();
  names.pop_back();
  return absl::StrCat(absl::StrJoin(names, ", "), " and ", last);
}

// "32, 64, 96, 128, 256": the head dims `pass` covers at `dtype`, in table order.
std::string CoveredHeadDims(Pass pass, DType dtype) {
  std::vector<int> dims;
  for (const FusedCapability& row : kFusedKernels) {
    if (row.pass == pass && row.dtype == dtype) dims.push_back(row.head_dim);
  }
  return absl::StrJoin(dims, ", ");
}

}  // namespace

Support FusedSupports(Pass pass, const AttentionProblem& p) {
  if (Support valid = ValidProblemSupport(p); !valid.ok()) return valid;
  const std::string what = pass == Pass::kForward    ? ""
                           : pass == Pass::kBackward ? "backward "
                                                     : "paged ";
  if (!HasFusedDType(pass, p.dtype)) {
    return Support(Refusal::kUnsupportedDtype,
                   absl::UnimplementedError(
                       absl::StrCat("cuda_fused: ", what, "dtype ", std::string(DTypeName(p.dtype)),
                                    " is not covered (", CoveredDTypes(pass), " are)")));
  }
  if (!HasFusedKernel(pass, p.dtype, p.head_dim)) {
    return Support(Refusal::kUnsupportedHeadDim,
                   absl::UnimplementedError(absl::StrCat("cuda_fused: ", what, "head_dim ",
                                                         p.head_dim, " is not covered (",
                                                         CoveredHeadDims(pass, p.dtype), " are)")));
  }
  if (pass == Pass::kBackward && (p.batch() > 65535 || p.num_kv_heads > 65535)) {
    return Support(
        Refusal::kTooLarge,
        absl::UnimplementedError("cuda_fused: backward needs batch and num_kv_heads <= 65535"));
  }
  if (pass == Pass::kPagedForward && (p.batch() > 65535 || p.num_heads > 65535)) {
    return Support(
        Refusal::kTooLarge,
        absl::UnimplementedError("cuda_fused: paged forward needs batch and num_heads <= 65535"));
  }
  return Support();
}

}  // namespace attn::cuda
