// Hopper warpgroup MMA (wgmma) for the sm_90a fused kernel: shared-memory matrix descriptors
// for 128-byte-swizzled tiles, the fences that order them, and the m64nNk16 (m64nNk32 for
// e4m3) instructions the kernels issue. Only compiled into sm_90a code (see ATTN_WGMMA_AVAILABLE).
//
// Inline asm cannot take arrays: the accumulator register lists are spelled out once per width
// (ATTN_WGMMA_ACC_*) and the wrappers are stamped out per shape and element type by two macros.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTN_WGMMA_AVAILABLE 1
#endif

namespace attn::cuda::wgmma {

// Tiles are stored as column blocks of 64 16-bit elements (128 bytes) per row, rows 128 bytes
// apart, the 16-byte chunks of each row XOR-swizzled by (row % 8): the canonical 128B-swizzle
// layout. A tile of R rows and D columns occupies D / 64 blocks of R * 128 bytes.
__host__ __device__ constexpr int SwizzledByteOffset(int row, int col, int rows) {
  const int block = col / 64;
  const int chunk = (col % 64) / 8;
  return block * rows * 128 + row * 128 + ((chunk ^ (row % 8)) * 16) + (col % 8) * 2;
}

// Matrix descriptor of a 128B-swizzled operand starting at shared address `smem`.
//   K-major operands (Q, K): 8-row groups are 1024 bytes apart (stride byte offset); the
//   leading byte offset is unused.
//   MN-major operands (V as B of P V): 64-column blocks are `leading_bytes` apart; 8-row
//   (8-key) groups 1024 bytes apart.
__host__ __device__ __forceinline__ uint64_t MakeDescriptor(uint32_t smem, uint32_t leading_bytes) {
  uint64_t desc = (smem & 0x3FFFFu) >> 4;
  desc |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFFu) << 16;
  desc |= static_cast<uint64_t>(1024u >> 4) << 32;
  desc |= uint64_t{1} << 62;  // 128-byte swizzle
  return desc;
}

// The descriptor of the operand `bytes` past the one `desc` describes (bytes a multiple of 16):
// its start address field (bits 0-13, the address / 16) advanced in the low word alone, which
// never carries into the leading byte offset above it since shared memory ends below 2^18
// bytes. It equals MakeDescriptor(smem + bytes, ...) at one 32-bit add, an immediate where
// `bytes` is a constant; building each k-step's descriptor afresh cost some eight instructions
// a wgmma (ptxas does not fold the address mask across the add).
__host__ __device__ __forceinline__ uint64_t DescriptorPlus(uint64_t desc, uint32_t bytes) {
  const uint32_t low = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | low;
}

__device__ __forceinline__ void Fence() {
#ifdef ATTN_WGMMA_AVAILABLE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void CommitGroup() {
#ifdef ATTN_WGMMA_AVAILABLE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void WaitGroup() {
#ifdef ATTN_WGMMA_AVAILABLE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Makes this thread's ordinary shared-memory writes (cp.async included) visible to the async
// proxy: to wgmma, and to the bulk copies that read shared memory.
__device__ __forceinline__ void FenceSharedForAsyncProxy() {
#ifdef ATTN_WGMMA_AVAILABLE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Pins accumulator registers in place around asynchronous MMAs: the compiler may neither move
// them to other registers nor reorder their reads and writes across this point while a queued
// wgmma still owns them.
template <int kCount>
__device__ __forceinline__ void FenceOperands(float (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// The head_dim 256 backward's score tiles: 64 keys x 32 queries a warpgroup (n32).
#define ATTN_WGMMA_ACC_REGS_16 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define ATTN_WGMMA_ACC_OPERANDS_16(d)                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15])
#define ATTN_WGMMA_ACC_REGS_32                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ATTN_WGMMA_ACC_OPERANDS_32(d)                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define ATTN_WGMMA_ACC_REGS_64                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"
#define ATTN_WGMMA_ACC_OPERANDS_64(d)                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// The widths of the warp-specialised kernel's score tiles (n176, n192).
#define ATTN_WGMMA_ACC_REGS_88                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "  \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"
#define ATTN_WGMMA_ACC_OPERANDS_88(d)                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),  \
      "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),  \
      "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),  \
      "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
#define ATTN_WGMMA_ACC_REGS_96                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "  \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "  \
  "%92, %93, %94, %95}"
#define ATTN_WGMMA_ACC_OPERANDS_96(d)                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),  \
      "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),  \
      "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),  \
      "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),  \
      "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])

// The warp-specialised kernel's widths at head_dim 256: S tiles of 80 keys (n80) and the
// 64 x 256 output accumulators (n256).
#define ATTN_WGMMA_ACC_REGS_40                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39}"
#define ATTN_WGMMA_ACC_OPERANDS_40(d)                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define ATTN_WGMMA_ACC_REGS_128                                                                    \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "    \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "     \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "     \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "     \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "     \
  "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, " \
  "%109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, "     \
  "%124, %125, %126, %127}"
#define ATTN_WGMMA_ACC_OPERANDS_128(d)                                                            \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),  \
      "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),  \
      "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),  \
      "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),  \
      "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]),  \
      "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),          \
      "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),         \
      "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),         \
      "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]),         \
      "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// D[64 x N] (+)= A[64 x 16] * B[N x 16]^T from shared memory; D is overwritten when
// `accumulate` is 0. Operands after the NACC accumulators: descriptors, then the flag. TRANS is
// the instruction's transpose pair: "0, 0" for A and B K-major (MmaSS_N), "1, 1" for both
// MN-major (MmaSSMnMajor_N: A's 64 rows contiguous, B's N columns contiguous, as the backward's
// dQ = dS K reads dS^T and K where they lie), "0, 1" for A K-major and B MN-major
// (MmaSSMnMajorB_N: the head_dim 256 backward's dV += P^T dO with P^T from shared memory).
#define ATTN_DEFINE_WGMMA_SS_NAMED(NAME, N, NACC, DESC_A, DESC_B, FLAG, ELEMENT, PTX, TRANS)      \
  __device__ __forceinline__ void NAME(float(&d)[NACC], uint64_t desc_a, uint64_t desc_b,         \
                                       int accumulate, ELEMENT) {                                 \
    ATTN_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" #FLAG                                     \
                   ", 0;\n"                                                                       \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX                  \
                   " " ATTN_WGMMA_ACC_REGS_##NACC ", %" #DESC_A ", %" #DESC_B ", p, 1, 1, " TRANS \
                                                  ";\n}\n"                                        \
                   : ATTN_WGMMA_ACC_OPERANDS_##NACC(d)                                            \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                  \
  }
#define ATTN_DEFINE_WGMMA_SS(N, NACC, DESC_A, DESC_B, FLAG, ELEMENT, PTX) \
  ATTN_DEFINE_WGMMA_SS_NAMED(MmaSS_##N, N, NACC, DESC_A, DESC_B, FLAG, ELEMENT, PTX, "0, 0")
#define ATTN_DEFINE_WGMMA_SS_MN_MAJOR(N, NACC, DESC_A, DESC_B, FLAG, ELEMENT, PTX) \
  ATTN_DEFINE_WGMMA_SS_NAMED(MmaSSMnMajor_##N, N, NACC, DESC_A, DESC_B, FLAG, ELEMENT, PTX, "1, 1")
#define ATTN_DEFINE_WGMMA_SS_MN_MAJOR_B(N, NACC, DESC_A, DESC_B, FLAG, ELEMENT, PTX) \
  ATTN_DEFINE_WGMMA_SS_NAMED(MmaSSMnMajorB_##N, N, NACC, DESC_A, DESC_B, FLAG, ELEMENT, PTX, "0, 1")

// D[64 x N] += A[64 x 16] * B[16 x N], A in registers (per warp, the mma.sync m16n8k16
// A-fragment layout of its 16 rows), B MN-major in shared memory.
#define ATTN_DEFINE_WGMMA_RS(N, NACC, A0, A1, A2, A3, DESC_B, FLAG, ELEMENT, PTX)          \
  __device__ __forceinline__ void MmaRS_##N(float(&d)[NACC], const uint32_t(&a)[4],        \
                                            uint64_t desc_b, ELEMENT) {                    \
    ATTN_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" #FLAG                              \
                   ", 0;\n"                                                                \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX           \
                   " " ATTN_WGMMA_ACC_REGS_##NACC ", {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 \
                                                  "}, %" #DESC_B ", p, 1, 1, 1;\n}\n"      \
                   : ATTN_WGMMA_ACC_OPERANDS_##NACC(d)                                     \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));     \
  }

// The FP8 forward's products (fp8_forward.cu): k32 steps of e4m3, both operands K-major (the
// instruction has no transpose for 8-bit types, so V arrives transposed), fp32 accumulators.
#define ATTN_DEFINE_WGMMA_SS_E4M3(N, NACC, DESC_A, DESC_B, FLAG)                                \
  __device__ __forceinline__ void MmaSS_##N(float(&d)[NACC], uint64_t desc_a, uint64_t desc_b,  \
                                            int accumulate, __nv_fp8_e4m3) {                    \
    ATTN_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" #FLAG                                   \
                   ", 0;\n"                                                                     \
                   "wgmma.mma_async.sync.aligned.m64n" #N                                       \
                   "k32.f32.e4m3.e4m3"                                                          \
                   " " ATTN_WGMMA_ACC_REGS_##NACC ", %" #DESC_A ", %" #DESC_B ", p, 1, 1;\n}\n" \
                   : ATTN_WGMMA_ACC_OPERANDS_##NACC(d)                                          \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                \
  }
// A from registers: per warp 16 rows x 32 bytes, register i holding four consecutive k of row
// lane / 4 (+ 8 for registers 1 and 3), k from 4 * (lane % 4) (+ 16 for registers 2 and 3).
#define ATTN_DEFINE_WGMMA_RS_E4M3(N, NACC, A0, A1, A2, A3, DESC_B, FLAG)                   \
  __device__ __forceinline__ void MmaRS_##N(float(&d)[NACC], const uint32_t(&a)[4],        \
                                            uint64_t desc_b, __nv_fp8_e4m3) {              \
    ATTN_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" #FLAG                              \
                   ", 0;\n"                                                                \
                   "wgmma.mma_async.sync.aligned.m64n" #N                                  \
                   "k32.f32.e4m3.e4m3"                                                     \
                   " " ATTN_WGMMA_ACC_REGS_##NACC ", {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 \
                                                  "}, %" #DESC_B ", p, 1, 1;\n}\n"         \
                   : ATTN_WGMMA_ACC_OPERANDS_##NACC(d)                                     \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));     \
  }

#ifdef ATTN_WGMMA_AVAILABLE
#define ATTN_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define ATTN_WGMMA_ASM(...) \
  do {                      \
  } while (0)
#endif

ATTN_DEFINE_WGMMA_SS(32, 16, 16, 17, 18, __half, "f16")
ATTN_DEFINE_WGMMA_SS(32, 16, 16, 17, 18, __nv_bfloat16, "bf16")
ATTN_DEFINE_WGMMA_SS(64, 32, 32, 33, 34, __half, "f16")
ATTN_DEFINE_WGMMA_SS(64, 32, 32, 33, 34, __nv_bfloat16, "bf16")
ATTN_DEFINE_WGMMA_SS(128, 64, 64, 65, 66, __half, "f16")
ATTN_DEFINE_WGMMA_SS(128, 64, 64, 65, 66, __nv_bfloat16, "bf16")
ATTN_DEFINE_WGMMA_SS(176, 88, 88, 89, 90, __half, "f16")
ATTN_DEFINE_WGMMA_SS(176, 88, 88, 89, 90, __nv_bfloat16, "bf16")
ATTN_DEFINE_WGMMA_SS(192, 96, 96, 97, 98, __half, "f16")
ATTN_DEFINE_WGMMA_SS(192, 96, 96, 97, 98, __nv_bfloat16, "bf16")
ATTN_DEFINE_WGMMA_SS(80, 40, 40, 41, 42, __half, "f16")
ATTN_DEFINE_WGMMA_SS(80, 40, 40, 41, 42, __nv_bfloat16, "bf16")
ATTN_DEFINE_WGMMA_RS(64, 32, 32, 33, 34, 35, 36, 37, __half, "f16")
ATTN_DEFINE_WGMMA_RS(64, 32, 32, 33, 34, 35, 36, 37, __nv_bfloat16, "bf16")
ATTN_DEFINE_WGMMA_RS(128, 64, 64, 65, 66, 67, 68, 69, __half, "f16")
ATTN_DEFINE_WGMMA_RS(128, 64, 64, 65, 66, 67, 68, 69, __nv_bfloat16, "bf16")
ATTN_DEFINE_WGMMA_RS(256, 128, 128, 129, 130, 131, 132, 133, __half, "f16")
ATTN_DEFINE_WGMMA_RS(256, 128, 128, 129, 130, 131, 132, 133, __nv_bfloat16, "bf16")

ATTN_DEFINE_WGMMA_SS_E4M3(128, 64, 64, 65, 66)
ATTN_DEFINE_WGMMA_RS_E4M3(128, 64, 64, 65, 66, 67, 68, 69)
ATTN_DEFINE_WGMMA_RS_E4M3(256, 128, 128, 129, 130, 131, 132, 133)

ATTN_DEFINE_WGMMA_SS_MN_MAJOR(64, 32, 32, 33, 34, __half, "f16")
ATTN_DEFINE_WGMMA_SS_MN_MAJOR(64, 32, 32, 33, 34, __nv_bfloat16, "bf16")
ATTN_DEFINE_WGMMA_SS_MN_MAJOR_B(128, 64, 64, 65, 66, __half, "f16")
ATTN_DEFINE_WGMMA_SS_MN_MAJOR_B(128, 64, 64, 65, 66, __nv_bfloat16, "bf16")

#undef ATTN_DEFINE_WGMMA_SS
#undef ATTN_DEFINE_WGMMA_RS
#undef ATTN_DEFINE_WGMMA_SS_MN_MAJOR
#undef ATTN_DEFINE_WGMMA_SS_MN_MAJOR_B
#undef ATTN_DEFINE_WGMMA_SS_NAMED
#undef ATTN_DEFINE_WGMMA_SS_E4M3
#undef ATTN_DEFINE_WGMMA_RS_E4M3
#undef ATTN_WGMMA_ASM

}  // namespace attn::cuda::wgmma
