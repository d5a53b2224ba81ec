// Shared-memory regions for same-host clients. A client puts tensors in a memory object of its
// own, hands the server its descriptor (server/descriptor_socket.h), registers a range of it
// under a name (RegisterSharedMemory), and sends requests whose tensors refer to (region,
// offset, byte_size) instead of carrying bytes: gRPC moves a few hundred bytes per request, and
// the batcher copies the tensors between the region and the device (directly when a GPU server
// page-locked the region, else through its staging buffer) and writes O back into it.
//
// Trust: the server maps only descriptors the client opened itself (never a name it would open
// with its own rights), and only memfds sealed against shrinking, so a region cannot vanish
// under a copy. Regions belong to the identity that registered them: to every other identity a
// region's name does not exist (NOT_FOUND), and each identity has its own cap.
//
// A region stays mapped while any request that resolved it holds its shared_ptr, so
// unregistering never pulls memory from under a running batch.
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
#include "proto/wire/memory_region.h"
#include "server/identity.h"

namespace attnserve {

class SharedMemoryRegion final : public MemoryRegion {
 public:
  // Maps [offset, offset + byte_size) of the memory object `fd` read-write (fd is not kept).
  static absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> Map(const std::string& name, int fd,
                                                                 uint64_t offset,
                                                                 uint64_t byte_size);
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& name() const { return name_; }
  std::byte* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  // Page-locked for device copies (see HostMemoryPinning).
  bool pinned() const override { return static_cast<bool>(unpin_); }

  // Page-locks the whole mapping with `pin`; `unpin` then runs before it is unmapped.
  absl::Status Pin(const std::function<absl::Status(void*, int64_t)>& pin,
                   std::function<void(void*)> unpin);

 private:
  SharedMemoryRegion(std::string name, void* mapping, size_t mapping_bytes, std::byte* data,
                     uint64_t size);

  const std::string name_;
  void* const mapping_;               // page-aligned, as mmap returned it
  std::function<void(void*)> unpin_;  // set once pinned
  const size_t mapping_bytes_;
  std::byte* const data_;  // the registered offset inside the mapping
  const uint64_t size_;
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
  struct Limits {
    int max_regions_per_owner = 64;
    int max_regions = 4096;  // over every owner: bounds the mappings one process holds
  };

  SharedMemoryRegistry() = default;
  SharedMemoryRegistry(Limits limits, HostMemoryPinning pinning)
      : limits_(limits), pinning_(std::move(pinning)) {}

  // Maps the range of `fd` (a descriptor the caller checked, see DescriptorSocket) as `owner`'s
  // region. ALREADY_EXISTS for a name the owner already uses, INVALID_ARGUMENT naming the field,
  // RESOURCE_EXHAUSTED past the owner's cap. *pinned: whether the region could be page-locked (a
  // region that cannot is still served, through the staging buffer).
  absl::Status Register(const Identity& owner, const v1::RegisterSharedMemoryRequest& request,
                        int fd, bool* pinned = nullptr);
  // Empty name: every region of `owner`. Returns how many were removed; NOT_FOUND for a name
  // the owner has not registered.
  absl::StatusOr<int> Unregister(const Identity& owner, const std::string& name);

  // The bytes a tensor refers to, in one of `owner`'s regions; `field` names it in errors
  // ("q.shared_memory"). NOT_FOUND for a region the owner has not registered.
  absl::StatusOr<MemorySpan> Resolve(const Identity& owner, const v1::SharedMemoryRef& ref,
                                     uint64_t expected_bytes, const std::string& field) const;

  int size() const;
  int size(const Identity& owner) const;
  uint64_t mapped_bytes() const;
  const Limits& limits() const { return limits_; }

 private:
  using Key = std::pair<Identity, std::string>;
  const Limits limits_ = {};
  const HostMemoryPinning pinning_ = {};
  mutable absl::Mutex mu_;
  std::map<Key, std::shared_ptr<const SharedMemoryRegion>> regions_ ABSL_GUARDED_BY(mu_);
  std::map<Identity, int> per_owner_ ABSL_GUARDED_BY(mu_);
};

// The references one identity may resolve: what the request decoder is given for its caller.
class SharedMemoryScope final : public SharedMemoryResolver {
 public:
  SharedMemoryScope(const SharedMemoryRegistry* registry, Identity owner)
      : registry_(registry), owner_(std::move(owner)) {}
  absl::StatusOr<MemorySpan> Resolve(const v1::SharedMemoryRef& ref, uint64_t expected_bytes,
                                     const std::string& field) const override {
    return registry_->Resolve(owner_, ref, expected_bytes, field);
  }

 private:
  const SharedMemoryRegistry* const registry_;
  const Identity owner_;
};

// Whether a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path", ...) is a
// process on this host.
bool IsSameHostPeer(const std::string& peer);

}  // namespace attnserve
