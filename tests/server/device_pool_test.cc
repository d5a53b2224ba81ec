// DevicePool: the host pool's no-op copies everywhere; on a GPU, CopyManyToDevice and
// CopyManyToHost move every byte both ways through each of their paths (the copy engines for
// few or large copies, the copy kernel for many small ones, aligned or not). GPU tests skip
// without a CUDA device.
#include "server/device_pool.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

#if defined(ATTN_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace attnserve {
namespace {

bool HaveCudaDevice() {
#if defined(ATTN_HAVE_CUDA)
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
#else
  return false;
#endif
}

TEST(DevicePoolTest, HostPoolStagesWhereTheEngineReads) {
  auto pool = DevicePool::Create(attn::MemorySpace::kHost, 0, int64_t{64} << 20);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_TRUE((*pool)->Reserve(3 << 20).ok());
  EXPECT_GE((*pool)->capacity(), 3 << 20);
  EXPECT_EQ((*pool)->host(), (*pool)->device());
  EXPECT_TRUE((*pool)->CopyToDevice(0, 1 << 20).ok());
  EXPECT_TRUE((*pool)->Synchronize().ok());
  EXPECT_EQ((*pool)->label(), "cpu");
  // Past the limit: RESOURCE_EXHAUSTED, and the old region stays.
  EXPECT_EQ((*pool)->Reserve(int64_t{65} << 20).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_GE((*pool)->capacity(), 3 << 20);
}

// Page-locked host memory for a test, as a registered shared-memory region is.
class PinnedHost {
 public:
  explicit PinnedHost(size_t bytes)
      : bytes_(bytes), p_(static_cast<uint8_t*>(std::aligned_alloc(4096, bytes))) {
    pinned_ = DevicePool::PinHostMemory(p_, static_cast<int64_t>(bytes)).ok();
  }
  ~PinnedHost() {
    if (pinned_) DevicePool::UnpinHostMemory(p_);
    std::free(p_);
  }
  bool pinned() const { return pinned_; }
  uint8_t* data() { return p_; }

 private:
  size_t bytes_;
  uint8_t* p_;
  bool pinned_ = false;
};

// `count` copies of `bytes` each (plus `ragged` bytes on odd ones, which also start `ragged`
// bytes into their slot), host slot i to device offset i * slot and back to a second host area.
void RoundTrip(DevicePool& pool, int count, int64_t bytes, int64_t ragged, bool expect_kernel) {
  const int64_t slot = (bytes + ragged + 4095) / 4096 * 4096 + 4096;
  PinnedHost source(count * slot), back(count * slot);
  ASSERT_TRUE(source.pinned() && back.pinned());
  std::mt19937 rng(count * 7919 + bytes);
  for (int64_t i = 0; i < count * slot; ++i) source.data()[i] = static_cast<uint8_t>(rng());
  std::memset(back.data(), 0xA5, count * slot);
  ASSERT_TRUE(pool.Reserve(count * slot).ok());

  std::vector<DevicePool::HostCopy> in, out;
  for (int i = 0; i < count; ++i) {
    const int64_t shift = i % 2 == 1 ? ragged : 0;
    const int64_t n = bytes + shift;
    in.push_back({source.data() + i * slot + shift, i * slot + shift, n});
    out.push_back({back.data() + i * slot + shift, i * slot + shift, n});
  }
  EXPECT_EQ(pool.UseCopyKernel(in), expect_kernel);
  ASSERT_TRUE(pool.Activate().ok());
  ASSERT_TRUE(pool.CopyManyToDevice(in).ok());
  ASSERT_TRUE(pool.CopyManyToHost(out).ok());
  ASSERT_TRUE(pool.Synchronize().ok());
  for (int i = 0; i < count; ++i) {
    const int64_t shift = i % 2 == 1 ? ragged : 0;
    const uint8_t* want = source.data() + i * slot + shift;
    const uint8_t* got = back.data() + i * slot + shift;
    ASSERT_EQ(std::memcmp(want, got, bytes + shift), 0) << "copy " << i << " of " << count;
    // Nothing outside the copies was written.
    EXPECT_EQ(back.data()[i * slot + bytes + 2 * shift], 0xA5) << "copy " << i;
    if (shift > 0) {
      EXPECT_EQ(back.data()[i * slot + shift - 1], 0xA5) << "copy " << i;
    }
  }
}

class DevicePoolCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
    auto pool = DevicePool::Create(attn::MemorySpace::kDevice, 0, int64_t{1} << 30);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
  }
  std::unique_ptr<DevicePool> pool_;
};

TEST_F(DevicePoolCopyTest, FewCopiesGoThroughTheCopyEngines) {
  RoundTrip(*pool_, 3, 64 << 10, 0, /*expect_kernel=*/false);
}

TEST_F(DevicePoolCopyTest, ManySmallCopiesGoAsOneKernel) {
  // A batch of 14 small requests' Q, K and V (64 KiB each), as the lanes issue them.
  RoundTrip(*pool_, 42, 64 << 10, 0, /*expect_kernel=*/true);
}

TEST_F(DevicePoolCopyTest, ManySmallUnalignedCopiesGoAsOneKernel) {
  RoundTrip(*pool_, 11, 1000, 3, /*expect_kernel=*/true);
}

TEST_F(DevicePoolCopyTest, ManyLargeCopiesGoThroughTheCopyEngines) {
  RoundTrip(*pool_, 8, 1 << 20, 16, /*expect_kernel=*/false);
}

}  // namespace
}  // namespace attnserve
