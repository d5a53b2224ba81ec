// A warp's rows of a warpgroup-MMA accumulator fragment, stored to device memory through a few
// rows of shared memory so that every store instruction writes whole rows in 16-byte pieces.
// Stored straight from the fragment, a quad of lanes writes 16 contiguous bytes of each of 8
// rows per instruction: twice the sectors and four times the instructions (docs/cuda-fused.md,
// "The epilogue through shared memory").
#pragma once

#include <cstdint>

#include "cuda/fused/ptx.cuh"

namespace attn::cuda {

// A warp's staging buffer: 8 rows of kRowBytes, each padded by 16 bytes so that the fragment's
// stores (8 rows, 4 lanes a row, 4 bytes a lane) fall in 32 distinct banks.
template <int kRowBytes>
inline constexpr int kStagedRowPitch = kRowBytes + 16;
template <int kRowBytes>
inline constexpr int kWarpStagingBytes = 8 * kStagedRowPitch<kRowBytes>;

// The calling consumer warp's buffer among `buffers` (warp_bytes each, one per consumer warp).
// In the Hopper kernels that use it the producer warpgroup's 4 warps come first and have none.
__device__ __forceinline__ uint32_t ConsumerWarpStaging(uint32_t buffers, int warp_bytes) {
  return buffers + (threadIdx.x / 32 - 4) * warp_bytes;
}

// One pass of 8 rows: rows `half` (0: the lane's quad_row, 1: quad_row + 8) of the warp's
// 16-row slice `fragment` (flattened [8-column tile][4], as an m64nN accumulator holds it),
// times `scale`, as 16-bit Output, columns [0, kColumns), to rows[r * row_stride] for the pass's
// rows r < valid_rows. `rows` and row_stride keep every row 16-byte aligned. The warp's lanes
// all call it.
template <typename Output, int kColumns, int kFragments>
__device__ __forceinline__ void StoreStagedRows(const float (&fragment)[kFragments], int half,
                                                float scale, uint32_t staging, Output* rows,
                                                int64_t row_stride, int valid_rows, int lane) {
  static_assert(sizeof(Output) == 2, "16-bit outputs, 8 to a 16-byte piece");
  static_assert(kColumns / 2 <= kFragments, "columns the fragment holds");
  constexpr int kRowBytes = kColumns * 2;
  constexpr int kPitch = kStagedRowPitch<kRowBytes>;
  constexpr int kPiecesPerRow = kRowBytes / 16;
  static_assert(8 * kPiecesPerRow % 32 == 0, "the warp's lanes share the pieces evenly");
  // Orders the warp's reads of the last pass before these writes.
  __syncwarp();
  const uint32_t staged_row = staging + (lane / 4) * kPitch + (lane % 4) * 4;
#pragma unroll
  for (int n = 0; n < kColumns / 8; ++n) {
    ptx::StoreShared32(staged_row + n * 16,
                       ptx::PackPair<Output>(fragment[n * 4 + 2 * half] * scale,
                                             fragment[n * 4 + 2 * half + 1] * scale));
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < 8 * kPiecesPerRow / 32; ++k) {
    const int piece = lane + 32 * k;
    const int r = piece / kPiecesPerRow;
    const int c = piece % kPiecesPerRow;
    if (r < valid_rows) {
      ptx::StoreGlobal128(rows + r * row_stride + c * 8,
                          ptx::LoadShared128(staging + r * kPitch + c * 16));
    }
  }
}

}  // namespace attn::cuda
