// A small deterministic generator for weight initialisation and synthetic data: SplitMix64
// (Steele, Lea & Flood), the same stream on every platform and standard library, so that a job
// resumed elsewhere draws exactly what it would have drawn.
#pragma once

#include <cmath>
#include <cstdint>

namespace attn::layers {

class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  // A generator for stream `stream` of `seed` (e.g. one per training step).
  Random(uint64_t seed, uint64_t stream) : state_(Mix(seed ^ Mix(stream + 0x632be59bd9b4e019))) {}

  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15);
    return Mix(z);
  }
  // Uniform in [0, n).
  uint64_t Below(uint64_t n) { return n == 0 ? 0 : Next() % n; }
  // Uniform in [0, 1).
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // Standard normal (Box-Muller; one draw per call keeps the stream simple to replay).
  double Normal() {
    const double u1 = 1.0 - Uniform();  // (0, 1]
    const double u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static uint64_t Mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
    z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
    return z ^ (z >> 31);
  }
  uint64_t state_;
};

}  // namespace attn::layers
