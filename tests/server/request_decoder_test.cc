// Unit tests of the request decoder: layouts, and errors that name the field.
#include "server/request_decoder.h"

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

}  // namespace
}  // namespace attnserve
