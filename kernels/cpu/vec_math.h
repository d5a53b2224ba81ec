// Small math pieces of the tiled CPU kernels, written so GCC vectorises the loops that call them,
// and the function-multiversioning attribute the hot tile functions carry.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

// Hot tile functions are compiled for AVX-512, AVX2+FMA and baseline x86-64 and picked at load
// time (GNU ifunc), so one binary runs on any x86-64 and uses the widest vectors available.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__ELF__)
#define ATTN_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTN_CPU_CLONES
#endif

namespace attn::cpu {

// exp(x) in float to about 2 ulp, branch-free so a loop over it vectorises (libm's expf is a
// call GCC only vectorises under -ffast-math, which would also break NaN/Inf handling).
// exp(x) = 2^n * exp(r) with x = n ln2 + r, |r| <= ln2 / 2; exp(r) by its Taylor series to
// degree 7 (truncation < 1e-8 relative). Results below FLT_MIN flush to 0; -inf gives 0, NaN
// gives NaN, overflow gives +inf.
inline float ExpFloat(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // few mantissa bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  float t = x * kLog2e;
  t = t > -126.f ? t : -126.f;  // also catches NaN and -inf, fixed up below
  t = t < 127.f ? t : 127.f;
  const float n = (t + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float pow2n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  float y = p * pow2n;
  y = x < -87.33f ? 0.f : y;
  y = x > 88.72f ? std::numeric_limits<float>::infinity() : y;
  return x != x ? x : y;
}

}  // namespace attn::cpu
