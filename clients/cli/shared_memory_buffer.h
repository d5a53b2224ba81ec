// The client side of shared-memory tensors: a POSIX shared-memory object this process creates
// and maps, registered with the server as a region, and the requests that refer to it instead
// of carrying their tensors' bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "clients/cli/channel_factory.h"

namespace attnserve::client {

class SharedMemoryBuffer {
 public:
  // A fresh object of `bytes` (zeroed) under a unique name, mapped read-write.
  static absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> Create(int64_t bytes);
  ~SharedMemoryBuffer();  // unmaps, and removes the name if still there
  SharedMemoryBuffer(const SharedMemoryBuffer&) = delete;
  SharedMemoryBuffer& operator=(const SharedMemoryBuffer&) = delete;

  const std::string& key() const { return key_; }  // shm_open's name
  std::byte* data() const { return data_; }
  int64_t size() const { return size_; }

  // Removes the name; the memory lives on while mapped (here and in the server).
  void Unlink();

 private:
  SharedMemoryBuffer(std::string key, std::byte* data, int64_t size)
      : key_(std::move(key)), data_(data), size_(size) {}

  const std::string key_;
  std::byte* const data_;
  const int64_t size_;
  bool linked_ = true;
};

// Registers the whole buffer as region `name`, then unlinks its name: once both sides have it
// mapped nothing needs the name, and nothing is left behind in /dev/shm if either side dies.
grpc::Status RegisterSharedMemory(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                                  const std::string& name, SharedMemoryBuffer& buffer);
grpc::Status UnregisterSharedMemory(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                                    const std::string& name);

// Offsets are rounded up to this, so every tensor starts suitably aligned.
constexpr int64_t kSharedMemoryAlign = 256;
int64_t SharedMemoryAlignUp(int64_t n);

// Moves `tensor`'s bytes to buffer[*offset...] and makes the tensor refer to them as region
// `region`; advances *offset. OUT_OF_RANGE when they do not fit.
absl::Status MoveToSharedMemory(v1::Tensor* tensor, const std::string& region,
                                SharedMemoryBuffer& buffer, int64_t* offset);

// The bytes a SharedMemoryRef names, or OUT_OF_RANGE.
absl::StatusOr<std::string> ReadSharedMemory(const v1::SharedMemoryRef& ref,
                                             const SharedMemoryBuffer& buffer);

}  // namespace attnserve::client
