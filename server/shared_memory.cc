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

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
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

SharedMemoryRegion::SharedMemoryRegion(std::string name, void* mapping, size_t mapping_bytes,
                                       std::byte* data, uint64_t size)
    : name_(std::move(name)),
      mapping_(mapping),
      mapping_bytes_(mapping_bytes),
      data_(data),
      size_(size) {}

SharedMemoryRegion::~SharedMemoryRegion() {
  if (unpin_) unpin_(mapping_);
  munmap(mapping_, mapping_bytes_);
}

absl::Status SharedMemoryRegion::Pin(const std::function<absl::Status(void*, int64_t)>& pin,
                                     std::function<void(void*)> unpin) {
  if (absl::Status s = pin(mapping_, static_cast<int64_t>(mapping_bytes_)); !s.ok()) return s;
  unpin_ = std::move(unpin);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> SharedMemoryRegion::Map(const std::string& name,
                                                                            int fd, uint64_t offset,
                                                                            uint64_t byte_size) {
  if (byte_size == 0) return Invalid("byte_size", "must be positive");
  struct stat st {};
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fd_token: cannot stat the object");
  const uint64_t object_bytes = static_cast<uint64_t>(st.st_size);
  if (offset > object_bytes || byte_size > object_bytes - offset) {
    return Invalid("byte_size",
                   absl::StrCat("offset ", offset, " + byte_size ", byte_size,
                                " runs past the end of the object (", object_bytes, " bytes)"));
  }
  // Back every page of the range now (a no-op where the client already did): a page that is
  // still a hole when a lane writes O into it would need memory at that moment; this way a
  // shortage is a clean RESOURCE_EXHAUSTED here instead.
  if (const int error =
          posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(byte_size));
      error != 0) {
    return error == ENOSPC
               ? absl::ResourceExhaustedError(absl::StrCat("byte_size: no memory to back ",
                                                           byte_size, " bytes of the object"))
               : ErrnoStatus(error, "fd_token: cannot allocate the object's range");
  }
  // mmap wants a page-aligned offset: map from the page holding `offset`.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t aligned = offset / page * page;
  const uint64_t mapping_bytes = byte_size + (offset - aligned);
  if (mapping_bytes > std::numeric_limits<size_t>::max()) {
    return Invalid("byte_size", "too large to map");
  }
  void* mapping = mmap(nullptr, static_cast<size_t>(mapping_bytes), PROT_READ | PROT_WRITE,
                       MAP_SHARED, fd, static_cast<off_t>(aligned));
  if (mapping == MAP_FAILED) return ErrnoStatus(errno, "fd_token: cannot map the object");
  return std::shared_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(name, mapping, static_cast<size_t>(mapping_bytes),
                             static_cast<std::byte*>(mapping) + (offset - aligned), byte_size));
}

absl::Status SharedMemoryRegistry::Register(const Identity& owner,
                                            const v1::RegisterSharedMemoryRequest& request, int fd,
                                            bool* pinned) {
  if (pinned != nullptr) *pinned = false;
  const std::string& name = request.name();
  if (name.empty() || name.size() > kMaxNameLength) {
    return Invalid("name", absl::StrCat("must be 1 to ", kMaxNameLength, " bytes"));
  }
  auto check_room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (regions_.count({owner, name}) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("name: region '", name, "' is already registered"));
    }
    const auto it = per_owner_.find(owner);
    if (it != per_owner_.end() && it->second >= limits_.max_regions_per_owner) {
      return absl::ResourceExhaustedError(
          absl::StrCat("name: ", it->second,
                       " regions are registered under this identity (the "
                       "most it may hold); unregister some"));
    }
    if (static_cast<int>(regions_.size()) >= limits_.max_regions) {
      return absl::ResourceExhaustedError(absl::StrCat("name: the server holds ", regions_.size(),
                                                       " regions, its limit; retry later"));
    }
    return absl::OkStatus();
  };
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = check_room(); !s.ok()) return s;
  }
  // Mapped outside the lock: mapping (and page-locking) are system calls other requests need
  // not wait for.
  absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> region =
      SharedMemoryRegion::Map(name, fd, request.offset(), request.byte_size());
  if (!region.ok()) return region.status();
  if (pinning_.pin && pinning_.unpin) {
    // Page-locking takes a while for big regions (~0.25 ms per MiB); registration is rare.
    const bool ok = (*region)->Pin(pinning_.pin, pinning_.unpin).ok();
    if (pinned != nullptr) *pinned = ok;
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status s = check_room(); !s.ok()) return s;  // a concurrent registration won
  regions_.emplace(Key{owner, name}, *std::move(region));
  ++per_owner_[owner];
  return absl::OkStatus();
}

absl::StatusOr<int> SharedMemoryRegistry::Unregister(const Identity& owner,
                                                     const std::string& name) {
  absl::MutexLock lock(&mu_);
  int removed = 0;
  if (name.empty()) {
    auto it = regions_.lower_bound(Key{owner, std::string()});
    while (it != regions_.end() && it->first.first == owner) {
      it = regions_.erase(it);
      ++removed;
    }
  } else {
    removed = static_cast<int>(regions_.erase(Key{owner, name}));
    if (removed == 0) {
      return absl::NotFoundError(absl::StrCat("name: no region '", name, "' is registered"));
    }
  }
  if (auto it = per_owner_.find(owner); it != per_owner_.end()) {
    it->second -= removed;
    if (it->second <= 0) per_owner_.erase(it);
  }
  return removed;
}

absl::StatusOr<MemorySpan> SharedMemoryRegistry::Resolve(const Identity& owner,
                                                         const v1::SharedMemoryRef& ref,
                                                         uint64_t expected_bytes,
                                                         const std::string& field) const {
  std::shared_ptr<const SharedMemoryRegion> region;
  {
    absl::MutexLock lock(&mu_);
    const auto it = regions_.find(Key{owner, ref.region()});
    // Another identity's region answers exactly as a name nobody registered.
    if (it == regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat(field, ".region: no region '", ref.region(), "' is registered"));
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
  MemorySpan span;
  span.data = region->data() + ref.offset();
  span.region = std::move(region);
  return span;
}

int SharedMemoryRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(regions_.size());
}

int SharedMemoryRegistry::size(const Identity& owner) const {
  absl::MutexLock lock(&mu_);
  const auto it = per_owner_.find(owner);
  return it == per_owner_.end() ? 0 : it->second;
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
