#include <algorithm>

#include "cuda/common/cuda_status.h"
#include "cuda/common/span_copy.h"

namespace attn::cuda {
namespace {

// Spans per launch: the table travels as a kernel parameter (under the 4 KiB every toolkit
// accepts), so a launch needs no copy of its own.
constexpr int kSpansPerLaunch = 96;
constexpr int kThreads = 256;
constexpr int kVectorsPerThread = 2;  // 8 KiB per block: enough loads in flight for PCIe
constexpr int64_t kChunkBytes = int64_t{kThreads} * kVectorsPerThread * 16;
constexpr int64_t kMaxChunks = int64_t{1} << 30;

struct SpanTable {
  const char* src[kSpansPerLaunch];
  char* dst[kSpansPerLaunch];
  int64_t bytes[kSpansPerLaunch];
  int first_chunk[kSpansPerLaunch + 1];  // block b copies chunk b - first_chunk[s] of span s
  int count;
};

__global__ void __launch_bounds__(kThreads) CopySpansKernel(const __grid_constant__ SpanTable t) {
  const int chunk = blockIdx.x;
  int lo = 0, hi = t.count - 1;  // the last span whose first chunk is <= this block's
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first_chunk[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int s = lo;
  const int64_t begin = int64_t{chunk - t.first_chunk[s]} * kChunkBytes;
  const int64_t end = min(begin + kChunkBytes, t.bytes[s]);
  const char* src = t.src[s];
  char* dst = t.dst[s];
  // 16-byte vectors over the span's aligned body when source and destination are aligned; bytes for
  // the rest (a ragged tail, or the whole span when the addresses are not aligned).
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
  const int64_t body_end = min(end, aligned ? (t.bytes[s] & ~int64_t{15}) : begin);
  // All loads first, then all stores: every thread keeps its loads in flight together.
  uint4 v[kVectorsPerThread];
#pragma unroll
  for (int i = 0; i < kVectorsPerThread; ++i) {
    const int64_t at = begin + (int64_t{i} * kThreads + threadIdx.x) * 16;
    if (at < body_end) v[i] = *reinterpret_cast<const uint4*>(src + at);
  }
#pragma unroll
  for (int i = 0; i < kVectorsPerThread; ++i) {
    const int64_t at = begin + (int64_t{i} * kThreads + threadIdx.x) * 16;
    if (at < body_end) *reinterpret_cast<uint4*>(dst + at) = v[i];
  }
  for (int64_t at = max(begin, body_end) + threadIdx.x; at < end; at += kThreads) {
    dst[at] = src[at];
  }
}

}  // namespace

absl::Status CopySpansAsync(const std::vector<CopySpan>& spans, cudaStream_t stream) {
  size_t next = 0;
  while (next < spans.size()) {
    SpanTable table{};
    int chunks = 0;
    while (next < spans.size() && table.count < kSpansPerLaunch) {
      const CopySpan& span = spans[next++];
      if (span.bytes <= 0) continue;
      const int64_t span_chunks = (span.bytes + kChunkBytes - 1) / kChunkBytes;
      if (span_chunks > kMaxChunks) {
        return absl::InvalidArgumentError("CopySpansAsync: a span longer than 8 TiB");
      }
      if (chunks + span_chunks > kMaxChunks) {  // the grid's extent; far past any real batch
        --next;
        break;
      }
      table.src[table.count] = static_cast<const char*>(span.src);
      table.dst[table.count] = static_cast<char*>(span.dst);
      table.bytes[table.count] = span.bytes;
      table.first_chunk[table.count] = chunks;
      chunks += static_cast<int>(span_chunks);
      ++table.count;
    }
    if (table.count == 0) continue;
    table.first_chunk[table.count] = chunks;
    CopySpansKernel<<<chunks, kThreads, 0, stream>>>(table);
    ATTN_RETURN_IF_ERROR(LaunchStatus("CopySpansKernel"));
  }
  return absl::OkStatus();
}

absl::Status MappedDevicePointer(const void* host, void** device) {
  return CudaStatus(cudaHostGetDevicePointer(device, const_cast<void*>(host), 0),
                    "cudaHostGetDevicePointer");
}

}  // namespace attn::cuda
