// attn_copy_bench: what a batch of small requests' host<->device copies cost, the way the
// server's lanes issue them (docs/server-performance.md). Host memory is page-locked with
// cudaHostRegister, as a registered shared-memory region is. For n requests of N = 64, 8 heads,
// d = 64, fp16 (64 KiB per tensor) it times, with CUDA events and with the host clock through
// the stream's synchronisation:
//   h2d 3n    Q, K, V of each request into the packed Q, K and V regions: 3n copies, one
//             cudaMemcpyBatchAsync (the server today)
//   h2d n     each request's Q, K, V as one 192 KiB copy (the layout a per-sequence stride would
//             allow): n copies
//   h2d 1     all of it as one copy (the bandwidth floor)
//   d2h n     each request's O back: n copies, one batch call (the server today)
//   d2h 1     all O as one copy
//   h2d kernel / d2h kernel   the 3n (n) copies as one CopySpansAsync launch: the SMs read
//             (write) the mapped host memory over PCIe
//
//   attn_copy_bench [iterations]   (default 200)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "cuda/common/span_copy.h"

namespace {

constexpr size_t kTensorBytes = size_t{64} * 8 * 64 * 2;  // N = 64, 8 heads, d = 64, fp16
constexpr int kMaxRequests = 16;

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};

// Issues `copies` on `stream` in one batch call (falling back to one call per copy).
void Issue(const std::vector<Copy>& copies, cudaStream_t stream) {
#if CUDART_VERSION >= 13000
  if (copies.size() > 1) {
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    for (const Copy& c : copies) {
      dsts.push_back(c.dst);
      srcs.push_back(c.src);
      sizes.push_back(c.bytes);
    }
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t first = 0;
    if (cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), copies.size(), &attributes,
                             &first, 1, stream) == cudaSuccess) {
      return;
    }
    (void)cudaGetLastError();
  }
#endif
  for (const Copy& c : copies) {
    Check(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
  }
}

struct Timing {
  double event_us = 0;  // first copy issued -> last copy done, on the GPU
  double host_us = 0;   // issue + synchronise, as the lane sees it
};

Timing Measure(const std::function<void()>& issue, cudaStream_t stream, int iterations) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 10; ++i) issue();  // warm-up
  Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<double> events, hosts;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    Check(cudaEventRecord(start, stream), "cudaEventRecord");
    issue();
    Check(cudaEventRecord(stop, stream), "cudaEventRecord");
    Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const auto t1 = std::chrono::steady_clock::now();
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    events.push_back(1000.0 * ms);
    hosts.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  auto median = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  return {median(events), median(hosts)};
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::max(10, std::atoi(argv[1])) : 200;
  const size_t region_bytes = kMaxRequests * 4 * kTensorBytes;  // Q, K, V, O per request
  void* host = std::aligned_alloc(4096, region_bytes);
  if (host == nullptr) return 1;
  std::memset(host, 1, region_bytes);
  Check(cudaHostRegister(host, region_bytes, cudaHostRegisterPortable | cudaHostRegisterMapped),
        "cudaHostRegister");
  void* device = nullptr;
  Check(cudaMalloc(&device, region_bytes), "cudaMalloc");
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  auto* h = static_cast<char*>(host);
  void* mapped = nullptr;
  if (!attn::cuda::MappedDevicePointer(host, &mapped).ok()) return 1;
  // The same host bytes at their device address, for the kernel variants.
  auto as_mapped = [&](const void* p) {
    return static_cast<char*>(mapped) + (static_cast<const char*>(p) - h);
  };
  auto* d = static_cast<char*>(device);
  const size_t t = kTensorBytes;

  std::printf("| requests | MiB in / out | variant | copies | GPU us | host us | GB/s (GPU) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (int n : {1, 4, 8, 14, 16}) {
    // Host: request i's Q, K, V, O side by side at i * 4t. Device: packed Q, K, V, O regions.
    const size_t region = n * t;
    std::vector<Copy> h2d_3n, h2d_n, d2h_n;
    for (int i = 0; i < n; ++i) {
      const char* src = h + i * 4 * t;
      for (int j = 0; j < 3; ++j) h2d_3n.push_back({d + j * region + i * t, src + j * t, t});
      h2d_n.push_back({d + i * 3 * t, src, 3 * t});
      d2h_n.push_back({h + i * 4 * t + 3 * t, d + 3 * region + i * t, t});
    }
    const std::vector<Copy> h2d_1 = {{d, h, 3 * region}};
    const std::vector<Copy> d2h_1 = {{h + 3 * region, d + 3 * region, region}};
    std::vector<attn::cuda::CopySpan> h2d_spans, d2h_spans;
    for (const Copy& c : h2d_3n) h2d_spans.push_back({as_mapped(c.src), c.dst, int64_t(c.bytes)});
    for (const Copy& c : d2h_n) d2h_spans.push_back({c.src, as_mapped(c.dst), int64_t(c.bytes)});
    auto dma = [&](const std::vector<Copy>& copies) {
      return [&copies, stream] { Issue(copies, stream); };
    };
    auto kernel = [&](const std::vector<attn::cuda::CopySpan>& spans) {
      return [&spans, stream] {
        if (!attn::cuda::CopySpansAsync(spans, stream).ok()) std::exit(1);
      };
    };
    struct Variant {
      const char* name;
      std::function<void()> issue;
      size_t copies;
      size_t bytes;
    };
    for (const Variant& v : {Variant{"h2d 3n", dma(h2d_3n), h2d_3n.size(), 3 * region},
                             Variant{"h2d n", dma(h2d_n), h2d_n.size(), 3 * region},
                             Variant{"h2d 1", dma(h2d_1), 1, 3 * region},
                             Variant{"h2d kernel", kernel(h2d_spans), h2d_spans.size(), 3 * region},
                             Variant{"d2h n", dma(d2h_n), d2h_n.size(), region},
                             Variant{"d2h 1", dma(d2h_1), 1, region},
                             Variant{"d2h kernel", kernel(d2h_spans), d2h_spans.size(), region}}) {
      const Timing timing = Measure(v.issue, stream, iterations);
      std::printf("| %d | %.2f / %.2f | %s | %zu | %.1f | %.1f | %.1f |\n", n,
                  3.0 * region / (1 << 20), 1.0 * region / (1 << 20), v.name, v.copies,
                  timing.event_us, timing.host_us, v.bytes / (1000.0 * timing.event_us));
    }
  }
  cudaStreamDestroy(stream);
  cudaFree(device);
  cudaHostUnregister(host);
  std::free(host);
  return 0;
}
