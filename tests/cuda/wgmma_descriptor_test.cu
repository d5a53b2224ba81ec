// The wgmma descriptor arithmetic on the host: DescriptorPlus(MakeDescriptor(smem, lead), bytes)
// is MakeDescriptor(smem + bytes, lead) for every 16-byte aligned operand in shared memory, the
// identity the Hopper kernels rely on when they advance one descriptor by each k-step's offset.
#include <cstdint>

#include "cuda/fused/wgmma.cuh"
#include "gtest/gtest.h"

namespace attn::cuda::wgmma {
namespace {

constexpr uint32_t kSharedEnd = 1u << 18;  // above any CTA's shared memory (227 KiB on Hopper)

TEST(WgmmaDescriptor, AdvancingEqualsRebuildingEverywhereInSharedMemory) {
  int64_t checked = 0, mismatches = 0;
  for (const uint32_t lead : {0u, 64u * 128u, 128u * 128u, 176u * 128u}) {
    for (uint32_t smem = 0; smem < kSharedEnd; smem += 16) {
      const uint64_t base = MakeDescriptor(smem, lead);
      // The k-steps' offsets inside a 1 KiB swizzle atom, then whole atoms to the end.
      for (uint32_t bytes = 0; smem + bytes < kSharedEnd; bytes += bytes < 1024 ? 16 : 1024) {
        ++checked;
        if (DescriptorPlus(base, bytes) != MakeDescriptor(smem + bytes, lead)) {
          if (++mismatches <= 5) {
            ADD_FAILURE() << "smem " << smem << " + " << bytes << ", leading bytes " << lead;
          }
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << checked;
  EXPECT_GT(checked, int64_t{10'000'000});
}

TEST(WgmmaDescriptor, FieldsWhereTheHardwareReadsThem) {
  const uint64_t d = MakeDescriptor(0x12340, 128 * 128);
  EXPECT_EQ(d & 0x3FFF, 0x12340u >> 4);               // start address / 16
  EXPECT_EQ((d >> 16) & 0x3FFF, (128u * 128u) >> 4);  // leading byte offset / 16
  EXPECT_EQ((d >> 32) & 0x3FFF, 1024u >> 4);          // stride byte offset / 16
  EXPECT_EQ(d >> 62, 1u);                             // 128-byte swizzle
  EXPECT_EQ(DescriptorPlus(d, 0x40) & 0x3FFF, (0x12340u + 0x40) >> 4);
  EXPECT_EQ(DescriptorPlus(d, 0x40) >> 14, d >> 14);  // nothing above the address changes
}

}  // namespace
}  // namespace attn::cuda::wgmma
