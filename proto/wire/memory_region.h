// Memory a request's tensors may live in instead of the message (a registered shared-memory
// region), as the decoder sees it: the server implements the registry behind the resolver, the
// decoder only asks it for the bytes a reference names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {

class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  virtual std::byte* data() const = 0;
  virtual uint64_t size() const = 0;
  // Page-locked for device copies (lanes DMA it directly instead of through their staging).
  virtual bool pinned() const = 0;

  // Whether [p, p + bytes) lies inside the region.
  bool Contains(const void* p, int64_t bytes) const {
    const auto* b = static_cast<const std::byte*>(p);
    return b >= data() && bytes >= 0 && static_cast<uint64_t>(b - data()) <= size() &&
           static_cast<uint64_t>(bytes) <= size() - static_cast<uint64_t>(b - data());
  }
};

// A tensor's bytes inside a region, and the region kept alive for as long as they are used.
struct MemorySpan {
  std::shared_ptr<const MemoryRegion> region;
  std::byte* data = nullptr;
};

// Resolves one caller's shared-memory references.
class SharedMemoryResolver {
 public:
  virtual ~SharedMemoryResolver() = default;
  // The bytes `ref` names, which must be exactly `expected_bytes` long; `field` names the
  // reference in errors ("q.shared_memory"). NOT_FOUND for a region the caller cannot name.
  virtual absl::StatusOr<MemorySpan> Resolve(const v1::SharedMemoryRef& ref,
                                             uint64_t expected_bytes,
                                             const std::string& field) const = 0;
};

}  // namespace attnserve
