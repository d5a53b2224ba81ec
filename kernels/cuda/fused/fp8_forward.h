// The FP8 (e4m3) forward on Hopper: the warp-specialised kernel of
// fused_forward_sm90_tma_kernel.cuh over Q, K and V stored as e4m3 bytes with one scale each,
// both products on e4m3 tensor cores (twice bf16's rate), P rounded to e4m3 for P V, O in bf16.
//
// It is never chosen for a caller: no engine, heuristic or kAuto runs it. Its error is that of
// e4m3's 3-bit mantissa on every input and on P (docs/cuda-fused.md, "The FP8 forward", reports
// it against the bf16 kernel). Dense batches at head_dim 128 and 256, any mask, GQA and MQA;
// sm_90a builds on Hopper only. Host-only header.
//
// A caller either quantizes the tensors itself (layouts below) and calls LaunchFp8Forward, or
// hands a 16-bit forward's tensors to PrepareFp8Forward, which quantizes them on the device.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "cuda/fused/fused_forward.h"

// The layout functions below serve the host and the quantizing kernels alike.
#if defined(__CUDACC__)
#define ATTN_FP8_LAYOUT_FN __host__ __device__ constexpr
#else
#define ATTN_FP8_LAYOUT_FN constexpr
#endif

namespace attn::cuda {

// e4m3's largest finite value: PrepareFp8Forward stores real / descale with descale = amax /
// kE4m3Max, amax the tensor's largest magnitude.
inline constexpr float kE4m3Max = 448.f;

// V is stored transposed, as [batch][num_kv_heads][head_dim][Fp8ValueRowKeys(seqlen_k)]: e4m3
// tensor cores read both operands K-major, and the keys are P V's k. Within each group of 16 keys
// the slots are permuted: slot c of group g holds key 16 g + Fp8ValueSlotKey(c), the order in which
// the kernel's P fragments hold their keys (PackProbabilities), so that P needs no shuffle.
// Slots of keys at or past seqlen_k hold zeros.
ATTN_FP8_LAYOUT_FN int Fp8ValueSlotKey(int slot) {
  return 8 * ((slot % 4) / 2) + 2 * (slot / 4) + slot % 2;
}

// Slots of one row of the transposed V: seqlen_k rounded up to whole groups of 16, at least one.
ATTN_FP8_LAYOUT_FN int64_t Fp8ValueRowKeys(int64_t seqlen_k) {
  return seqlen_k <= 0 ? 16 : (seqlen_k + 15) / 16 * 16;
}

struct Fp8ForwardParams {
  // As for the 16-bit forward, except:
  //   q: e4m3, [batch * seqlen_q, num_heads, head_dim] under q_token_stride and q_head_stride
  //      (elements, which are bytes); k: e4m3 likewise with num_kv_heads;
  //   v: the transposed V above (v's strides unread);
  //   o: bfloat16 whatever the dtype; dtype, kernel and block_n unread;
  //   cu_seqlens_q and cu_seqlens_k must be null (dense batches); head_dim 128 or 256;
  //   tile_counters and persistent_ctas as the TMA kernel's (required, and optional).
  FusedForwardParams p;
  // Three device floats: the descales of Q, K and V (real value = stored value x descale).
  const float* descale = nullptr;
};

// Checks the layout rules above (INVALID_ARGUMENT or UNIMPLEMENTED naming the field) and
// launches; UNIMPLEMENTED where no sm_90a code runs (not a Hopper GPU, or a build without 90a).
absl::Status LaunchFp8Forward(const Fp8ForwardParams& params, void* stream);

// Device bytes PrepareFp8Forward needs for the 16-bit forward `p`.
int64_t Fp8ForwardWorkspaceBytes(const FusedForwardParams& p);

// Quantizes the 16-bit forward `p`'s Q, K and V (fp16 or bf16, dense, head_dim 128 or 256) into
// `workspace` as e4m3, one scale per tensor from its largest magnitude (found on the device),
// V transposed; fills `out` with `p` pointing at them (O and the LSE as given, O read as bf16).
// Asynchronous on `stream`; the workspace must outlive the forward that reads it.
absl::Status PrepareFp8Forward(const FusedForwardParams& p, void* workspace,
                               int64_t workspace_bytes, Fp8ForwardParams* out, void* stream);

}  // namespace attn::cuda
