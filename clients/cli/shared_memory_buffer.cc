#include "clients/cli/shared_memory_buffer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "proto/wire/descriptor_passing.h"

namespace attnserve::client {
namespace {

absl::Status ErrnoError(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> SharedMemoryBuffer::Create(int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("shared memory: size must be positive");
  const int fd = memfd_create("attnserve-client", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoError("shared memory: memfd_create");
  // Allocated, not just sized: a shortage fails here instead of a later write faulting.
  if (const int error = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0) {
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("shared memory: cannot allocate ", bytes, " bytes: ", std::strerror(error)));
  }
  // The server maps only objects that cannot shrink under it.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    const absl::Status error = ErrnoError("shared memory: F_ADD_SEALS");
    close(fd);
    return error;
  }
  void* data = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const absl::Status error = ErrnoError("shared memory: mmap");
    close(fd);
    return error;
  }
  return std::unique_ptr<SharedMemoryBuffer>(
      new SharedMemoryBuffer(fd, static_cast<std::byte*>(data), bytes));
}

SharedMemoryBuffer::~SharedMemoryBuffer() {
  munmap(data_, static_cast<size_t>(size_));
  close(fd_);
}

grpc::Status RegisterSharedMemory(v1::AttentionService::Stub& stub, const ChannelFactory& factory,
                                  const std::string& name, const SharedMemoryBuffer& buffer) {
  v1::ServerInfo info;
  {
    grpc::ClientContext context;
    factory.Prepare(&context, absl::Seconds(30));
    const grpc::Status status = stub.GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
    if (!status.ok()) return status;
  }
  if (info.shared_memory_socket().empty()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "shared memory: the server offers no shared-memory socket (disabled, or a "
                        "server too old for descriptor passing)");
  }
  absl::StatusOr<std::string> token =
      wire::PassDescriptor(info.shared_memory_socket(), buffer.fd());
  if (!token.ok()) {
    return grpc::Status(static_cast<grpc::StatusCode>(token.status().code()),
                        std::string(token.status().message()));
  }
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_fd_token(*token);
  request.set_offset(0);
  request.set_byte_size(static_cast<uint64_t>(buffer.size()));
  grpc::ClientContext context;
  factory.Prepare(&context, absl::Seconds(30));
  v1::RegisterSharedMemoryResponse response;
  return stub.RegisterSharedMemory(&context, request, &response);
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
