#include "server/config.h"

#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "server/device_pool.h"

namespace attnserve {
namespace {

TEST(Config, DefaultsAreValid) { EXPECT_TRUE(Config().Validate().ok()); }

TEST(Config, GpuWaitAcceptsTheThreeWays) {
  for (const char* name : {"spin", "yield", "block"}) {
    Config c;
    c.gpu_wait = name;
    EXPECT_TRUE(c.Validate().ok()) << name;
  }
  EXPECT_EQ(*ParseDeviceWait("spin"), DeviceWait::kSpin);
  EXPECT_EQ(*ParseDeviceWait("yield"), DeviceWait::kYield);
  EXPECT_EQ(*ParseDeviceWait("block"), DeviceWait::kBlock);
}

TEST(Config, UnknownGpuWaitIsRejectedNamingTheFlag) {
  Config c;
  c.gpu_wait = "sleep";
  const absl::Status s = c.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "--gpu_wait=sleep: must be spin, yield or block");
}

TEST(Config, OutOfRangeFlagsAreNamed) {
  Config lanes;
  lanes.lanes_per_device = 17;
  EXPECT_EQ(lanes.Validate().message(), "--lanes_per_device=17: must be in [0, 16]");
  Config streams;
  streams.stream_threads = -1;
  EXPECT_EQ(streams.Validate().message(), "--stream_threads=-1: must be in [0, 64]");
  Config batch;
  batch.max_batch_requests = 0;
  EXPECT_EQ(batch.Validate().message(), "--max_batch_requests=0: must be >= 1");
  Config tls;
  tls.tls_cert_file = "cert.pem";
  EXPECT_EQ(tls.Validate().message(), "--tls_cert_file and --tls_key_file: give both or neither");
}

}  // namespace
}  // namespace attnserve
