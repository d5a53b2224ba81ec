#include "proto/wire/channel_args.h"

#include <gtest/gtest.h>

namespace attnserve {
namespace {

TEST(ChannelArgs, IntegersStayIntegersAndTheRestAreStrings) {
  absl::StatusOr<std::vector<ChannelArg>> args = ParseChannelArgs(
      {"grpc.http2.max_frame_size=1048576", "grpc.primary_user_agent=bench/1", "x.empty="},
      "grpc_arg");
  ASSERT_TRUE(args.ok()) << args.status();
  ASSERT_EQ(args->size(), 3u);
  EXPECT_EQ((*args)[0].name, "grpc.http2.max_frame_size");
  EXPECT_EQ(std::get<int>((*args)[0].value), 1048576);
  EXPECT_EQ(std::get<std::string>((*args)[1].value), "bench/1");
  EXPECT_EQ(std::get<std::string>((*args)[2].value), "");
}

TEST(ChannelArgs, AValueTooLargeForAnIntIsAString) {
  absl::StatusOr<std::vector<ChannelArg>> args = ParseChannelArgs({"a=99999999999"}, "grpc_arg");
  ASSERT_TRUE(args.ok());
  EXPECT_TRUE(std::holds_alternative<std::string>((*args)[0].value));
}

TEST(ChannelArgs, MalformedSpecsNameTheFlagAndTheSpec) {
  for (const char* bad : {"no_equals_sign", "=1"}) {
    absl::StatusOr<std::vector<ChannelArg>> args = ParseChannelArgs({bad}, "grpc_arg");
    ASSERT_FALSE(args.ok()) << bad;
    EXPECT_EQ(args.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(args.status().message().find("--grpc_arg"), std::string::npos);
    EXPECT_NE(args.status().message().find(bad), std::string::npos);
  }
}

}  // namespace
}  // namespace attnserve
