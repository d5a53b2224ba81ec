// Unit tests of the request decoder: layouts, and errors that name the field.
#include "proto/wire/request_decoder.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "clients/cli/request_factory.h"

namespace attnserve {
namespace {

client::ShapeSpec Spec(int batch, int lq, int lk, int h, int hkv, int d, bool varlen) {
  client::ShapeSpec s;
  s.batch = batch;
  s.seqlen_q = lq;
  s.seqlen_k = lk;
  s.num_heads = h;
  s.num_kv_heads = hkv;
  s.head_dim = d;
  s.varlen = varlen;
  return s;
}

TEST(RequestDecoder, DenseLayoutBecomesUniformVarlen) {
  const v1::AttendRequest r = client::MakeRandomRequest(Spec(3, 5, 7, 8, 2, 32, false), 1);
  auto d = DecodeAttendRequest(r, {});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->problem.batch(), 3);
  EXPECT_EQ(d->problem.total_q(), 15);
  EXPECT_EQ(d->problem.total_k(), 21);
  EXPECT_EQ(d->problem.num_heads, 8);
  EXPECT_EQ(d->problem.num_kv_heads, 2);
  EXPECT_EQ(d->problem.head_dim, 32);
  EXPECT_EQ(d->q, r.q().data().data());
  EXPECT_EQ(d->o_shape, (std::vector<int64_t>{3, 5, 8, 32}));
}

TEST(RequestDecoder, VarlenLayoutKeepsCuSeqlens) {
  const v1::AttendRequest r = client::MakeRandomRequest(Spec(4, 9, 9, 4, 4, 16, true), 2);
  auto d = DecodeAttendRequest(r, {});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->problem.batch(), 4);
  EXPECT_EQ(d->problem.cu_seqlens_q.back(), r.q().shape(0));
}

TEST(RequestDecoder, ThreeDimensionalWithoutCuSeqlensIsOneSequence) {
  v1::AttendRequest r = client::MakeRandomRequest(Spec(1, 6, 10, 2, 1, 8, true), 3);
  r.clear_cu_seqlens_q();
  r.clear_cu_seqlens_k();
  auto d = DecodeAttendRequest(r, {});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->problem.batch(), 1);
}

TEST(RequestDecoder, ErrorsNameTheField) {
  const v1::AttendRequest good = client::MakeRandomRequest(Spec(2, 4, 4, 4, 2, 16, false), 4);
  auto expect = [&](v1::AttendRequest r, const char* field, absl::StatusCode code) {
    auto d = DecodeAttendRequest(r, {});
    ASSERT_FALSE(d.ok()) << field;
    EXPECT_EQ(d.status().code(), code) << d.status();
    EXPECT_TRUE(absl::StartsWith(d.status().message(), field)) << d.status();
  };
  v1::AttendRequest r = good;
  r.clear_v();
  expect(r, "v:", absl::StatusCode::kInvalidArgument);
  r = good;
  r.mutable_k()->set_shape(0, 3);
  expect(r, "k.data", absl::StatusCode::kInvalidArgument);
  r = good;
  r.mutable_q()->set_shape(3, 300);
  r.mutable_q()->mutable_data()->resize(2 * 4 * 4 * 300 * 4);
  expect(r, "k.shape[3]", absl::StatusCode::kInvalidArgument);
  r = good;
  r.add_cu_seqlens_q(0);
  expect(r, "cu_seqlens_q", absl::StatusCode::kInvalidArgument);
  r = good;
  r.mutable_q()->set_shape(0, int64_t{1} << 40);
  expect(r, "q.shape[0]", absl::StatusCode::kInvalidArgument);
  DecodeLimits tiny;
  tiny.memory_limit_bytes = 1024;
  auto d = DecodeAttendRequest(good, tiny);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
}

// Every count a request names is bounded, so the work it causes follows the bytes it carries.
TEST(RequestDecoder, CountsTheClientNamesAreBounded) {
  DecodeLimits limits;
  limits.max_heads = 16;
  limits.max_sequences = 8;
  auto expect = [&](const v1::AttendRequest& r, const char* field) {
    auto d = DecodeAttendRequest(r, limits);
    ASSERT_FALSE(d.ok()) << field;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
    EXPECT_TRUE(absl::StartsWith(d.status().message(), field)) << d.status();
  };
  EXPECT_TRUE(
      DecodeAttendRequest(client::MakeRandomRequest(Spec(8, 2, 2, 16, 4, 8, false), 5), limits)
          .ok());
  expect(client::MakeRandomRequest(Spec(1, 2, 2, 17, 1, 8, false), 6), "q.shape");
  expect(client::MakeRandomRequest(Spec(9, 2, 2, 2, 1, 8, false), 7), "q.shape[0]");
  v1::AttendRequest varlen = client::MakeRandomRequest(Spec(8, 4, 4, 2, 1, 8, true), 8);
  EXPECT_TRUE(DecodeAttendRequest(varlen, limits).ok());
  varlen.add_cu_seqlens_q(varlen.cu_seqlens_q(varlen.cu_seqlens_q_size() - 1));
  varlen.add_cu_seqlens_k(varlen.cu_seqlens_k(varlen.cu_seqlens_k_size() - 1));
  expect(varlen, "cu_seqlens_q");  // nine sequences (one empty) in the index
  // 2^31 - 1 heads of nothing: refused on the count, not after looping over it.
  v1::AttendRequest empty;
  for (v1::Tensor* t : {empty.mutable_q(), empty.mutable_k(), empty.mutable_v()}) {
    t->set_dtype(v1::DTYPE_FLOAT32);
    for (int64_t d : {int64_t{0}, int64_t{2147483647}, int64_t{1}}) t->add_shape(d);
  }
  empty.set_return_lse(true);
  expect(empty, "q.shape");
  // The sequence index counts against the memory limit: a million empty sequences do not fit
  // in a limit that their tensors (no bytes at all) would.
  DecodeLimits small;
  small.memory_limit_bytes = 1 << 20;
  small.max_sequences = 1 << 20;
  v1::AttendRequest many;
  for (v1::Tensor* t : {many.mutable_q(), many.mutable_k(), many.mutable_v()}) {
    t->set_dtype(v1::DTYPE_FLOAT32);
    for (int64_t d : {int64_t{1} << 19, int64_t{0}, int64_t{1}, int64_t{8}}) t->add_shape(d);
  }
  EXPECT_EQ(DecodeAttendRequest(many, small).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(RequestDecoder, WindowSidesAreKeysOrMinusOne) {
  v1::AttendRequest r = client::MakeRandomRequest(Spec(1, 4, 4, 2, 1, 8, false), 9);
  r.set_window_left(-1);
  r.set_window_right(0);
  EXPECT_TRUE(DecodeAttendRequest(r, {}).ok());
  r.set_window_left(-5);
  auto d = DecodeAttendRequest(r, {});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(d.status().message(), "window_left")) << d.status();
  r.set_window_left(3);
  r.set_window_right(-2);
  d = DecodeAttendRequest(r, {});
  EXPECT_TRUE(absl::StartsWith(d.status().message(), "window_right")) << d.status();
}

}  // namespace
}  // namespace attnserve
