// ElementMask (attn/mask.h), the Hopper backward's per-element mask in clamped 32-bit offsets,
// against VisibleKeys on every element of the fragments a kernel thread holds: offsets up to a
// tile's reach from base elements placed inside, at and far (beyond the clamp) from the
// window's edges, for causal, sliding, one-sided and no windows, q < k and q > k, and block
// ends inside the fragment.
#include "attn/mask.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace attn {
namespace {

struct Window {
  int64_t left, right;
};

TEST(ElementMaskTest, MatchesVisibleKeysOnEveryOffset) {
  const std::vector<Window> windows = {{-1, -1}, {-1, 0}, {0, 0},    {3, 0},    {-1, 5},
                                       {64, 0},  {16, 8}, {100, 50}, {5000, 0}, {2, 3000}};
  const std::vector<std::pair<int64_t, int64_t>> lengths = {{177, 177},   {17, 1013},  {1013, 17},
                                                            {5000, 5000}, {300, 4000}, {4000, 300}};
  int64_t checked = 0;
  for (const Window& w : windows) {
    for (const auto& [lq, lk] : lengths) {
      // Base elements over the whole square, and the block ends around them (a partial block,
      // the sequence's end).
      for (int64_t row = 0; row < lq; row += 97) {
        for (int64_t key = 0; key < lk; key += 89) {
          for (const int64_t block_end : {key + 128, key + 9, key + 1, lk}) {
            const int64_t keys_end = std::min(block_end, lk);  // as the kernel passes it
            const ElementMask mask(w.left, w.right, key, row, lq, lk, keys_end);
            for (int dk = 0; dk < 16; dk += 8) {
              for (int dr = 0; dr < 128 && row + dr < lq; ++dr) {
                const KeyRange visible = VisibleKeys(row + dr, lq, lk, w.left, w.right);
                const int64_t k = key + dk;
                const bool expected = k >= visible.begin && k < visible.end && k < keys_end;
                ASSERT_EQ(mask.Visible(dk, dr), expected)
                    << "window (" << w.left << ", " << w.right << ") lq " << lq << " lk " << lk
                    << " key " << key << "+" << dk << " row " << row << "+" << dr << " keys_end "
                    << keys_end;
                ++checked;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 1000000);
}

}  // namespace
}  // namespace attn
