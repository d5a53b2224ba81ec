// CopySpansAsync: every span's bytes land where they should and nothing else is written, for
// odd lengths and offsets (the byte path), 16-byte multiples (the vector path), more spans than
// one launch takes, and host memory on either side. Skips without a CUDA device.
#include "cuda/common/span_copy.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "gtest/gtest.h"

namespace attn::cuda {
namespace {

constexpr uint8_t kPoison = 0xA5;

// Page-locked, device-mapped host memory for the duration of a test.
class MappedHost {
 public:
  explicit MappedHost(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaHostAlloc(&host_, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
              cudaSuccess);
    EXPECT_TRUE(MappedDevicePointer(host_, &device_).ok());
  }
  ~MappedHost() { cudaFreeHost(host_); }
  uint8_t* host() { return static_cast<uint8_t*>(host_); }
  uint8_t* device() { return static_cast<uint8_t*>(device_); }
  size_t size() const { return bytes_; }

 private:
  size_t bytes_;
  void* host_ = nullptr;
  void* device_ = nullptr;
};

struct Layout {
  int64_t src_at, dst_at, bytes;
};

// Spans of awkward lengths and offsets, then 16-byte-aligned ones, side by side with gaps
// between destinations so that a stray write shows up as a changed gap byte.
std::vector<Layout> MakeLayouts(int count, std::mt19937& rng, int64_t* total) {
  const int64_t lengths[] = {1, 15, 16, 17, 255, 8191, 8192, 8193, 65536, 65536 + 48, 3 * 8192 + 5};
  std::vector<Layout> layouts;
  int64_t at = 0;
  for (int i = 0; i < count; ++i) {
    int64_t bytes = lengths[i % std::size(lengths)];
    if (i % 7 == 3) bytes = 0;  // empty spans are allowed and write nothing
    const bool aligned = i % 2 == 0;
    const int64_t shift = aligned ? 0 : 1 + static_cast<int64_t>(rng() % 15);
    layouts.push_back({at + shift, at + (aligned ? 0 : 16 - shift), bytes});
    at += (bytes + 32 + 15) / 16 * 16 + 16;  // room for the span, the shift and a gap
  }
  *total = at;
  return layouts;
}

void FillRandom(uint8_t* p, int64_t n, std::mt19937& rng) {
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

// Copies with `count` spans from `src` to `dst` (device addresses) and checks `dst_host` (a
// host view of the destination after the copy) byte for byte.
void ExpectSpansCopied(int count, bool host_to_device) {
  std::mt19937 rng(1234 + count);
  int64_t total = 0;
  const std::vector<Layout> layouts = MakeLayouts(count, rng, &total);
  MappedHost host(total);
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, total), cudaSuccess);
  auto* dev = static_cast<uint8_t*>(device);

  std::vector<uint8_t> source(total), expected(total, kPoison);
  FillRandom(source.data(), total, rng);
  for (const Layout& l : layouts) {
    std::copy_n(source.begin() + l.src_at, l.bytes, expected.begin() + l.dst_at);
  }
  std::vector<CopySpan> spans;
  if (host_to_device) {
    std::copy(source.begin(), source.end(), host.host());
    ASSERT_EQ(cudaMemset(dev, kPoison, total), cudaSuccess);
    for (const Layout& l : layouts) {
      spans.push_back({host.device() + l.src_at, dev + l.dst_at, l.bytes});
    }
  } else {
    ASSERT_EQ(cudaMemcpy(dev, source.data(), total, cudaMemcpyHostToDevice), cudaSuccess);
    std::fill_n(host.host(), total, kPoison);
    for (const Layout& l : layouts) {
      spans.push_back({dev + l.src_at, host.device() + l.dst_at, l.bytes});
    }
  }
  ASSERT_TRUE(CopySpansAsync(spans, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<uint8_t> got(total);
  if (host_to_device) {
    ASSERT_EQ(cudaMemcpy(got.data(), dev, total, cudaMemcpyDeviceToHost), cudaSuccess);
  } else {
    std::copy_n(host.host(), total, got.begin());
  }
  cudaFree(device);
  int64_t wrong = 0, first_wrong = -1;
  for (int64_t i = 0; i < total; ++i) {
    if (got[i] != expected[i] && wrong++ == 0) first_wrong = i;
  }
  EXPECT_EQ(wrong, 0) << "first wrong byte at " << first_wrong << " of " << total;
}

TEST(SpanCopyTest, HostToDeviceFewSpans) {
  ATTN_SKIP_WITHOUT_CUDA();
  ExpectSpansCopied(11, /*host_to_device=*/true);
}

TEST(SpanCopyTest, HostToDeviceMoreSpansThanOneLaunchTakes) {
  ATTN_SKIP_WITHOUT_CUDA();
  ExpectSpansCopied(250, /*host_to_device=*/true);
}

TEST(SpanCopyTest, DeviceToHost) {
  ATTN_SKIP_WITHOUT_CUDA();
  ExpectSpansCopied(130, /*host_to_device=*/false);
}

TEST(SpanCopyTest, NoSpansLaunchesNothing) {
  // Runs without a device too: an empty list (or only empty spans) makes no CUDA call.
  EXPECT_TRUE(CopySpansAsync({}, nullptr).ok());
  EXPECT_TRUE(CopySpansAsync({{nullptr, nullptr, 0}, {nullptr, nullptr, 0}}, nullptr).ok());
}

}  // namespace
}  // namespace attn::cuda
