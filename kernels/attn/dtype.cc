#include "attn/dtype.h"

#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define ATTN_HAVE_F16C_DISPATCH 1
#endif

#include "absl/strings/str_cat.h"

namespace attn {

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "float32" || name == "fp32" || name == "f32") return DType::kF32;
  if (name == "float16" || name == "fp16" || name == "f16" || name == "half") return DType::kF16;
  if (name == "bfloat16" || name == "bf16") return DType::kBF16;
  return absl::InvalidArgumentError(absl::StrCat("dtype: unknown '", std::string(name),
                                                 "' (expected float32, float16 or bfloat16)"));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13));  // Inf / NaN
  if (exp != 0) return BitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return BitsToFloat(sign);
  // Subnormal half: normalise into a float.
  int e = -1;
  do {
    mant <<= 1;
    ++e;
  } while ((mant & 0x400u) == 0);
  return BitsToFloat(sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3ffu) << 13));
}

uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow to Inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): shift the implicit-one mantissa into place, round to even.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 .. 24
    uint32_t half_m = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_m & 1u))) ++half_m;
    return sign | static_cast<uint16_t>(half_m);
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even at bit 13
  r -= 112u << 23;
  return sign | static_cast<uint16_t>(r >> 13);
}

namespace {

#if defined(ATTN_HAVE_F16C_DISPATCH)
// IEEE conversions in hardware: round to nearest even, subnormals, overflow to Inf, as the
// scalar code; FloatToHalf's NaN (quiet bit set, top payload bits kept) matches bit for bit.
__attribute__((target("avx,f16c"))) void HalfToFloatRowF16C(const uint16_t* in, float* out,
                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

__attribute__((target("avx,f16c"))) void FloatToHalfRowF16C(const float* in, uint16_t* out,
                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

// CPUID leaf 1 says whether the CPU has AVX and F16C, XGETBV whether the OS saves the YMM
// registers. (GCC's __builtin_cpu_supports knows "f16c", clang 14's does not.)
bool CpuHasF16C() {
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
    if ((ecx & bit_AVX) == 0 || (ecx & bit_OSXSAVE) == 0 || (ecx & bit_F16C) == 0) return false;
    unsigned xcr0_lo = 0, xcr0_hi = 0;
    __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    return (xcr0_lo & 0x6u) == 0x6u;  // XMM and YMM state
  }();
  return has;
}
#endif

}  // namespace

void HalfToFloatRow(const uint16_t* in, float* out, int64_t n) {
#if defined(ATTN_HAVE_F16C_DISPATCH)
  if (CpuHasF16C()) return HalfToFloatRowF16C(in, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

void FloatToHalfRow(const float* in, uint16_t* out, int64_t n) {
#if defined(ATTN_HAVE_F16C_DISPATCH)
  if (CpuHasF16C()) return FloatToHalfRowF16C(in, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

}  // namespace attn
