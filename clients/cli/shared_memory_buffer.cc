#include "clients/cli/shared_memory_buffer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attnserve::client {
namespace {

absl::Status ErrnoError(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> SharedMemoryBuffer::Create(int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("shared memory: size must be positive");
  static std::atomic<int> next{0};
  const std::string key = absl::StrCat("/attnserve-client-", getpid(), "-", next.fetch_add(1));
  const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return ErrnoError(absl::StrCat("shared memory: cannot create ", key));
  // Allocated, not just sized: with a full /dev/shm this fails here instead of a later write
  // faulting with SIGBUS.
  if (const int error = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0) {
    close(fd);
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared memory: cannot allocate ", bytes, " bytes for ", key, ": ", std::strerror(error)));
  }
  void* data = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const absl::Status error = ErrnoError(absl::StrCat("shared memory: cannot map ", key));
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return error;
  }
  return std::unique_ptr<SharedMemoryBuffer>(
      new SharedMemoryBuffer(key, static_cast<std::byte*>(data), bytes));
}

SharedMemoryBuffer::~SharedMemoryBuffer() {
  munmap(data_, static_cast<size_t>(size_));
  Unlink();
}

void SharedMemoryBuffer::Unlink() {
  if (linked_) shm_unlink(key_.c_str());
  linked_ = false;
}

grpc::Status RegisterSharedMemory(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                                  const std::string& name, SharedMemoryBuffer& buffer) {
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(buffer.key());
  request.set_offset(0);
  request.set_byte_size(static_cast<uint64_t>(buffer.size()));
  grpc::ClientContext context;
  factory.Prepare(&context, absl::Seconds(30));
  v1::RegisterSharedMemoryResponse response;
  const grpc::Status status = stub.RegisterSharedMemory(&context, request, &response);
  buffer.Unlink();
  return status;
}

grpc::Status UnregisterSharedMemory(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                                    const std::string& name) {
  v1::UnregisterSharedMemoryRequest request;
  request.set_name(name);
  grpc::ClientContext context;
  factory.Prepare(&context, absl::Seconds(30));
  v1::UnregisterSharedMemoryResponse response;
  return stub.UnregisterSharedMemory(&context, request, &response);
}

int64_t SharedMemoryAlignUp(int64_t n) {
  return (n + kSharedMemoryAlign - 1) / kSharedMemoryAlign * kSharedMemoryAlign;
}

absl::Status MoveToSharedMemory(v1::Tensor* tensor, const std::string& region,
                                SharedMemoryBuffer& buffer, int64_t* offset) {
  const int64_t at = SharedMemoryAlignUp(*offset);
  const int64_t bytes = static_cast<int64_t>(tensor->data().size());
  if (at + bytes > buffer.size()) {
    return absl::OutOfRangeError(absl::StrCat("shared memory: ", bytes, " bytes at offset ", at,
                                              " do not fit in ", buffer.size()));
  }
  std::memcpy(buffer.data() + at, tensor->data().data(), static_cast<size_t>(bytes));
  tensor->clear_data();
  v1::SharedMemoryRef& ref = *tensor->mutable_shared_memory();
  ref.set_region(region);
  ref.set_offset(static_cast<uint64_t>(at));
  ref.set_byte_size(static_cast<uint64_t>(bytes));
  *offset = at + bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSharedMemory(const v1::SharedMemoryRef& ref,
                                             const SharedMemoryBuffer& buffer) {
  const uint64_t size = static_cast<uint64_t>(buffer.size());
  if (ref.offset() > size || ref.byte_size() > size - ref.offset()) {
    return absl::OutOfRangeError(absl::StrCat("shared memory: [", ref.offset(), ", +",
                                              ref.byte_size(), ") is outside the buffer"));
  }
  return std::string(reinterpret_cast<const char*>(buffer.data() + ref.offset()),
                     static_cast<size_t>(ref.byte_size()));
}

}  // namespace attnserve::client
