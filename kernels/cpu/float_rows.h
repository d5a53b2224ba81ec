// Converting rows of [token, head, head_dim] tensors between their storage dtype and the float /
// double working precision of the CPU engines. The dtype switch sits outside the loop so each
// case is a plain loop the compiler can vectorise; half precision goes through the row
// conversions of attn/dtype.h (F16C when the CPU has it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attn/dtype.h"

namespace attn::cpu {

// out[c] = element (offset + c) of base, for c in [0, n).
template <typename T>
inline void LoadRow(const void* base, DType t, int64_t offset, int n, T* out) {
  switch (t) {
    case DType::kF32: {
      const float* src = static_cast<const float*>(base) + offset;
      for (int c = 0; c < n; ++c) out[c] = static_cast<T>(src[c]);
      return;
    }
    case DType::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      if constexpr (std::is_same_v<T, float>) {
        HalfToFloatRow(src, out, n);
      } else {
        for (int c = 0; c < n; ++c) out[c] = static_cast<T>(HalfToFloat(src[c]));
      }
      return;
    }
    case DType::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int c = 0; c < n; ++c) out[c] = static_cast<T>(BF16ToFloat(src[c]));
      return;
    }
  }
}

// Element (offset + c) of base = in[c] * factor, rounded (through float) to the dtype.
template <typename T>
inline void StoreRow(void* base, DType t, int64_t offset, int n, const T* in, T factor = T{1}) {
  switch (t) {
    case DType::kF32: {
      float* dst = static_cast<float*>(base) + offset;
      for (int c = 0; c < n; ++c) dst[c] = static_cast<float>(in[c] * factor);
      return;
    }
    case DType::kF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      if constexpr (std::is_same_v<T, float>) {
        if (factor == 1.f) {
          FloatToHalfRow(in, dst, n);
          return;
        }
        float scaled[64];  // the products, rounded once to half as in the element loop
        for (int c0 = 0; c0 < n; c0 += 64) {
          const int len = std::min(64, n - c0);
          for (int c = 0; c < len; ++c) scaled[c] = in[c0 + c] * factor;
          FloatToHalfRow(scaled, dst + c0, len);
        }
      } else {
        for (int c = 0; c < n; ++c) dst[c] = FloatToHalf(static_cast<float>(in[c] * factor));
      }
      return;
    }
    case DType::kBF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int c = 0; c < n; ++c) dst[c] = FloatToBF16(static_cast<float>(in[c] * factor));
      return;
    }
  }
}

// Writes n zeros of the dtype.
inline void StoreZeroRow(void* base, DType t, int64_t offset, int n) {
  char* dst = static_cast<char*>(base) + offset * DTypeSize(t);
  for (int64_t i = 0; i < n * DTypeSize(t); ++i) dst[i] = 0;
}

}  // namespace attn::cpu
