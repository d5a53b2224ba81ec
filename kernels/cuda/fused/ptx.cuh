// Thin wrappers over the PTX the fused kernel is built from: asynchronous global->shared copies,
// ldmatrix fragment loads, the m16n8k16 tensor-core MMA, and the fast base-2 exponential.
// Everything here exists on sm_80 and later.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attn::cuda::ptx {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy; when `valid` is false the destination is zero-filled and the
// source is not read (src_size = 0), which is how tiles past the end of a sequence are padded.
__device__ __forceinline__ void CopyAsync16(uint32_t dst_smem, const void* src, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_smem), "l"(src),
               "r"(src_size));
}

// 4-byte asynchronous copy through L1 (.ca: the only cache mode that takes sizes under 16),
// zero-filled when `valid` is false.
__device__ __forceinline__ void CopyAsync4(uint32_t dst_smem, const void* src, bool valid) {
  const int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst_smem), "l"(src),
               "r"(src_size));
}

__device__ __forceinline__ void CommitAsyncGroup() { asm volatile("cp.async.commit_group;\n"); }

template <int kPendingGroups>
__device__ __forceinline__ void WaitAsyncGroups() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPendingGroups));
}

// Plain shared-memory accesses by 32-bit shared-window address (the Hopper kernels keep their
// buffers that way; a generic pointer would take two registers).
__device__ __forceinline__ void StoreShared32(uint32_t smem, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem), "r"(value) : "memory");
}
__device__ __forceinline__ uint4 LoadShared128(uint32_t smem) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem)
               : "memory");
  return v;
}

// One 16-byte store to device memory; `address` must be 16-byte aligned. Written out because
// nvcc splits a plain `*reinterpret_cast<uint4*>(p) = v` of a vector built from registers into
// four 4-byte stores (`st.global.u32`), each of which fills 8 of a sector's 32 bytes across a
// warp: four times the store instructions and sectors (Nsight Compute's excessive global
// sectors on the staged epilogues).
__device__ __forceinline__ void StoreGlobal128(void* address, uint4 v) {
  asm volatile(
      "st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(__cvta_generic_to_global(address)),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
      : "memory");
}

// Four 8x8 b16 matrices; lane i supplies the row address of matrix i / 8.
__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}

__device__ __forceinline__ void LoadMatrixX4Transposed(uint32_t (&r)[4], uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}

// D = A * B + D for a 16x8x16 tile, fp32 accumulators. A row-major (4 regs), B column-major
// (2 regs), C/D 4 floats.
template <typename Element>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);

template <>
__device__ __forceinline__ void Mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Packs two floats into one register of two 16-bit elements (round to nearest even).
template <typename Element>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Packs four floats into one register of four e4m3 bytes, `b0` in the lowest (round to nearest
// even, saturating to +-448). sm_89 and later.
__device__ __forceinline__ uint32_t PackE4m3Quad(float b0, float b1, float b2, float b3) {
  uint32_t packed = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(packed)
      : "f"(b0), "f"(b1), "f"(b2), "f"(b3));
#endif
  return packed;
}

// 2^x through the SFU: ex2(-inf) = 0, NaN stays NaN.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace attn::cuda::ptx
