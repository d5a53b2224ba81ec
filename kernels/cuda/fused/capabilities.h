// What the fused kernels cover: the one table. Everything else that names a covered dtype,
// head_dim or architecture reads it:
//   - CMake generates one instantiation file per row (kernels/cuda/fused/CMakeLists.txt reads
//     the rows below as text: keep one row a line, in this form);
//   - DispatchFusedKernel turns a runtime (dtype, head_dim) into the row's compiled kernel;
//   - FusedSupports and its messages (fused_support.cc);
//   - FusedCapabilities() (attn/engine.h), which the server's GetServerInfo lists.
// Plain C++ without CUDA types, so that CPU-only builds answer FusedCapabilities() too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <utility>

#include "attn/capability.h"

namespace attn::cuda {

inline constexpr uint8_t kSm80 = FusedArch::kSm80;
inline constexpr uint8_t kSm90a = FusedArch::kSm90a;
inline constexpr uint8_t kSm90aTma = FusedArch::kSm90aTma;

// The lockstep wgmma kernels exist for head_dim 64 and 128 (FusedForwardSm90Traits): the
// forward's, and the paged forward's prefill (its decode kernel is mma.sync everywhere: it is
// bound by memory, paged_forward.h). The forward's and the paged forward's rows at 64, 96, 128
// and 256 hold the warp-specialised TMA kernel (kSm90aTma, FusedForwardSm90TmaTraits; over
// pages its prefill, with the paged source of paged_tma_source.cuh); at 96 and 256 it is the
// only Hopper kernel (no kSm90a). The backward's rows at 64, 96, 128 and 256 hold the Hopper
// backward (kSm90aTma: TMA and wgmma; FusedBackwardSm90Traits, 96 on the tiles of 128, and at
// 256 FusedBackwardSm90WideTraits); at 32 the backward has the portable kernel only, on Hopper
// too.
// clang-format off
inline constexpr FusedCapability kFusedKernels[] = {
    // pass               dtype         head_dim  archs
    {Pass::kForward,      DType::kF16,  32,       kSm80},
    {Pass::kForward,      DType::kF16,  64,       kSm80 | kSm90a | kSm90aTma},
    {Pass::kForward,      DType::kF16,  96,       kSm80 | kSm90aTma},
    {Pass::kForward,      DType::kF16,  128,      kSm80 | kSm90a | kSm90aTma},
    {Pass::kForward,      DType::kF16,  256,      kSm80 | kSm90aTma},
    {Pass::kForward,      DType::kBF16, 32,       kSm80},
    {Pass::kForward,      DType::kBF16, 64,       kSm80 | kSm90a | kSm90aTma},
    {Pass::kForward,      DType::kBF16, 96,       kSm80 | kSm90aTma},
    {Pass::kForward,      DType::kBF16, 128,      kSm80 | kSm90a | kSm90aTma},
    {Pass::kForward,      DType::kBF16, 256,      kSm80 | kSm90aTma},
    {Pass::kBackward,     DType::kF16,  32,       kSm80},
    {Pass::kBackward,     DType::kF16,  64,       kSm80 | kSm90aTma},
    {Pass::kBackward,     DType::kF16,  96,       kSm80 | kSm90aTma},
    {Pass::kBackward,     DType::kF16,  128,      kSm80 | kSm90aTma},
    {Pass::kBackward,     DType::kF16,  256,      kSm80 | kSm90aTma},
    {Pass::kBackward,     DType::kBF16, 32,       kSm80},
    {Pass::kBackward,     DType::kBF16, 64,       kSm80 | kSm90aTma},
    {Pass::kBackward,     DType::kBF16, 96,       kSm80 | kSm90aTma},
    {Pass::kBackward,     DType::kBF16, 128,      kSm80 | kSm90aTma},
    {Pass::kBackward,     DType::kBF16, 256,      kSm80 | kSm90aTma},
    {Pass::kPagedForward, DType::kF16,  32,       kSm80},
    {Pass::kPagedForward, DType::kF16,  64,       kSm80 | kSm90a | kSm90aTma},
    {Pass::kPagedForward, DType::kF16,  96,       kSm80 | kSm90aTma},
    {Pass::kPagedForward, DType::kF16,  128,      kSm80 | kSm90a | kSm90aTma},
    {Pass::kPagedForward, DType::kF16,  256,      kSm80 | kSm90aTma},
    {Pass::kPagedForward, DType::kBF16, 32,       kSm80},
    {Pass::kPagedForward, DType::kBF16, 64,       kSm80 | kSm90a | kSm90aTma},
    {Pass::kPagedForward, DType::kBF16, 96,       kSm80 | kSm90aTma},
    {Pass::kPagedForward, DType::kBF16, 128,      kSm80 | kSm90a | kSm90aTma},
    {Pass::kPagedForward, DType::kBF16, 256,      kSm80 | kSm90aTma},
};
// clang-format on

// The row of (pass, dtype, head_dim), or null when no kernel is compiled for it.
constexpr const FusedCapability* FindFusedKernel(Pass pass, DType dtype, int head_dim) {
  for (const FusedCapability& row : kFusedKernels) {
    if (row.pass == pass && row.dtype == dtype && row.head_dim == head_dim) return &row;
  }
  return nullptr;
}

// True when (pass, dtype, head_dim) has a kernel for `arch` (kSm80: the portable one).
constexpr bool HasFusedKernel(Pass pass, DType dtype, int head_dim, uint8_t arch = kSm80) {
  const FusedCapability* row = FindFusedKernel(pass, dtype, head_dim);
  return row != nullptr && (row->archs & arch) != 0;
}

// True when some head_dim of `pass` has a kernel at `dtype`.
constexpr bool HasFusedDType(Pass pass, DType dtype) {
  for (const FusedCapability& row : kFusedKernels) {
    if (row.pass == pass && row.dtype == dtype) return true;
  }
  return false;
}

namespace internal {

// Row kRow's launch, when the row is of kPass and matches (dtype, head_dim).
template <Pass kPass, size_t kRow, typename Result, typename Launch>
bool TryRow(DType dtype, int head_dim, Launch& launch, Result& result) {
  constexpr FusedCapability kEntry = kFusedKernels[kRow];
  if constexpr (kEntry.pass == kPass) {
    if (kEntry.dtype == dtype && kEntry.head_dim == head_dim) {
      result = launch.template operator()<kEntry.dtype, kEntry.head_dim>();
      return true;
    }
  }
  return false;
}

template <Pass kPass, typename Result, typename Launch, size_t... kRows>
Result DispatchRows(DType dtype, int head_dim, Result missing, Launch& launch,
                    std::index_sequence<kRows...>) {
  Result result = missing;
  (TryRow<kPass, kRows>(dtype, head_dim, launch, result) || ...);
  return result;
}

}  // namespace internal

// The one switch from runtime shape to template arguments: calls
// `launch.template operator()<dtype, head_dim>()` for the row of kPass matching (dtype,
// head_dim) and returns its result, or `missing` when no row matches. Each row's call is
// instantiated, so every row's kernel must be defined (its generated instantiation file).
template <Pass kPass, typename Result, typename Launch>
Result DispatchFusedKernel(DType dtype, int head_dim, Result missing, Launch&& launch) {
  return internal::DispatchRows<kPass>(dtype, head_dim, missing, launch,
                                       std::make_index_sequence<std::size(kFusedKernels)>{});
}

}  // namespace attn::cuda
