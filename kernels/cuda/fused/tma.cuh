// Hopper's asynchronous machinery for the warp-specialised kernel: shared-memory mbarriers
// (arrival counts plus transaction bytes), bulk tensor copies (TMA) that complete on them,
// named barriers between warpgroups, and the register reallocation between warpgroup roles.
// Everything emits code only where ATTN_WGMMA_AVAILABLE (wgmma.cuh): sm_90a.
#pragma once

#include <cstdint>

#include "cuda/fused/wgmma.cuh"

#ifdef ATTN_WGMMA_AVAILABLE
#define ATTN_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define ATTN_SM90_ASM(...) \
  do {                     \
  } while (0)
#endif

namespace attn::cuda::tma {

// ---- mbarrier: a 64-bit shared-memory word; phases complete when the expected arrivals and
// transaction bytes are in, and waiters test a phase by its parity.

__device__ __forceinline__ void InitBarrier(uint32_t bar, uint32_t arrivals) {
  ATTN_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}

// Makes the initialised barriers visible to the async proxy (the copy engine) before use.
__device__ __forceinline__ void FenceBarrierInit() {
  ATTN_SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of copies that will complete on this phase.
__device__ __forceinline__ void ArriveExpectBytes(uint32_t bar, uint32_t bytes) {
  ATTN_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                : "memory");
}

// Announces `bytes` of copies that will complete on the current phase, without arriving: for a
// phase whose one arrival must wait for other writes (the paged source's tail rows).
__device__ __forceinline__ void ExpectBytes(uint32_t bar, uint32_t bytes) {
  ATTN_SM90_ASM("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
                : "memory");
}

__device__ __forceinline__ void Arrive(uint32_t bar) {
  ATTN_SM90_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Blocks until the phase of parity `parity` has completed. A fresh barrier counts its
// (nonexistent) previous phase, parity 1, as complete: producers start waiting on parity 1.
__device__ __forceinline__ void Wait(uint32_t bar, uint32_t parity) {
  ATTN_SM90_ASM(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// ---- Bulk tensor copies. The tensor map is a __grid_constant__ kernel parameter; its generic
// address names it.

__device__ __forceinline__ void PrefetchTensorMap(const void* map) {
  ATTN_SM90_ASM("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Copies the box at coordinates (c0, c1, c2, c3) of a 4-D tensor map into shared memory at
// `dst`; its bytes complete on barrier `bar`. Box elements outside the tensor arrive as zeros.
__device__ __forceinline__ void Load4d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1,
                                       int c2, int c3) {
  ATTN_SM90_ASM(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// Stores the box at `src` (laid out as Load4d of the same map fills it) into the 4-D tensor
// map's box at (c0, c1, c2, c3); elements outside the tensor are dropped. A bulk group of the
// calling thread, as the reductions below (BulkCommit, BulkWaitRead, BulkWait).
__device__ __forceinline__ void Store4d(const void* map, uint32_t src, int c0, int c1, int c2,
                                        int c3) {
  ATTN_SM90_ASM(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Copies `bytes` (a multiple of 16) from shared memory at `src` to device memory at `dst`, both
// 16-byte aligned; a bulk group of the calling thread, as Store4d.
__device__ __forceinline__ void StoreBulk(void* dst, uint32_t src, uint32_t bytes) {
  ATTN_SM90_ASM("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(
                    reinterpret_cast<uint64_t>(dst)),
                "r"(src), "r"(bytes)
                : "memory");
}

// ---- Bulk reductions: shared memory added into global memory by the copy engine, float32
// element by element (not atomic as a whole, each element added atomically). Groups are per
// thread: Commit closes the thread's copies issued since its last Commit.

// Adds the box at `src` (laid out as Load4d of the same map stores it) into the 4-D tensor map's
// box at (c0, c1, c2, c3), element by element (float32 add); elements outside the tensor are
// dropped.
__device__ __forceinline__ void ReduceAdd4d(const void* map, uint32_t src, int c0, int c1, int c2,
                                            int c3) {
  ATTN_SM90_ASM(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void BulkCommit() {
  ATTN_SM90_ASM("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Until this thread's bulk groups have read their shared-memory sources (it may be rewritten).
__device__ __forceinline__ void BulkWaitRead() {
  ATTN_SM90_ASM("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Until this thread's bulk groups are complete, their writes performed.
__device__ __forceinline__ void BulkWait() {
  ATTN_SM90_ASM("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// Orders the async proxy's completed global writes before this thread's later generic accesses.
__device__ __forceinline__ void FenceGlobalAfterBulk() {
  ATTN_SM90_ASM("fence.proxy.async.global;\n" ::: "memory");
}

// ---- Named barriers (ids 1-15; 0 is __syncthreads). `threads` counts every participant, those
// that Sync and those that only Arrive.

__device__ __forceinline__ void NamedBarrierSync(uint32_t id, uint32_t threads) {
  ATTN_SM90_ASM("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void NamedBarrierArrive(uint32_t id, uint32_t threads) {
  ATTN_SM90_ASM("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- Register reallocation between warpgroups (every warp of the warpgroup executes it).

template <int kRegisters>
__device__ __forceinline__ void ReleaseRegisters() {
  ATTN_SM90_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void ClaimRegisters() {
  ATTN_SM90_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace attn::cuda::tma

#undef ATTN_SM90_ASM
