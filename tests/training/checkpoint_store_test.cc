// The checkpoint store on a real filesystem: records round-trip, a reader refuses what is not a
// whole record of its version, a write that fails (here a temporary file that is /dev/full:
// ENOSPC, as a full disk gives) leaves the previous record intact, the disk limit, stale
// temporary files, and a corrupt folder skipped at load.
#include "server/training/checkpoint_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"

namespace attnserve::training {
namespace {

class CheckpointStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir_template[] = "/tmp/attnserve_checkpoints_XXXXXX";
    dir_ = mkdtemp(dir_template);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static JobRecord Record(const std::string& id, int64_t step) {
    JobRecord r;
    r.set_job_id(id);
    r.set_owner("alice");
    r.set_step(step);
    r.set_weights(std::string(4096, static_cast<char>(step)));
    r.mutable_spec()->set_steps(1000);
    return r;
  }

  std::string dir_;
};

TEST_F(CheckpointStoreTest, RecordsRoundTripAndReplaceEachOther) {
  auto store = CheckpointStore::Open(dir_, 0);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->WriteRecord(Record("tj-a", 1)).ok());
  ASSERT_TRUE((*store)->WriteRecord(Record("tj-a", 2)).ok());
  ASSERT_TRUE((*store)->WriteRecord(Record("tj-b", 7)).ok());
  std::vector<std::string> problems;
  std::vector<JobRecord> records = (*store)->LoadAll(&problems);
  EXPECT_TRUE(problems.empty());
  ASSERT_EQ(records.size(), 2u);
  for (const JobRecord& r : records) {
    EXPECT_EQ(r.step(), r.job_id() == "tj-a" ? 2 : 7);
    EXPECT_EQ(r.owner(), "alice");
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/tj-a/job.ckpt.tmp"));
}

TEST_F(CheckpointStoreTest, DecodeRefusesWhatIsNotAWholeRecordOfItsVersion) {
  const std::string good = CheckpointStore::Encode(Record("tj-a", 3));
  ASSERT_TRUE(CheckpointStore::Decode(good, "f").ok());

  std::string bad = good;
  bad[0] = 'X';
  EXPECT_TRUE(
      absl::StrContains(CheckpointStore::Decode(bad, "f").status().message(), "not a job record"));
  bad = good;
  bad[8] = 2;  // format version 2
  const absl::Status newer = CheckpointStore::Decode(bad, "f").status();
  EXPECT_EQ(newer.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(newer.message(), "format version 2; this server reads version 1"));
  bad = good.substr(0, good.size() - 1);
  EXPECT_TRUE(absl::StrContains(CheckpointStore::Decode(bad, "f").status().message(), "expected"));
  bad = good;
  bad[bad.size() - 1] ^= 1;
  EXPECT_TRUE(
      absl::StrContains(CheckpointStore::Decode(bad, "f").status().message(), "CRC mismatch"));
}

TEST_F(CheckpointStoreTest, AFailedWriteLeavesThePreviousRecord) {
  auto store = CheckpointStore::Open(dir_, 0);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->WriteRecord(Record("tj-a", 5)).ok());
  // The next write's temporary file is /dev/full: every write to it fails with ENOSPC.
  ASSERT_EQ(symlink("/dev/full", (dir_ + "/tj-a/job.ckpt.tmp").c_str()), 0);
  const absl::Status full = (*store)->WriteRecord(Record("tj-a", 6)).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_TRUE(absl::StrContains(full.message(), "No space left on device")) << full;
  EXPECT_TRUE(absl::StrContains(full.message(), "the training disk is full")) << full;
  std::vector<std::string> problems;
  std::vector<JobRecord> records = (*store)->LoadAll(&problems);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].step(), 5);  // the old record, whole
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/tj-a/job.ckpt.tmp"));
  ASSERT_TRUE((*store)->WriteRecord(Record("tj-a", 6)).ok());  // and the disk is back
}

TEST_F(CheckpointStoreTest, TheDiskLimitFailsAWriteAsAFullDiskWould) {
  const int64_t one = static_cast<int64_t>(CheckpointStore::Encode(Record("tj-a", 1)).size());
  auto store = CheckpointStore::Open(dir_, 2 * one + one / 2);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->WriteRecord(Record("tj-a", 1)).ok());
  ASSERT_TRUE((*store)->WriteRecord(Record("tj-a", 2)).ok());  // a replacement takes no more
  ASSERT_TRUE((*store)->WriteRecord(Record("tj-b", 1)).ok());
  const absl::Status over = (*store)->WriteRecord(Record("tj-c", 1)).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(over.message(), "--training_disk_limit_bytes")) << over;
  // Reopened, the store counts what is already there.
  store->reset();
  auto reopened = CheckpointStore::Open(dir_, 2 * one + one / 2);
  ASSERT_TRUE(reopened.ok());
  EXPECT_FALSE((*reopened)->WriteRecord(Record("tj-c", 1)).ok());
}

TEST_F(CheckpointStoreTest, OpenRemovesStaleTemporariesAndLoadSkipsCorruptRecords) {
  {
    auto store = CheckpointStore::Open(dir_, 0);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->WriteRecord(Record("tj-a", 1)).ok());
    ASSERT_TRUE((*store)->WriteRecord(Record("tj-b", 1)).ok());
  }
  std::ofstream(dir_ + "/tj-a/job.ckpt.tmp") << "half a write";
  std::ofstream(dir_ + "/tj-b/job.ckpt", std::ios::binary) << "not a record";
  auto store = CheckpointStore::Open(dir_, 0);
  ASSERT_TRUE(store.ok());
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/tj-a/job.ckpt.tmp"));
  std::vector<std::string> problems;
  std::vector<JobRecord> records = (*store)->LoadAll(&problems);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].job_id(), "tj-a");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_TRUE(absl::StrContains(problems[0], "tj-b/job.ckpt': not a job record")) << problems[0];
}

}  // namespace
}  // namespace attnserve::training
