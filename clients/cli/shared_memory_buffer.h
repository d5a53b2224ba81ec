// The client side of shared-memory tensors: a memfd this process creates, seals against
// shrinking and maps, registered with the server as a region by passing its descriptor (the
// exchange in proto/wire/descriptor_passing.h), and the requests that refer to it instead of
// carrying their tensors' bytes.
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
  // A fresh memfd of `bytes` (zeroed, backed), sealed against shrinking, mapped read-write.
  static absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> Create(int64_t bytes);
  ~SharedMemoryBuffer();  // unmaps and closes; the server's mapping lives on until unregistered
  SharedMemoryBuffer(const SharedMemoryBuffer&) = delete;
  SharedMemoryBuffer& operator=(const SharedMemoryBuffer&) = delete;

  int fd() const { return fd_; }
  std::byte* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  SharedMemoryBuffer(int fd, std::byte* data, int64_t size) : fd_(fd), data_(data), size_(size) {}

  const int fd_;
  std::byte* const data_;
  const int64_t size_;
};

// Registers the whole buffer as region `name`: passes its descriptor to the server's
// shared-memory socket (asked of GetServerInfo), then RegisterSharedMemory with the token.
grpc::Status RegisterSharedMemory(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                                  const std::string& name, const SharedMemoryBuffer& buffer);
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
