// Storage element types of attention tensors and portable scalar conversions.
//
// Accumulation is always float32; fp16 and bf16 are storage formats only. The conversions here
// are bit-exact IEEE round-to-nearest-even so that CPU engines see exactly the values a GPU
// would load, on any host compiler.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/statusor.h"

namespace attn {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr int64_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }

constexpr std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
  }
  return "unknown";
}

// Accepts "float32"/"fp32"/"f32", "float16"/"fp16"/"f16"/"half", "bfloat16"/"bf16".
absl::StatusOr<DType> ParseDType(std::string_view name);

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float BF16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBF16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);

// Whole rows: the same values as HalfToFloat / FloatToHalf element by element (a NaN stays a
// NaN; its payload bits may differ), with the CPU's F16C instructions when it has them. The
// scalar functions cost the CPU engines ~45% of an fp16 problem's time (perf, N = 64).
void HalfToFloatRow(const uint16_t* in, float* out, int64_t n);
void FloatToHalfRow(const float* in, uint16_t* out, int64_t n);

// Reads element i of a buffer of the given dtype as float.
inline float LoadAsFloat(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kF16:
      return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kBF16:
      return BF16ToFloat(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.f;
}

// Rounds v to the dtype and stores it as element i.
inline void StoreFromFloat(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(base)[i] = v;
      return;
    case DType::kF16:
      static_cast<uint16_t*>(base)[i] = FloatToHalf(v);
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[i] = FloatToBF16(v);
      return;
  }
}

// Rounds a float to the nearest value representable in the dtype.
inline float RoundToDType(float v, DType t) {
  switch (t) {
    case DType::kF32:
      return v;
    case DType::kF16:
      return HalfToFloat(FloatToHalf(v));
    case DType::kBF16:
      return BF16ToFloat(FloatToBF16(v));
  }
  return v;
}

}  // namespace attn
