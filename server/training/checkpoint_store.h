// Job records and uploaded tensors on disk under --training_dir, one folder per job. Every write
// goes to a temporary file that is flushed (fsync) and renamed over the old one, and the folder
// is flushed after, so a crash (kill -9, power) leaves the previous complete file or the new
// one, never a torn one. Writes fail with a Status naming the file and the OS error (a full
// disk is ENOSPC); a disk limit (--training_disk_limit_bytes) fails them the same way before
// the disk itself fills. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/training/checkpoint.pb.h"

namespace attnserve::training {

inline constexpr uint32_t kFormatVersion = 1;

struct WriteResult {
  int64_t bytes = 0;
  absl::Duration duration;
};

class CheckpointStore {
 public:
  // Creates `dir` when missing. limit_bytes 0: no limit but the disk's.
  static absl::StatusOr<std::unique_ptr<CheckpointStore>> Open(const std::string& dir,
                                                               int64_t limit_bytes);

  const std::string& dir() const { return dir_; }

  // Replaces the job's record.
  absl::StatusOr<WriteResult> WriteRecord(const JobRecord& record);
  // Writes one uploaded tensor ("inputs" or "targets") of the job, once.
  absl::StatusOr<WriteResult> WriteData(const std::string& job_id, const std::string& field,
                                        const std::string& bytes);
  absl::StatusOr<std::string> ReadData(const std::string& job_id, const std::string& field);

  // Every job folder's record; a folder whose record cannot be read is reported in `problems`
  // (one line each) and skipped.
  std::vector<JobRecord> LoadAll(std::vector<std::string>* problems);

  // A record's bytes (header and payload) and back; exposed for the tests.
  static std::string Encode(const JobRecord& record);
  static absl::StatusOr<JobRecord> Decode(const std::string& bytes, const std::string& path);

 private:
  CheckpointStore(std::string dir, int64_t limit_bytes)
      : dir_(std::move(dir)), limit_bytes_(limit_bytes) {}
  absl::StatusOr<WriteResult> WriteFile(const std::string& job_id, const std::string& name,
                                        const std::string& bytes);
  std::string JobDir(const std::string& job_id) const { return dir_ + "/" + job_id; }

  const std::string dir_;
  const int64_t limit_bytes_;
  absl::Mutex mu_;  // one write at a time: the limit's accounting, and a file's replacement
  int64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int64_t> file_bytes_ ABSL_GUARDED_BY(mu_);  // by path
};

}  // namespace attnserve::training
