// Host-side test tensors: owned [tokens, heads, head_dim] buffers of any dtype with optional
// padded strides, filled with fresh random values, poisoned before an engine writes them and
// checked afterwards for elements the engine never wrote.
//
// Typical use (any engine; CUDA tests copy data() to and from the device around the call):
//   const uint64_t seed = attn::testing::FreshSeed();           // print it on failure
//   auto t = attn::testing::AttentionTensors::Make(problem, seed);
//   t.PoisonOutputs();
//   engine->Forward(problem, t.forward_args());
//   EXPECT_EQ(t.o.CountPoisoned(), 0);
#pragma once

#include <cstdint>
#include <vector>

#include "attn/dtype.h"
#include "attn/problem.h"
#include "attn/tensor.h"

namespace attn::testing {

// Bit patterns written by Poison(): NaNs with payloads that arithmetic never produces
// (signalling NaNs; the dtype conversions always return quiet NaNs).
inline constexpr uint32_t kPoisonF32 = 0xffbadbadu;
inline constexpr uint16_t kPoisonF16 = 0x7d5au;
inline constexpr uint16_t kPoisonBF16 = 0x7fabu;

// A seed from std::random_device, or the value of the ATTN_TEST_SEED environment variable when
// it is set (to replay a failure).
uint64_t FreshSeed();

class HostTensor {
 public:
  HostTensor() = default;
  // Packed layout: head_stride = head_dim, token_stride = heads * head_dim.
  HostTensor(DType dtype, int64_t tokens, int heads, int head_dim);
  // Padded layout: `head_pad` unused elements after each head's row and `token_pad` after each
  // token, so engines are exercised with non-packed strides. Padding is never read as data.
  HostTensor(DType dtype, int64_t tokens, int heads, int head_dim, int head_pad, int token_pad);

  DType dtype() const { return dtype_; }
  int64_t tokens() const { return tokens_; }
  int heads() const { return heads_; }
  int head_dim() const { return head_dim_; }
  int64_t token_stride() const { return token_stride_; }
  int64_t head_stride() const { return head_stride_; }
  int64_t num_elements() const { return tokens_ * heads_ * head_dim_; }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  // Size of the whole allocation, padding included (what a device copy must transfer).
  size_t size_bytes() const { return bytes_.size(); }

  TensorRef ref() const;
  MutableTensorRef mutable_ref();

  float Get(int64_t token, int head, int c) const;
  // Stores v rounded to the dtype.
  void Set(int64_t token, int head, int c, float v);

  // Independent normal(0, stddev) values, rounded to the dtype (so the stored value is exact).
  void FillRandom(uint64_t seed, float stddev = 1.f);
  // Writes the dtype's poison pattern into every element, padding included.
  void Poison();
  // Elements of the view that still hold the poison pattern (0 after a complete write).
  int64_t CountPoisoned() const;
  // Padding elements that no longer hold the poison pattern (0 when nothing wrote outside the
  // view).
  int64_t CountPaddingWritten() const;

  // The view's values as float64, packed [tokens][heads][head_dim].
  std::vector<double> ToDouble() const;
  // A packed copy in another dtype (values rounded to it).
  HostTensor ConvertTo(DType dtype) const;

 private:
  int64_t ElementIndex(int64_t token, int head, int c) const {
    return token * token_stride_ + head * head_stride_ + c;
  }
  bool IsPoison(int64_t element) const;

  DType dtype_ = DType::kF32;
  int64_t tokens_ = 0;
  int heads_ = 0, head_dim_ = 0;
  int64_t head_stride_ = 0, token_stride_ = 0;
  std::vector<uint8_t> bytes_;
};

// Float LSE buffers: poison with kPoisonF32, count what is left.
void PoisonFloats(std::vector<float>& v);
int64_t CountPoisonedFloats(const std::vector<float>& v);

// Every tensor of a forward + backward call for one problem, inputs (q, k, v, d_o) random.
struct AttentionTensors {
  // `padded` gives every tensor padded strides (see HostTensor).
  static AttentionTensors Make(const AttentionProblem& p, uint64_t seed, bool padded = false);

  // Poisons o, lse, dq, dk, dv.
  void PoisonOutputs();
  ForwardArgs forward_args();
  // Uses o and lse as the forward results.
  BackwardArgs backward_args();

  HostTensor q, k, v, o, d_o, dq, dk, dv;
  std::vector<float> lse;  // [num_heads, total_q]
};

}  // namespace attn::testing
