// The FP8 forward (cuda/fused/fp8_forward.h) against a float64 reference on the very e4m3
// values it read: 16-bit inputs go through PrepareFp8Forward, the quantized tensors and scales
// come back from the device and are decoded here, so the comparison sees the kernel's own error
// (P rounded to e4m3, the products' accumulation, O rounded to bf16) and not the inputs'.
// Scores are peaked (inputs of standard deviation 2) in some cases, so that P V differs between
// keys and a wrong key order in the transposed V shows. Skips off Hopper.
#include "cuda/fused/fp8_forward.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/mask.h"
#include "common/host_tensor.h"
#include "cuda/common/device_buffer.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"

namespace attn::testing {
namespace {

double DecodeE4m3(uint8_t b) {
  const int exponent = (b >> 3) & 15;
  const int mantissa = b & 7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude =
      exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(8 + mantissa, exponent - 10);
  return (b & 0x80) ? -magnitude : magnitude;
}

struct Fp8Case {
  std::string name;
  DType dtype;
  int batch;
  int64_t seqlen_q, seqlen_k;
  int heads, kv_heads;
  bool causal = false;
  int window_left = -1, window_right = -1;
  float stddev = 1.f;
  int persistent_ctas = 0;  // 0: one an SM
  int head_dim = 128;
};

std::ostream& operator<<(std::ostream& os, const Fp8Case& c) { return os << c.name; }

std::vector<uint8_t> Download(const void* device, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  EXPECT_EQ(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

absl::StatusOr<cuda::DeviceBuffer> Upload(const void* host, size_t bytes) {
  absl::StatusOr<cuda::DeviceBuffer> buffer = cuda::DeviceBuffer::Allocate(bytes);
  if (buffer.ok() && bytes > 0 &&
      cudaMemcpy(buffer->get(), host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
    return absl::InternalError("cudaMemcpy to the device");
  }
  return buffer;
}

class Fp8ForwardTest : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(Fp8ForwardTest, MatchesFloat64ReferenceOnItsE4m3Inputs) {
  ATTN_SKIP_WITHOUT_CUDA();
  const Fp8Case& c = GetParam();
  const int kHeadDim = c.head_dim;
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const int64_t total_q = c.batch * c.seqlen_q;
  const int64_t total_k = c.batch * c.seqlen_k;
  // Padded strides: the quantizer reads through them.
  HostTensor q(c.dtype, total_q, c.heads, kHeadDim, 8, 16);
  HostTensor k(c.dtype, total_k, c.kv_heads, kHeadDim, 8, 16);
  HostTensor v(c.dtype, total_k, c.kv_heads, kHeadDim, 8, 16);
  q.FillRandom(seed, c.stddev);
  k.FillRandom(seed + 1, c.stddev);
  v.FillRandom(seed + 2);
  HostTensor o(DType::kBF16, total_q, c.heads, kHeadDim);
  o.Poison();
  std::vector<float> lse(c.heads * total_q);
  PoisonFloats(lse);

  auto d_q = Upload(q.data(), q.size_bytes());
  auto d_k = Upload(k.data(), k.size_bytes());
  auto d_v = Upload(v.data(), v.size_bytes());
  auto d_o = Upload(o.data(), o.size_bytes());
  auto d_lse = Upload(lse.data(), lse.size() * sizeof(float));
  const int zeros[2] = {0, 0};
  auto d_counters = Upload(zeros, sizeof(zeros));
  ASSERT_TRUE(d_q.ok() && d_k.ok() && d_v.ok() && d_o.ok() && d_lse.ok() && d_counters.ok());

  cuda::FusedForwardParams p;
  p.q = d_q->get();
  p.k = d_k->get();
  p.v = d_v->get();
  p.o = d_o->get();
  p.lse = d_lse->as<float>();
  p.q_token_stride = q.token_stride();
  p.q_head_stride = q.head_stride();
  p.k_token_stride = k.token_stride();
  p.k_head_stride = k.head_stride();
  p.v_token_stride = v.token_stride();
  p.v_head_stride = v.head_stride();
  p.o_token_stride = o.token_stride();
  p.o_head_stride = o.head_stride();
  p.total_q = total_q;
  p.total_k = total_k;
  p.seqlen_q = p.max_seqlen_q = c.seqlen_q;
  p.seqlen_k = c.seqlen_k;
  p.batch = c.batch;
  p.num_heads = c.heads;
  p.num_kv_heads = c.kv_heads;
  p.head_dim = kHeadDim;
  p.scale = 1.f / std::sqrt(static_cast<float>(kHeadDim));
  p.window_left = c.window_left;
  p.window_right = c.causal ? 0 : c.window_right;
  p.dtype = c.dtype;
  p.persistent_ctas = c.persistent_ctas;
  p.tile_counters = d_counters->as<int>();

  const int64_t workspace_bytes = cuda::Fp8ForwardWorkspaceBytes(p);
  auto workspace = cuda::DeviceBuffer::Allocate(workspace_bytes);
  ASSERT_TRUE(workspace.ok()) << workspace.status();
  cuda::Fp8ForwardParams fp8;
  ASSERT_TRUE(cuda::PrepareFp8Forward(p, workspace->get(), workspace_bytes, &fp8, nullptr).ok());
  const absl::Status launched = cuda::LaunchFp8Forward(fp8, nullptr);
  if (absl::IsUnimplemented(launched)) GTEST_SKIP() << launched;
  ASSERT_TRUE(launched.ok()) << launched;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  ASSERT_EQ(cudaMemcpy(o.data(), d_o->get(), o.size_bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(lse.data(), d_lse->get(), lse.size() * sizeof(float), cudaMemcpyDeviceToHost),
      cudaSuccess);
  float descale[3];
  ASSERT_EQ(cudaMemcpy(descale, fp8.descale, sizeof(descale), cudaMemcpyDeviceToHost), cudaSuccess);
  const int64_t row_keys = cuda::Fp8ValueRowKeys(c.seqlen_k);
  const std::vector<uint8_t> q8 = Download(fp8.p.q, total_q * c.heads * kHeadDim);
  const std::vector<uint8_t> k8 = Download(fp8.p.k, total_k * c.kv_heads * kHeadDim);
  const std::vector<uint8_t> v8 =
      Download(fp8.p.v, int64_t{c.batch} * c.kv_heads * kHeadDim * row_keys);
  int slot_of_key[16];
  for (int slot = 0; slot < 16; ++slot) slot_of_key[cuda::Fp8ValueSlotKey(slot)] = slot;
  // What the kernel read, as float64: Q and K packed, V back in [token][kv head][column] order.
  std::vector<double> q_read(q8.size()), k_read(k8.size()), v_read(k8.size());
  for (size_t i = 0; i < q8.size(); ++i) q_read[i] = DecodeE4m3(q8[i]) * descale[0];
  for (size_t i = 0; i < k8.size(); ++i) k_read[i] = DecodeE4m3(k8[i]) * descale[1];
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.kv_heads; ++h) {
      for (int d = 0; d < kHeadDim; ++d) {
        const uint8_t* row = &v8[((int64_t{b} * c.kv_heads + h) * kHeadDim + d) * row_keys];
        for (int64_t j = 0; j < c.seqlen_k; ++j) {
          v_read[((b * c.seqlen_k + j) * c.kv_heads + h) * kHeadDim + d] =
              DecodeE4m3(row[j / 16 * 16 + slot_of_key[j % 16]]) * descale[2];
        }
      }
    }
  }

  // The quantization: one scale per tensor from its largest magnitude, each element within half
  // an e4m3 step of real / descale (relative 2^-4; 2^-10 absolute among the subnormals).
  const HostTensor* inputs[3] = {&q, &k, &v};
  for (int t = 0; t < 3; ++t) {
    double amax = 0;
    for (double x : inputs[t]->ToDouble()) amax = std::max(amax, std::abs(x));
    EXPECT_FLOAT_EQ(descale[t], amax > 0 ? static_cast<float>(amax) / cuda::kE4m3Max : 1.f) << t;
  }
  const auto read_v = [&](int b, int64_t key, int head, int column) {
    return v_read[((b * c.seqlen_k + key) * c.kv_heads + head) * kHeadDim + column];
  };
  int64_t bad_inputs = 0;
  const auto check_input = [&](double got, double real, float descale_t) {
    if (!(std::abs(got - real) <= std::abs(real) / 16 + descale_t * 0x1p-10)) ++bad_inputs;
  };
  for (int64_t token = 0; token < total_q; ++token) {
    for (int h = 0; h < c.heads; ++h) {
      for (int d = 0; d < kHeadDim; ++d) {
        check_input(q_read[(token * c.heads + h) * kHeadDim + d], q.Get(token, h, d), descale[0]);
      }
    }
  }
  for (int64_t token = 0; token < total_k; ++token) {
    for (int h = 0; h < c.kv_heads; ++h) {
      for (int d = 0; d < kHeadDim; ++d) {
        const int64_t i = (token * c.kv_heads + h) * kHeadDim + d;
        check_input(k_read[i], k.Get(token, h, d), descale[1]);
        check_input(v_read[i], v.Get(token, h, d), descale[2]);
      }
    }
  }
  EXPECT_EQ(bad_inputs, 0) << "quantized Q, K or V elements off by more than half an e4m3 step";

  // The forward: per element, |O - ref| within 2^-4 of sum_j P_j |V_j| / l (every P rounded by
  // at most half an e4m3 step) plus O's bf16 rounding, plus what the scores' error makes of P.
  // The e4m3 tensor cores keep about 14 bits of each k32 step's sum (DeepSeek-V3's report on the
  // H800), so a score is off by up to some 2^-12 of scale x sum_d |q_d k_d|; the bound takes
  // 2^-11 of the row's largest such sum, for the scores and for the LSE (from unrounded
  // statistics otherwise).
  const double scale = p.scale;
  const int group = c.heads / c.kv_heads;
  const double v_max = descale[2] * cuda::kE4m3Max;
  int64_t bad_o = 0, bad_lse = 0, poisoned = o.CountPoisoned();
  double worst = 0;      // the largest |O - ref| / tolerance
  double worst_lse = 0;  // the largest |LSE - ref| / tolerance
  std::vector<double> score(c.seqlen_k);
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.heads; ++h) {
      const int kv = h / group;
      for (int64_t i = 0; i < c.seqlen_q; ++i) {
        const int64_t token = b * c.seqlen_q + i;
        const KeyRange keys = VisibleKeys(i, c.seqlen_q, c.seqlen_k, p.window_left, p.window_right);
        const int64_t visible = std::max<int64_t>(0, keys.end - keys.begin);
        double m = -std::numeric_limits<double>::infinity();
        double magnitude = 0;  // the largest scale x sum_d |q_d k_d| of the row
        for (int64_t j = keys.begin; j < keys.end; ++j) {
          const double* q_row = &q_read[(token * c.heads + h) * kHeadDim];
          const double* k_row = &k_read[((b * c.seqlen_k + j) * c.kv_heads + kv) * kHeadDim];
          double dot = 0, absolute = 0;
          for (int d = 0; d < kHeadDim; ++d) {
            dot += q_row[d] * k_row[d];
            absolute += std::abs(q_row[d] * k_row[d]);
          }
          score[j] = dot * scale;
          m = std::max(m, score[j]);
          magnitude = std::max(magnitude, absolute * scale);
        }
        const double score_error = magnitude * 0x1p-11;
        double l = 0;
        for (int64_t j = keys.begin; j < keys.end; ++j) l += std::exp(score[j] - m);
        for (int d = 0; d < kHeadDim; ++d) {
          double ref = 0, spread = 0;
          for (int64_t j = keys.begin; j < keys.end; ++j) {
            const double weight = std::exp(score[j] - m) / l;
            const double value = read_v(b, j, kv, d);
            ref += weight * value;
            spread += weight * std::abs(value);
          }
          // Probabilities under e4m3's normals (P 2^8 < 2^-6) are rounded by up to 2^-10 / 2^8
          // of l each, whatever their size.
          const double tolerance = spread / 16 + std::abs(ref) / 128 + 2 * score_error * spread +
                                   visible * 0x1p-18 * v_max + 1e-6;
          const double error = std::abs(o.Get(token, h, d) - ref);
          worst = std::max(worst, error / tolerance);
          if (!(error <= tolerance)) ++bad_o;
        }
        const float got_lse = lse[h * total_q + token];
        if (visible == 0) {
          if (!(std::isinf(got_lse) && got_lse < 0)) ++bad_lse;
        } else {
          const double lse_error = std::abs(got_lse - (m + std::log(l)));
          const double lse_tolerance = score_error + 1e-5 * (1 + std::abs(m));
          worst_lse = std::max(worst_lse, lse_error / lse_tolerance);
          if (!(lse_error <= lse_tolerance)) ++bad_lse;
        }
      }
    }
  }
  EXPECT_EQ(poisoned, 0) << "O elements never written";
  EXPECT_EQ(bad_o, 0) << "O elements outside the tolerance; worst error / tolerance " << worst;
  EXPECT_EQ(bad_lse, 0) << "LSE rows off the reference; worst error / tolerance " << worst_lse;
  RecordProperty("worst_error_over_tolerance", std::to_string(worst));
  RecordProperty("worst_lse_error_over_tolerance", std::to_string(worst_lse));
}

// Sizes that are not multiples of the 128-row, 128-key tiles; GQA and MQA; masks whose rows see
// no key (more queries than keys, causal); a window; the ring of stages wrapping many times on
// a few persistent CTAs; head_dim 128 and 256.
INSTANTIATE_TEST_SUITE_P(
    Fp8, Fp8ForwardTest,
    ::testing::Values(
        Fp8Case{"bf16_square", DType::kBF16, 2, 256, 256, 4, 4},
        Fp8Case{"bf16_peaked_gqa_causal", DType::kBF16, 2, 333, 333, 4, 2, true, -1, -1, 2.f},
        Fp8Case{"fp16_mqa_more_keys_causal", DType::kF16, 1, 77, 1000, 2, 1, true, -1, -1, 2.f},
        Fp8Case{"bf16_more_queries_causal", DType::kBF16, 1, 300, 100, 2, 2, true},
        Fp8Case{"fp16_window", DType::kF16, 2, 300, 300, 2, 2, false, 64, 16, 2.f},
        Fp8Case{"bf16_decode_rows", DType::kBF16, 3, 1, 17, 2, 2},
        Fp8Case{"bf16_no_keys", DType::kBF16, 1, 5, 0, 2, 2},
        Fp8Case{"fp16_long_three_ctas", DType::kF16, 1, 700, 2100, 2, 1, false, -1, -1, 1.5f, 3},
        Fp8Case{"bf16_d256_peaked_gqa_causal", DType::kBF16, 2, 333, 333, 4, 2, true, -1, -1, 2.f,
                0, 256},
        Fp8Case{"fp16_d256_window_three_ctas", DType::kF16, 1, 700, 900, 2, 1, false, 128, 32, 1.5f,
                3, 256},
        Fp8Case{"bf16_d256_more_queries_causal", DType::kBF16, 1, 300, 100, 2, 2, true, -1, -1, 1.f,
                0, 256}),
    [](const ::testing::TestParamInfo<Fp8Case>& info) { return info.param.name; });

// The transposed V's slot order against the two register layouts it joins (PTX ISA, wgmma):
// a thread (lane % 4 = t) holds, of each 8-key tile of the fp32 scores, keys 2t and 2t + 1; of
// an e4m3 A fragment, register pair h (registers 2h and 2h + 1, rows g and g + 8) holds k
// 16h + 4t + b in byte b. PackProbabilities fills byte b of pair h of step ps from score tile
// 4 ps + 2h + b / 2, element b % 2, so slot 16h + 4t + b of the step's 32 keys holds key
// 8 (2h + b / 2) + 2t + b % 2: within each 16, slot c holds Fp8ValueSlotKey(c).
TEST(Fp8ForwardChecks, ValueSlotsFollowTheFragmentLayouts) {
  bool seen[16] = {};
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < 4; ++t) {
      for (int b = 0; b < 4; ++b) {
        const int slot = 16 * h + 4 * t + b;
        const int key = 8 * (2 * h + b / 2) + 2 * t + b % 2;
        EXPECT_EQ(key / 16, slot / 16) << "a key leaves its group of 16: slot " << slot;
        EXPECT_EQ(cuda::Fp8ValueSlotKey(slot % 16), key % 16) << "slot " << slot;
      }
    }
  }
  for (int slot = 0; slot < 16; ++slot) seen[cuda::Fp8ValueSlotKey(slot)] = true;
  for (int key = 0; key < 16; ++key) EXPECT_TRUE(seen[key]) << "no slot holds key " << key;
  EXPECT_EQ(cuda::Fp8ValueRowKeys(0), 16);
  EXPECT_EQ(cuda::Fp8ValueRowKeys(1), 16);
  EXPECT_EQ(cuda::Fp8ValueRowKeys(16), 16);
  EXPECT_EQ(cuda::Fp8ValueRowKeys(17), 32);
}

TEST(Fp8ForwardChecks, RefusesWhatItDoesNotCover) {
  cuda::FusedForwardParams p;
  p.head_dim = 64;
  p.num_heads = p.num_kv_heads = 1;
  cuda::Fp8ForwardParams fp8;
  fp8.p = p;
  EXPECT_TRUE(absl::IsUnimplemented(cuda::LaunchFp8Forward(fp8, nullptr)));
  p.head_dim = 128;
  const int32_t cu[2] = {0, 1};
  p.cu_seqlens_q = p.cu_seqlens_k = cu;
  fp8.p = p;
  EXPECT_TRUE(absl::IsUnimplemented(cuda::LaunchFp8Forward(fp8, nullptr)));
  p.cu_seqlens_q = p.cu_seqlens_k = nullptr;
  p.num_heads = 3;
  p.num_kv_heads = 2;
  fp8.p = p;
  EXPECT_TRUE(absl::IsInvalidArgument(cuda::LaunchFp8Forward(fp8, nullptr)));
  p.num_heads = 2;
  p.dtype = DType::kF32;
  char buffer[64];
  EXPECT_TRUE(absl::IsInvalidArgument(cuda::PrepareFp8Forward(p, buffer, 0, &fp8, nullptr)));
}

}  // namespace
}  // namespace attn::testing
