#include "server/training/checkpoint_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnserve::training {
namespace {

constexpr char kMagic[8] = {'A', 'T', 'T', 'N', 'C', 'K', 'P', 'T'};
constexpr size_t kHeaderBytes = 24;
constexpr char kRecordName[] = "job.ckpt";
constexpr char kTempSuffix[] = ".tmp";

void PutLe(uint64_t value, int bytes, char* out) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

uint64_t GetLe(const char* in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return value;
}

uint32_t Crc32(const std::string& bytes) {
  return static_cast<uint32_t>(
      crc32_z(crc32_z(0, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

// ENOSPC and its relatives read as "the disk is full"; anything else is an I/O failure.
absl::Status WriteError(const std::string& path, const char* what, int error) {
  const std::string message =
      absl::StrCat("checkpoint: ", what, " '", path, "': ", std::strerror(error));
  if (error == ENOSPC || error == EDQUOT || error == EFBIG) {
    return absl::ResourceExhaustedError(absl::StrCat(message, " (the training disk is full)"));
  }
  return absl::InternalError(message);
}

absl::Status SyncDirectory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return WriteError(dir, "opening", errno);
  const int rc = fsync(fd);
  const int error = errno;
  close(fd);
  return rc == 0 ? absl::OkStatus() : WriteError(dir, "flushing", error);
}

absl::StatusOr<std::string> ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("checkpoint: cannot read '", path, "'"));
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("checkpoint: reading '", path, "'"));
  return out.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointStore>> CheckpointStore::Open(const std::string& dir,
                                                                       int64_t limit_bytes) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return absl::FailedPreconditionError(
        absl::StrCat("--training_dir: cannot create '", dir, "': ", error.message()));
  }
  std::unique_ptr<CheckpointStore> store(new CheckpointStore(dir, limit_bytes));
  absl::MutexLock lock(&store->mu_);
  for (auto it = std::filesystem::recursive_directory_iterator(dir, error);
       !error && it != std::filesystem::recursive_directory_iterator(); it.increment(error)) {
    if (!it->is_regular_file()) continue;
    const std::string path = it->path().string();
    if (absl::EndsWith(path, kTempSuffix)) {  // a write that a crash interrupted
      std::filesystem::remove(it->path(), error);
      continue;
    }
    const int64_t size = static_cast<int64_t>(it->file_size());
    store->file_bytes_[path] = size;
    store->used_bytes_ += size;
  }
  if (error) {
    return absl::FailedPreconditionError(
        absl::StrCat("--training_dir: cannot list '", dir, "': ", error.message()));
  }
  return store;
}

std::string CheckpointStore::Encode(const JobRecord& record) {
  const std::string payload = record.SerializeAsString();
  std::string out(kHeaderBytes, '\0');
  std::memcpy(out.data(), kMagic, sizeof(kMagic));
  PutLe(kFormatVersion, 4, out.data() + 8);
  PutLe(Crc32(payload), 4, out.data() + 12);
  PutLe(payload.size(), 8, out.data() + 16);
  out += payload;
  return out;
}

absl::StatusOr<JobRecord> CheckpointStore::Decode(const std::string& bytes,
                                                  const std::string& path) {
  if (bytes.size() < kHeaderBytes || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat("checkpoint '", path, "': not a job record"));
  }
  const uint32_t version = static_cast<uint32_t>(GetLe(bytes.data() + 8, 4));
  if (version != kFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint '", path, "': format version ",
                                                      version, "; this server reads version ",
                                                      kFormatVersion));
  }
  const uint64_t length = GetLe(bytes.data() + 16, 8);
  if (length != bytes.size() - kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("checkpoint '", path,
                                            "': ", bytes.size() - kHeaderBytes, " payload bytes, ",
                                            length, " expected"));
  }
  const std::string payload = bytes.substr(kHeaderBytes);
  if (Crc32(payload) != static_cast<uint32_t>(GetLe(bytes.data() + 12, 4))) {
    return absl::DataLossError(absl::StrCat("checkpoint '", path, "': CRC mismatch"));
  }
  JobRecord record;
  if (!record.ParseFromString(payload)) {
    return absl::DataLossError(absl::StrCat("checkpoint '", path, "': unparsable record"));
  }
  return record;
}

absl::StatusOr<WriteResult> CheckpointStore::WriteFile(const std::string& job_id,
                                                       const std::string& name,
                                                       const std::string& bytes) {
  const absl::Time start = absl::Now();
  const std::string dir = JobDir(job_id);
  const std::string path = dir + "/" + name;
  const std::string temp = path + kTempSuffix;
  absl::MutexLock lock(&mu_);
  const int64_t size = static_cast<int64_t>(bytes.size());
  const int64_t replaced = file_bytes_.count(path) != 0 ? file_bytes_[path] : 0;
  if (limit_bytes_ > 0 && used_bytes_ - replaced + size > limit_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("checkpoint: writing '", path, "' (", size, " bytes) would put ",
                     used_bytes_ - replaced + size, " bytes under '", dir_, "', over its limit of ",
                     limit_bytes_, " (--training_disk_limit_bytes): the training disk is full"));
  }
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return WriteError(dir, "creating", errno);
  }
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return WriteError(temp, "creating", errno);
  int error = 0;
  const char* what = "writing";
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error = n < 0 ? errno : ENOSPC;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (error == 0 && fsync(fd) != 0) {
    error = errno;
    what = "flushing";
  }
  if (close(fd) != 0 && error == 0) {
    error = errno;
    what = "closing";
  }
  if (error == 0 && std::rename(temp.c_str(), path.c_str()) != 0) {
    error = errno;
    what = "renaming";
  }
  if (error != 0) {
    unlink(temp.c_str());
    return WriteError(temp, what, error);
  }
  file_bytes_[path] = size;
  used_bytes_ += size - replaced;
  if (absl::Status synced = SyncDirectory(dir); !synced.ok()) return synced;
  return WriteResult{size, absl::Now() - start};
}

absl::StatusOr<WriteResult> CheckpointStore::WriteRecord(const JobRecord& record) {
  return WriteFile(record.job_id(), kRecordName, Encode(record));
}

absl::StatusOr<WriteResult> CheckpointStore::WriteData(const std::string& job_id,
                                                       const std::string& field,
                                                       const std::string& bytes) {
  return WriteFile(job_id, field + ".bin", bytes);
}

absl::StatusOr<std::string> CheckpointStore::ReadData(const std::string& job_id,
                                                      const std::string& field) {
  return ReadWhole(JobDir(job_id) + "/" + field + ".bin");
}

std::vector<JobRecord> CheckpointStore::LoadAll(std::vector<std::string>* problems) {
  std::vector<JobRecord> records;
  std::error_code error;
  for (auto it = std::filesystem::directory_iterator(dir_, error);
       !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    if (!it->is_directory()) continue;
    const std::string path = it->path().string() + "/" + kRecordName;
    absl::StatusOr<std::string> bytes = ReadWhole(path);
    absl::StatusOr<JobRecord> record =
        bytes.ok() ? Decode(*bytes, path) : absl::StatusOr<JobRecord>(bytes.status());
    if (!record.ok()) {
      problems->push_back(std::string(record.status().message()));
      continue;
    }
    if (record->job_id() != it->path().filename().string()) {
      problems->push_back(absl::StrCat("checkpoint '", path, "': names job '", record->job_id(),
                                       "', not its folder's"));
      continue;
    }
    records.push_back(*std::move(record));
  }
  if (error) problems->push_back(absl::StrCat("cannot list '", dir_, "': ", error.message()));
  return records;
}

}  // namespace attnserve::training
