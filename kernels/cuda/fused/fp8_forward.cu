// The FP8 forward (fp8_forward.h): its K/V source for the warp-specialised kernel, the launch,
// and the quantization of 16-bit tensors to its layouts.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "cuda/common/alignment.h"
#include "cuda/common/element_convert.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/fused/fp8_forward.h"
#include "cuda/fused/fused_forward_sm90_tma_kernel.cuh"
#include "cuda/fused/heuristics.h"
#include "cuda/fused/query_schedule.cuh"
#include "cuda/fused/sm90a_usable.cuh"
#include "cuda/fused/tensor_map.h"

namespace attn::cuda {

// The kernel, its source and its parameters: in a named namespace, as the 16-bit kernel's (their
// members are then read only by the kernel body, which sm_80 code compiles out).
namespace fp8_forward {

template <int kHeadDim>
using Fp8Traits =
    FusedForwardSm90TmaTraits<__nv_fp8_e4m3, kHeadDim, Sm90TmaFp8TileShape(kHeadDim).block_n,
                              Sm90TmaFp8TileShape(kHeadDim).stages,
                              Sm90TmaFp8TileShape(kHeadDim).consumer_warpgroups>;

// The kernel's parameters: the 16-bit kernel's, whose v_map is the transposed V's, and the
// descales.
struct Fp8ForwardTmaParams : FusedForwardTmaParams {
  const float* descale;
};

// The dense source over e4m3 tiles: a K tile is a 128-byte box of kBlockN keys per column block,
// a V tile one box of the transposed V, head_dim rows (V's columns) of kBlockN key slots. Its K
// copies are the 16-bit DenseKvTiles' without the variable-length row offset: deriving from that
// source keeps the offset's select in the producer, whose 24 registers at head_dim 256 then
// spill 84 bytes instead of 76.
template <typename Traits>
struct Fp8DenseKvTiles {
  using Params = Fp8ForwardTmaParams;
  static constexpr int kProducerThreads = 1;

  const Params& params;
  sm90_tma::QueryTileAt q;
  int kv_head;

  __device__ __forceinline__ Fp8DenseKvTiles(const Params& params,
                                             const QueryBlock<Traits::kBlockM>& block)
      : params(params),
        q(sm90_tma::QueryTileOf(params.p, block)),
        kv_head(block.kv_head(params.p)) {}

  __device__ __forceinline__ static const float* Descales(const Params& params) {
    return params.descale;
  }
  __device__ __forceinline__ void LoadKeys(uint32_t tile, uint32_t full, int key0) const {
    tma::ArriveExpectBytes(full, Traits::kKVTileBytes);
#pragma unroll
    for (int cb = 0; cb < Traits::kColumnBlocks; ++cb) {
      tma::Load4d(tile + cb * Traits::kBlockN * 128, &params.k_map, full,
                  cb * Traits::kBlockColumns, key0, kv_head, q.sequence);
    }
  }
  __device__ __forceinline__ void LoadValues(uint32_t tile, uint32_t full, int key0) const {
    tma::ArriveExpectBytes(full, Traits::kKVTileBytes);
    tma::Load4d(tile, &params.v_map, full, key0, 0, kv_head, q.sequence);
  }
};

template <int kHeadDim>
constexpr auto kFp8Kernel =
    &FusedForwardSm90TmaKernel<Fp8Traits<kHeadDim>, Fp8DenseKvTiles<Fp8Traits<kHeadDim>>>;

}  // namespace fp8_forward

namespace {

using fp8_forward::Fp8ForwardTmaParams;
using fp8_forward::Fp8Traits;
using fp8_forward::kFp8Kernel;

// ---- Quantization ----

// 16-byte chunks of a [tokens, heads, head_dim] 16-bit tensor: eight elements each.
struct RowsView {
  const void* data;
  int64_t tokens;
  int heads, head_dim;
  int64_t token_stride, head_stride;  // elements
  __host__ __device__ int64_t chunks() const { return tokens * heads * (head_dim / 8); }
  __device__ const uint4* chunk(int64_t i) const {
    const int64_t row = i / (head_dim / 8);
    const int64_t token = row / heads;
    const int head = static_cast<int>(row % heads);
    const int column = static_cast<int>(i % (head_dim / 8)) * 8;
    return reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(data) +
                                          token * token_stride + head * head_stride + column);
  }
};

template <typename Element>
__device__ __forceinline__ void Unpack8(const uint4& chunk, float (&x)[8]) {
  const Element* e = reinterpret_cast<const Element*>(&chunk);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = ToFloat(e[i]);
}

__device__ __forceinline__ uint16_t ToE4m3Pair(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// amax[0] = max(amax[0], the largest magnitude of the view), as float bits (non-negative floats
// order as their bits). NaNs are passed over.
template <typename Element>
__global__ void AbsMaxKernel(RowsView view, unsigned* amax) {
  float m = 0.f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < view.chunks();
       i += int64_t{gridDim.x} * blockDim.x) {
    float x[8];
    Unpack8<Element>(*view.chunk(i), x);
#pragma unroll
    for (int e = 0; e < 8; ++e) m = fmaxf(m, fabsf(x[e]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  }
  if (threadIdx.x % 32 == 0 && m > 0.f) atomicMax(amax, __float_as_uint(m));
}

// descale[i] = amax[i] / kE4m3Max (1 for a tensor of zeros), for Q, K and V.
__global__ void DescaleKernel(const unsigned* amax, float* descale) {
  const int i = threadIdx.x;
  if (i < 3) {
    const float m = __uint_as_float(amax[i]);
    descale[i] = m > 0.f ? m / kE4m3Max : 1.f;
  }
}

// Q or K to packed e4m3 [tokens, heads, head_dim]: stored = real / descale.
template <typename Element>
__global__ void QuantizeRowsKernel(RowsView view, const float* descale, uint2* out) {
  const float inverse = 1.f / *descale;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < view.chunks();
       i += int64_t{gridDim.x} * blockDim.x) {
    float x[8];
    Unpack8<Element>(*view.chunk(i), x);
    uint32_t word[2];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const uint32_t lo = ToE4m3Pair(x[4 * w] * inverse, x[4 * w + 1] * inverse);
      const uint32_t hi = ToE4m3Pair(x[4 * w + 2] * inverse, x[4 * w + 3] * inverse);
      word[w] = lo | (hi << 16);
    }
    out[i] = make_uint2(word[0], word[1]);
  }
}

// V [batch * seqlen_k, kv_heads, head_dim] to the transposed, slot-permuted layout of
// fp8_forward.h: a thread writes one group of 16 slots of one row (a column of V); the 32 threads
// of a warp take 32 neighbouring columns, so each key's read is 64 contiguous bytes.
struct TransposedValues {
  int batch, kv_heads, head_dim;
  int64_t seqlen_k, row_keys;
  __host__ __device__ int64_t groups() const {
    return int64_t{batch} * kv_heads * (row_keys / 16) * head_dim;
  }
};

template <typename Element>
__global__ void TransposeValuesKernel(RowsView v, TransposedValues t, const float* descale,
                                      uint4* out) {
  const float inverse = 1.f / *descale;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < t.groups();
       i += int64_t{gridDim.x} * blockDim.x) {
    const int column = static_cast<int>(i % t.head_dim);
    const int64_t group = (i / t.head_dim) % (t.row_keys / 16);
    const int64_t head_row = i / t.head_dim / (t.row_keys / 16);  // sequence * kv_heads + head
    const int head = static_cast<int>(head_row % t.kv_heads);
    const int64_t sequence = head_row / t.kv_heads;
    const Element* base = static_cast<const Element*>(v.data) +
                          sequence * t.seqlen_k * v.token_stride + head * v.head_stride + column;
    float x[16];
#pragma unroll
    for (int slot = 0; slot < 16; ++slot) {
      const int64_t key = group * 16 + Fp8ValueSlotKey(slot);
      x[slot] = key < t.seqlen_k ? ToFloat(base[key * v.token_stride]) * inverse : 0.f;
    }
    uint32_t word[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      word[w] = ToE4m3Pair(x[4 * w], x[4 * w + 1]) |
                (static_cast<uint32_t>(ToE4m3Pair(x[4 * w + 2], x[4 * w + 3])) << 16);
    }
    out[(head_row * t.head_dim + column) * (t.row_keys / 16) + group] =
        make_uint4(word[0], word[1], word[2], word[3]);
  }
}

// Grid of a grid-stride kernel over `items`: enough CTAs of 256 threads to fill the device a few
// times, no more.
unsigned GridFor(int64_t items) {
  constexpr int64_t kThreads = 256;
  constexpr int64_t kMaxCtas = 132 * 8;
  return static_cast<unsigned>(std::clamp<int64_t>((items + kThreads - 1) / kThreads, 1, kMaxCtas));
}

// The workspace's pieces, each 256-byte aligned: amax (3 unsigned), descale (3 floats), Q, K,
// the transposed V.
struct Fp8Workspace {
  int64_t q_bytes, k_bytes, v_bytes;
  static constexpr int64_t kScaleBytes = 256;
  static int64_t Round(int64_t bytes) { return (bytes + 255) / 256 * 256; }
  static Fp8Workspace Of(const FusedForwardParams& p) {
    const int64_t q_tokens = int64_t{p.batch} * p.seqlen_q;
    const int64_t k_tokens = int64_t{p.batch} * p.seqlen_k;
    return {Round(q_tokens * p.num_heads * p.head_dim),
            Round(k_tokens * p.num_kv_heads * p.head_dim),
            Round(int64_t{p.batch} * p.num_kv_heads * p.head_dim * Fp8ValueRowKeys(p.seqlen_k))};
  }
  int64_t total() const { return kScaleBytes + q_bytes + k_bytes + v_bytes; }
};

absl::Status CheckRows(const char* name, const void* data, int64_t token_stride,
                       int64_t head_stride, int64_t element_bytes) {
  if (!RowsAligned16(data, token_stride, head_stride, element_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_fp8: ", name, " must be 16-byte aligned with strides of whole 16 bytes (strides ",
        token_stride, ", ", head_stride, " elements)"));
  }
  return absl::OkStatus();
}

absl::Status CheckShape(const FusedForwardParams& p) {
  if (p.head_dim != 128 && p.head_dim != 256) {
    return absl::UnimplementedError(
        absl::StrCat("cuda_fp8: head_dim must be 128 or 256 (got ", p.head_dim, ")"));
  }
  if (p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr) {
    return absl::UnimplementedError("cuda_fp8: variable-length batches are not supported");
  }
  if (p.num_kv_heads <= 0 || p.num_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        "cuda_fp8: num_heads must be a positive multiple of num_kv_heads");
  }
  if (p.batch < 0 || p.batch > 65535 || p.num_heads > 65535) {
    return absl::InvalidArgumentError("cuda_fp8: batch and num_heads must be in [0, 65535]");
  }
  if (p.seqlen_q < 0 || p.seqlen_k < 0 || p.seqlen_q > (int64_t{1} << 30) ||
      p.seqlen_k > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError("cuda_fp8: seqlen_q and seqlen_k must be in [0, 2^30]");
  }
  if (p.max_seqlen_q != p.seqlen_q) {
    return absl::InvalidArgumentError("cuda_fp8: a dense batch has max_seqlen_q = seqlen_q");
  }
  return absl::OkStatus();
}

absl::Status LaunchError(cudaError_t err, const char* what) {
  if (err == cudaErrorNotSupported) {
    return absl::UnimplementedError(
        absl::StrCat("cuda_fp8: ", what, " cannot run on this device or build"));
  }
  return absl::InternalError(absl::StrCat("cuda_fp8: ", what, ": ", cudaGetErrorString(err)));
}

// The kernel at head_dim kHeadDim, after LaunchFp8Forward's checks.
template <int kHeadDim>
absl::Status LaunchFp8ForwardAt(const Fp8ForwardParams& params, cudaStream_t stream) {
  using Traits = Fp8Traits<kHeadDim>;
  const FusedForwardParams& p = params.p;
  if (!Sm90aKernelUsable<kFp8Kernel<kHeadDim>>()) {
    return absl::UnimplementedError("cuda_fp8: needs a Hopper GPU and a build with sm_90a code");
  }
  if (QueryBlocksOf<Traits::kBlockM>(p) >= (int64_t{1} << 31)) {
    return absl::UnimplementedError("cuda_fp8: 2^31 query blocks or more");
  }
  Fp8ForwardTmaParams launch;
  launch.p = p;
  launch.descale = params.descale;
  TokenTensorView q = BatchTensorView(p, p.q, kHeadDim, p.seqlen_q, p.total_q, p.num_heads,
                                      p.q_token_stride, p.q_head_stride);
  TokenTensorView k = BatchTensorView(p, p.k, kHeadDim, p.seqlen_k, p.total_k, p.num_kv_heads,
                                      p.k_token_stride, p.k_head_stride);
  q.e4m3 = k.e4m3 = true;
  // The transposed V in the map's (columns, rows, heads, sequences) terms: key slots, V's
  // columns, KV heads, sequences.
  const int64_t row_keys = Fp8ValueRowKeys(p.seqlen_k);
  TokenTensorView v;
  v.data = p.v;
  v.e4m3 = true;
  v.head_dim = static_cast<int>(row_keys);
  v.rows = kHeadDim;
  v.heads = p.num_kv_heads;
  v.sequences = p.batch;
  v.token_stride = row_keys;
  v.head_stride = kHeadDim * row_keys;
  v.sequence_stride = p.num_kv_heads * kHeadDim * row_keys;
  cudaError_t err = EncodeTokenTensorMap(q, Traits::kBlockM, &launch.q_map);
  if (err == cudaSuccess) err = EncodeTokenTensorMap(k, Traits::kBlockN, &launch.k_map);
  if (err == cudaSuccess) err = EncodeTokenTensorMap(v, kHeadDim, &launch.v_map);
  if (err != cudaSuccess) return LaunchError(err, "the tensor maps of q, k and v");
  unsigned ctas = 0;
  err = PersistentCtas(QueryBlocksOf<Traits::kBlockM>(p), p.persistent_ctas, &ctas);
  if (err == cudaSuccess) {
    err = LaunchWithSharedMemory(kFp8Kernel<kHeadDim>, dim3(ctas), Traits::kThreads,
                                 Traits::kSmemBytes, stream, launch);
  }
  if (err != cudaSuccess) return LaunchError(err, "the FP8 forward");
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchFp8Forward(const Fp8ForwardParams& params, void* stream) {
  const FusedForwardParams& p = params.p;
  if (auto s = CheckShape(p); !s.ok()) return s;
  if (auto s = CheckRows("q", p.q, p.q_token_stride, p.q_head_stride, 1); !s.ok()) return s;
  if (auto s = CheckRows("k", p.k, p.k_token_stride, p.k_head_stride, 1); !s.ok()) return s;
  if (auto s = CheckRows("o", p.o, p.o_token_stride, p.o_head_stride, 2); !s.ok()) return s;
  if (!IsAligned16(p.v)) return absl::InvalidArgumentError("cuda_fp8: v is not 16-byte aligned");
  if (params.descale == nullptr) return absl::InvalidArgumentError("cuda_fp8: descale is null");
  if (p.tile_counters == nullptr) {
    return absl::InvalidArgumentError("cuda_fp8: tile_counters is null");
  }
  if (p.batch == 0 || p.seqlen_q == 0) return absl::OkStatus();
  auto* s = static_cast<cudaStream_t>(stream);
  return p.head_dim == 128 ? LaunchFp8ForwardAt<128>(params, s)
                           : LaunchFp8ForwardAt<256>(params, s);
}

int64_t Fp8ForwardWorkspaceBytes(const FusedForwardParams& p) {
  return Fp8Workspace::Of(p).total();
}

absl::Status PrepareFp8Forward(const FusedForwardParams& p, void* workspace,
                               int64_t workspace_bytes, Fp8ForwardParams* out, void* stream) {
  if (auto s = CheckShape(p); !s.ok()) return s;
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) {
    return absl::InvalidArgumentError("cuda_fp8: the inputs must be float16 or bfloat16");
  }
  if (auto s = CheckRows("q", p.q, p.q_token_stride, p.q_head_stride, 2); !s.ok()) return s;
  if (auto s = CheckRows("k", p.k, p.k_token_stride, p.k_head_stride, 2); !s.ok()) return s;
  if (auto s = CheckRows("v", p.v, p.v_token_stride, p.v_head_stride, 2); !s.ok()) return s;
  const Fp8Workspace layout = Fp8Workspace::Of(p);
  if (workspace == nullptr || !IsAligned16(workspace) || workspace_bytes < layout.total()) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_fp8: the workspace needs ", layout.total(),
                                                   " bytes, 16-byte aligned (got ", workspace_bytes,
                                                   ")"));
  }
  auto* base = static_cast<char*>(workspace);
  auto* amax = reinterpret_cast<unsigned*>(base);
  auto* descale = reinterpret_cast<float*>(base + 64);
  char* q8 = base + Fp8Workspace::kScaleBytes;
  char* k8 = q8 + layout.q_bytes;
  char* v8 = k8 + layout.k_bytes;

  *out = Fp8ForwardParams{};
  out->p = p;
  out->p.dtype = DType::kBF16;
  out->p.q = q8;
  out->p.k = k8;
  out->p.v = v8;
  out->p.q_token_stride = int64_t{p.num_heads} * p.head_dim;
  out->p.q_head_stride = p.head_dim;
  out->p.k_token_stride = int64_t{p.num_kv_heads} * p.head_dim;
  out->p.k_head_stride = p.head_dim;
  out->descale = descale;

  const RowsView q{p.q,        p.batch * p.seqlen_q, p.num_heads,
                   p.head_dim, p.q_token_stride,     p.q_head_stride};
  const RowsView k{p.k,        p.batch * p.seqlen_k, p.num_kv_heads,
                   p.head_dim, p.k_token_stride,     p.k_head_stride};
  const RowsView v{p.v,        p.batch * p.seqlen_k, p.num_kv_heads,
                   p.head_dim, p.v_token_stride,     p.v_head_stride};
  const TransposedValues transposed{p.batch, p.num_kv_heads, p.head_dim, p.seqlen_k,
                                    Fp8ValueRowKeys(p.seqlen_k)};
  auto* s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemsetAsync(amax, 0, 3 * sizeof(unsigned), s);
  const auto launch = [&]<typename Element>() {
    const RowsView views[3] = {q, k, v};
    for (int i = 0; i < 3; ++i) {
      if (views[i].chunks() > 0) {
        AbsMaxKernel<Element><<<GridFor(views[i].chunks()), 256, 0, s>>>(views[i], amax + i);
      }
    }
    DescaleKernel<<<1, 32, 0, s>>>(amax, descale);
    if (q.chunks() > 0) {
      QuantizeRowsKernel<Element>
          <<<GridFor(q.chunks()), 256, 0, s>>>(q, descale, reinterpret_cast<uint2*>(q8));
    }
    if (k.chunks() > 0) {
      QuantizeRowsKernel<Element>
          <<<GridFor(k.chunks()), 256, 0, s>>>(k, descale + 1, reinterpret_cast<uint2*>(k8));
    }
    if (transposed.groups() > 0) {
      TransposeValuesKernel<Element><<<GridFor(transposed.groups()), 256, 0, s>>>(
          v, transposed, descale + 2, reinterpret_cast<uint4*>(v8));
    }
    return cudaGetLastError();
  };
  if (err == cudaSuccess) {
    err = p.dtype == DType::kF16 ? launch.template operator()<__half>()
                                 : launch.template operator()<__nv_bfloat16>();
  }
  if (err != cudaSuccess) return LaunchError(err, "the quantization");
  return absl::OkStatus();
}

}  // namespace attn::cuda
