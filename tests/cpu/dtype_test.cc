// The storage conversions of attn/dtype.h: round-to-nearest-even, subnormals, overflow, Inf/NaN.
#include "attn/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace attn {
namespace {

float Pow2(int e) { return std::ldexp(1.f, e); }

TEST(BF16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBF16(1.f), 0x3f80);
  EXPECT_EQ(FloatToBF16(1.f + Pow2(-8)), 0x3f80);              // tie, 0x3f80 is even
  EXPECT_EQ(FloatToBF16(1.f + 3 * Pow2(-8)), 0x3f82);          // tie, 0x3f82 is even
  EXPECT_EQ(FloatToBF16(1.f + Pow2(-8) + Pow2(-20)), 0x3f81);  // just above the tie
  EXPECT_EQ(FloatToBF16(-2.f), 0xc000);
  EXPECT_EQ(FloatToBF16(-0.f), 0x8000);
}

TEST(BF16Test, InfinityNaNAndOverflow) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBF16(inf), 0x7f80);
  EXPECT_EQ(FloatToBF16(-inf), 0xff80);
  EXPECT_EQ(FloatToBF16(std::numeric_limits<float>::max()), 0x7f80);  // rounds past the top
  const uint16_t nan = FloatToBF16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(BF16ToFloat(nan)));
  // A signalling NaN whose payload lives only in the low bits must stay NaN (not become Inf).
  EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(BitsToFloat(0x7f800001u)))));
}

TEST(BF16Test, SubnormalsSurvive) {
  const float tiny = BitsToFloat(0x00010000u);  // a float subnormal that bf16 holds exactly
  EXPECT_EQ(FloatToBF16(tiny), 0x0001);
  EXPECT_EQ(BF16ToFloat(0x0001), tiny);
}

TEST(BF16Test, EveryValueRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = BF16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(f))));
    } else {
      ASSERT_EQ(FloatToBF16(f), h) << std::hex << h;
    }
  }
}

TEST(HalfTest, RoundsToNearestEven) {
  EXPECT_EQ(FloatToHalf(1.f), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.f + Pow2(-11)), 0x3c00);      // tie to even
  EXPECT_EQ(FloatToHalf(1.f + 3 * Pow2(-11)), 0x3c02);  // tie to even
  EXPECT_EQ(FloatToHalf(1.f + Pow2(-11) + Pow2(-20)), 0x3c01);
  EXPECT_EQ(FloatToHalf(-0.f), 0x8000);
  EXPECT_EQ(FloatToHalf(65504.f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.f), 0x7c00);  // the tie above the largest half rounds to Inf
}

TEST(HalfTest, Subnormals) {
  EXPECT_EQ(FloatToHalf(Pow2(-24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(FloatToHalf(Pow2(-25)), 0x0000);         // tie with 0, 0 is even
  EXPECT_EQ(FloatToHalf(Pow2(-25) * 1.5f), 0x0001);  // above the tie
  EXPECT_EQ(FloatToHalf(3 * Pow2(-25)), 0x0002);     // tie between 1 and 2 ulps: even
  EXPECT_EQ(FloatToHalf(1023 * Pow2(-24)), 0x03ff);  // largest subnormal
  EXPECT_EQ(FloatToHalf(Pow2(-14)), 0x0400);         // smallest normal
  EXPECT_EQ(FloatToHalf(-Pow2(-24)), 0x8001);
  EXPECT_EQ(HalfToFloat(0x0001), Pow2(-24));
  EXPECT_EQ(HalfToFloat(0x03ff), 1023 * Pow2(-24));
  EXPECT_EQ(FloatToHalf(Pow2(-30)), 0x0000);
}

TEST(HalfTest, InfinityAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToHalf(inf), 0x7c00);
  EXPECT_EQ(FloatToHalf(-inf), 0xfc00);
  EXPECT_EQ(HalfToFloat(0x7c00), inf);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(BitsToFloat(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7d5a)));
}

TEST(HalfTest, EveryValueRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
    } else {
      ASSERT_EQ(FloatToHalf(f), h) << std::hex << h;
    }
  }
}

#if defined(__FLT16_MAX__)
// The compiler's own _Float16 conversion is IEEE round-to-nearest-even: agree with it on random
// bit patterns spanning every exponent.
TEST(HalfTest, AgreesWithCompilerFloat16) {
  std::mt19937 rng(12345);
  for (int i = 0; i < 2000000; ++i) {
    const float f = BitsToFloat(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    ASSERT_EQ(FloatToHalf(f), bits) << std::hexfloat << f;
    ASSERT_EQ(HalfToFloat(bits), static_cast<float>(h));
  }
}
#endif

// The row conversions (F16C on this CPU when it has it) give the element functions' bits: every
// half, and random floats over every exponent plus the edge cases; NaN stays NaN. Rows of odd
// lengths exercise the vector body and the scalar tail.
TEST(HalfTest, RowConversionsMatchTheElementFunctions) {
  std::vector<uint16_t> halves(65536 + 3);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i);
  std::vector<float> floats(halves.size());
  HalfToFloatRow(halves.data(), floats.data(), static_cast<int64_t>(halves.size()));
  for (size_t i = 0; i < halves.size(); ++i) {
    const float want = HalfToFloat(halves[i]);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(floats[i])) << std::hex << halves[i];
    } else {
      ASSERT_EQ(FloatBits(floats[i]), FloatBits(want)) << std::hex << halves[i];
    }
  }

  std::mt19937 rng(777);
  std::vector<float> in;
  for (float f : {0.f, -0.f, 1.f, 65504.f, 65519.f, 65520.f, Pow2(-24), Pow2(-25), Pow2(-25) * 1.5f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), BitsToFloat(0x7f800001u),
                  BitsToFloat(0xffc12345u)}) {
    in.push_back(f);
  }
  while (in.size() < 1000003) in.push_back(BitsToFloat(static_cast<uint32_t>(rng())));
  std::vector<uint16_t> out(in.size());
  FloatToHalfRow(in.data(), out.data(), static_cast<int64_t>(in.size()));
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = FloatToHalf(in[i]);
    if (std::isnan(in[i])) {
      ASSERT_TRUE(std::isnan(HalfToFloat(out[i]))) << std::hexfloat << in[i];
    } else {
      ASSERT_EQ(out[i], want) << std::hexfloat << in[i];
    }
  }
  for (int64_t n : {0, 1, 7, 8, 9, 15, 17}) {  // tails alone and around one vector
    std::vector<uint16_t> part(static_cast<size_t>(n) + 1, 0xabcd);
    FloatToHalfRow(in.data() + 100, part.data(), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(part[i], FloatToHalf(in[100 + i]));
    EXPECT_EQ(part[n], 0xabcd) << "wrote past the row";
  }
}

TEST(DTypeTest, ParsesNamesAndRejectsOthers) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("half"), DType::kF16);
  EXPECT_EQ(*ParseDType("float32"), DType::kF32);
  const auto bad = ParseDType("fp8");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("dtype"), std::string::npos);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2);
  EXPECT_EQ(RoundToDType(1.f + Pow2(-9), DType::kBF16), 1.f);
}

}  // namespace
}  // namespace attn
