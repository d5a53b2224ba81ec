#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

constexpr size_t kMaxNameLength = 128;
constexpr size_t kMaxKeyLength = 200;

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// shm_open names: one path component under /dev/shm, optionally with the leading slash.
absl::Status CheckKey(const std::string& key) {
  const std::string_view bare =
      absl::StartsWith(key, "/") ? std::string_view(key).substr(1) : std::string_view(key);
  if (bare.empty() || bare.size() > kMaxKeyLength || bare == "." || bare == "..") {
    return Invalid("key", absl::StrCat("'", key, "' is not a shared-memory object name"));
  }
  for (const char c : bare) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return Invalid("key", absl::StrCat("'", key,
                                         "' may only hold letters, digits, '.', '_' and '-' "
                                         "after an optional leading '/'"));
    }
  }
  return absl::OkStatus();
}

absl::Status ErrnoStatus(int error, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOMEM:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace

SharedMemoryRegion::SharedMemoryRegion(std::string name, std::string key, void* mapping,
                                       size_t mapping_bytes, std::byte* data, uint64_t size)
    : name_(std::move(name)),
      key_(std::move(key)),
      mapping_(mapping),
      mapping_bytes_(mapping_bytes),
      data_(data),
      size_(size) {}

SharedMemoryRegion::~SharedMemoryRegion() {
  if (unpin_) unpin_(mapping_);
  munmap(mapping_, mapping_bytes_);
}

bool SharedMemoryRegion::Contains(const void* p, int64_t bytes) const {
  const auto* b = static_cast<const std::byte*>(p);
  return b >= data_ && bytes >= 0 && static_cast<uint64_t>(b - data_) <= size_ &&
         static_cast<uint64_t>(bytes) <= size_ - static_cast<uint64_t>(b - data_);
}

absl::Status SharedMemoryRegion::Pin(const std::function<absl::Status(void*, int64_t)>& pin,
                                     std::function<void(void*)> unpin) {
  if (absl::Status s = pin(mapping_, static_cast<int64_t>(mapping_bytes_)); !s.ok()) return s;
  unpin_ = std::move(unpin);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> SharedMemoryRegion::Map(const std::string& name,
                                                                            const std::string& key,
                                                                            uint64_t offset,
                                                                            uint64_t byte_size) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (byte_size == 0) return Invalid("byte_size", "must be positive");
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("key: cannot open '", key, "'"));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    return ErrnoStatus(error, absl::StrCat("key: cannot stat '", key, "'"));
  }
  const uint64_t object_bytes = static_cast<uint64_t>(st.st_size);
  if (offset > object_bytes || byte_size > object_bytes - offset) {
    close(fd);
    return Invalid("byte_size",
                   absl::StrCat("offset ", offset, " + byte_size ", byte_size,
                                " runs past the end of '", key, "' (", object_bytes, " bytes)"));
  }
  // Back every page of the range now (a no-op where the client already did): a page that is
  // still a hole when a lane writes O into it would cost the server a SIGBUS once /dev/shm is
  // full; this way a full /dev/shm is a clean RESOURCE_EXHAUSTED here instead.
  if (const int error =
          posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(byte_size));
      error != 0) {
    close(fd);
    return error == ENOSPC ? absl::ResourceExhaustedError(
                                 absl::StrCat("byte_size: no space in /dev/shm to back ", byte_size,
                                              " bytes of '", key, "'"))
                           : ErrnoStatus(error, absl::StrCat("key: cannot allocate '", key, "'"));
  }
  // mmap wants a page-aligned offset: map from the page holding `offset`.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t aligned = offset / page * page;
  const uint64_t mapping_bytes = byte_size + (offset - aligned);
  if (mapping_bytes > std::numeric_limits<size_t>::max()) {
    close(fd);
    return Invalid("byte_size", "too large to map");
  }
  void* mapping = mmap(nullptr, static_cast<size_t>(mapping_bytes), PROT_READ | PROT_WRITE,
                       MAP_SHARED, fd, static_cast<off_t>(aligned));
  const int error = errno;
  close(fd);  // the mapping keeps the object alive
  if (mapping == MAP_FAILED) return ErrnoStatus(error, absl::StrCat("key: cannot map '", key, "'"));
  return std::shared_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(name, key, mapping, static_cast<size_t>(mapping_bytes),
                             static_cast<std::byte*>(mapping) + (offset - aligned), byte_size));
}

absl::Status SharedMemoryRegistry::Register(const v1::RegisterSharedMemoryRequest& request,
                                            bool* pinned) {
  if (pinned != nullptr) *pinned = false;
  const std::string& name = request.name();
  if (name.empty() || name.size() > kMaxNameLength) {
    return Invalid("name", absl::StrCat("must be 1 to ", kMaxNameLength, " bytes"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (regions_.count(name) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("name: region '", name, "' is already registered"));
    }
    if (static_cast<int>(regions_.size()) >= kMaxRegions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("name: ", kMaxRegions, " regions are registered already; unregister some"));
    }
  }
  // Mapped outside the lock: opening and mapping are system calls other requests need not
  // wait for.
  absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> region =
      SharedMemoryRegion::Map(name, request.key(), request.offset(), request.byte_size());
  if (!region.ok()) return region.status();
  if (pinning_.pin && pinning_.unpin) {
    // Page-locking takes a while for big regions (~0.25 ms per MiB); registration is rare.
    const bool ok = (*region)->Pin(pinning_.pin, pinning_.unpin).ok();
    if (pinned != nullptr) *pinned = ok;
  }
  absl::MutexLock lock(&mu_);
  if (!regions_.emplace(name, *std::move(region)).second) {
    return absl::AlreadyExistsError(
        absl::StrCat("name: region '", name, "' is already registered"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> SharedMemoryRegistry::Unregister(const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (name.empty()) {
    const int n = static_cast<int>(regions_.size());
    regions_.clear();
    return n;
  }
  if (regions_.erase(name) == 0) {
    return absl::NotFoundError(absl::StrCat("name: no region '", name, "' is registered"));
  }
  return 1;
}

absl::StatusOr<SharedMemorySpan> SharedMemoryRegistry::Resolve(const v1::SharedMemoryRef& ref,
                                                               uint64_t expected_bytes,
                                                               const std::string& field) const {
  std::shared_ptr<const SharedMemoryRegion> region;
  {
    absl::MutexLock lock(&mu_);
    const auto it = regions_.find(ref.region());
    if (it == regions_.end()) {
      return Invalid(absl::StrCat(field, ".region"),
                     absl::StrCat("no region '", ref.region(), "' is registered"));
    }
    region = it->second;
  }
  if (ref.byte_size() != expected_bytes) {
    return Invalid(absl::StrCat(field, ".byte_size"),
                   absl::StrCat(ref.byte_size(), ", expected ", expected_bytes));
  }
  if (ref.offset() > region->size() || ref.byte_size() > region->size() - ref.offset()) {
    return Invalid(
        absl::StrCat(field, ".offset"),
        absl::StrCat("offset ", ref.offset(), " + byte_size ", ref.byte_size(),
                     " runs past region '", ref.region(), "' (", region->size(), " bytes)"));
  }
  SharedMemorySpan span;
  span.data = region->data() + ref.offset();
  span.region = std::move(region);
  return span;
}

int SharedMemoryRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(regions_.size());
}

uint64_t SharedMemoryRegistry::mapped_bytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [name, region] : regions_) total += region->size();
  return total;
}

bool IsSameHostPeer(const std::string& peer) {
  if (absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:")) return true;
  if (absl::StartsWith(peer, "ipv4:127.")) return true;
  for (const char* loopback :
       {"ipv6:[::1]:", "ipv6:%5B::1%5D:", "ipv6:[::ffff:127.", "ipv6:%5B::ffff:127."}) {
    if (absl::StartsWith(peer, loopback)) return true;
  }
  return false;
}

}  // namespace attnserve
