// Shared-memory regions for same-host clients. A client puts tensors in a POSIX shared-memory
// object, registers a range of it under a name (RegisterSharedMemory), and sends requests whose
// tensors refer to (region, offset, byte_size) instead of carrying bytes: gRPC moves a few
// hundred bytes per request, and the batcher copies the tensors between the region and the
// device (directly when a GPU server page-locked the region, else through its staging buffer) and
// writes O back into it.
//
// A region stays mapped while any request that resolved it holds its shared_ptr, so
// unregistering never pulls memory from under a running batch. Trust: a registered object is
// written by the client while the server reads it, and shrinking it below the registered range
// would fault the server; so registration is only offered to peers on the same host (see
// IsSameHostPeer) and can be switched off (--shared_memory=false).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

class SharedMemoryRegion {
 public:
  // Maps [offset, offset + byte_size) of the POSIX shared-memory object `key` read-write.
  static absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> Map(const std::string& name,
                                                                 const std::string& key,
                                                                 uint64_t offset,
                                                                 uint64_t byte_size);
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& name() const { return name_; }
  const std::string& key() const { return key_; }
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  // Page-locked for device copies (see HostMemoryPinning).
  bool pinned() const { return static_cast<bool>(unpin_); }
  // Whether [p, p + bytes) lies inside the registered range.
  bool Contains(const void* p, int64_t bytes) const;

  // Page-locks the whole mapping with `pin`; `unpin` then runs before it is unmapped.
  absl::Status Pin(const std::function<absl::Status(void*, int64_t)>& pin,
                   std::function<void(void*)> unpin);

 private:
  SharedMemoryRegion(std::string name, std::string key, void* mapping, size_t mapping_bytes,
                     std::byte* data, uint64_t size);

  const std::string name_, key_;
  void* const mapping_;               // page-aligned, as mmap returned it
  std::function<void(void*)> unpin_;  // set once pinned
  const size_t mapping_bytes_;
  std::byte* const data_;  // the registered offset inside the mapping
  const uint64_t size_;
};

// A tensor's bytes inside a region, and the region kept mapped for as long as they are used.
struct SharedMemorySpan {
  std::shared_ptr<const SharedMemoryRegion> region;
  std::byte* data = nullptr;
};

// How a GPU server page-locks regions (cudaHostRegister), so that lanes copy tensors between a
// region and the device directly (DMA, or a copy kernel through the region's device mapping)
// instead of through the staging buffer.
struct HostMemoryPinning {
  std::function<absl::Status(void*, int64_t)> pin;
  std::function<void(void*)> unpin;
};

class SharedMemoryRegistry {
 public:
  static constexpr int kMaxRegions = 1024;

  SharedMemoryRegistry() = default;
  explicit SharedMemoryRegistry(HostMemoryPinning pinning) : pinning_(std::move(pinning)) {}

  // ALREADY_EXISTS for a taken name, INVALID_ARGUMENT naming the field, NOT_FOUND /
  // PERMISSION_DENIED when the object cannot be opened, RESOURCE_EXHAUSTED past kMaxRegions.
  // *pinned: whether the region could be page-locked (a region that cannot is still served,
  // through the staging buffer).
  absl::Status Register(const v1::RegisterSharedMemoryRequest& request, bool* pinned = nullptr);
  // Empty name: every region. Returns how many were removed; NOT_FOUND for an unknown name.
  absl::StatusOr<int> Unregister(const std::string& name);

  // The bytes a tensor refers to; `field` names it in errors ("q.shared_memory").
  absl::StatusOr<SharedMemorySpan> Resolve(const v1::SharedMemoryRef& ref, uint64_t expected_bytes,
                                           const std::string& field) const;

  int size() const;
  uint64_t mapped_bytes() const;

 private:
  const HostMemoryPinning pinning_ = {};
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const SharedMemoryRegion>> regions_ ABSL_GUARDED_BY(mu_);
};

// Whether a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path", ...) is a
// process on this host.
bool IsSameHostPeer(const std::string& peer);

}  // namespace attnserve
