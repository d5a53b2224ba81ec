// Shared-memory regions: the registry (mapping, lookups, errors that name the field, lifetime,
// owners), the descriptor socket (what it accepts, tokens), the same-host peer check, the
// decoder resolving tensors by reference, and the client's buffer.
#include "server/shared_memory.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <numeric>

#include "absl/strings/match.h"
#include "clients/cli/request_factory.h"
#include "clients/cli/shared_memory_buffer.h"
#include "proto/wire/descriptor_passing.h"
#include "proto/wire/request_decoder.h"
#include "server/descriptor_socket.h"

namespace attnserve {
namespace {

const Identity kAlice{"alice"};
const Identity kBob{"bob"};

// A client-side sealed memfd whose bytes are 0, 1, 2, ... (mod 251).
std::unique_ptr<client::SharedMemoryBuffer> Object(int64_t bytes) {
  auto buffer = client::SharedMemoryBuffer::Create(bytes);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  for (int64_t i = 0; i < bytes; ++i) (*buffer)->data()[i] = static_cast<std::byte>(i % 251);
  return *std::move(buffer);
}

v1::RegisterSharedMemoryRequest Registration(const std::string& name, uint64_t offset,
                                             uint64_t bytes) {
  v1::RegisterSharedMemoryRequest r;
  r.set_name(name);
  r.set_offset(offset);
  r.set_byte_size(bytes);
  return r;
}

v1::SharedMemoryRef Ref(const std::string& region, uint64_t offset, uint64_t bytes) {
  v1::SharedMemoryRef ref;
  ref.set_region(region);
  ref.set_offset(offset);
  ref.set_byte_size(bytes);
  return ref;
}

void ExpectError(const absl::Status& s, absl::StatusCode code, const std::string& field) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), field)) << s;
}

TEST(SharedMemoryRegistry, MapsAnUnalignedRangeAndSharesWrites) {
  auto object = Object(3 * 4096);
  SharedMemoryRegistry registry;
  // An offset that is not page-aligned: the region still starts exactly there.
  ASSERT_TRUE(registry.Register(kAlice, Registration("a", 4100, 5000), object->fd()).ok());
  EXPECT_EQ(registry.size(), 1);
  EXPECT_EQ(registry.mapped_bytes(), 5000u);
  auto span = registry.Resolve(kAlice, Ref("a", 10, 100), 100, "q.shared_memory");
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_EQ(span->data[0], static_cast<std::byte>((4100 + 10) % 251));
  // Both sides see each other's writes: it is the same memory.
  span->data[1] = std::byte{0x7f};
  EXPECT_EQ(object->data()[4111], std::byte{0x7f});
  object->data()[4112] = std::byte{0x11};
  EXPECT_EQ(span->data[2], std::byte{0x11});
}

TEST(SharedMemoryRegistry, UnregisterKeepsMemoryOfRequestsInFlight) {
  auto object = Object(8192);
  SharedMemoryRegistry registry;
  ASSERT_TRUE(registry.Register(kAlice, Registration("a", 0, 8192), object->fd()).ok());
  auto span = registry.Resolve(kAlice, Ref("a", 0, 8192), 8192, "q.shared_memory");
  ASSERT_TRUE(span.ok());
  object.reset();  // the client unmaps and closes its descriptor
  auto removed = registry.Unregister(kAlice, "a");
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 1);
  EXPECT_EQ(registry.size(), 0);
  // Still mapped for the request that resolved it.
  EXPECT_EQ(span->data[8191], static_cast<std::byte>(8191 % 251));
  ExpectError(registry.Resolve(kAlice, Ref("a", 0, 1), 1, "k.shared_memory").status(),
              absl::StatusCode::kNotFound, "k.shared_memory.region");
  ExpectError(registry.Unregister(kAlice, "a").status(), absl::StatusCode::kNotFound, "name");
}

TEST(SharedMemoryRegistry, RegistrationErrorsNameTheField) {
  auto object = Object(4096);
  SharedMemoryRegistry registry;
  ExpectError(registry.Register(kAlice, Registration("", 0, 16), object->fd()),
              absl::StatusCode::kInvalidArgument, "name");
  ExpectError(registry.Register(kAlice, Registration("a", 0, 0), object->fd()),
              absl::StatusCode::kInvalidArgument, "byte_size");
  ExpectError(registry.Register(kAlice, Registration("a", 4000, 97), object->fd()),
              absl::StatusCode::kInvalidArgument, "byte_size");
  ExpectError(registry.Register(kAlice, Registration("a", ~uint64_t{0}, 2), object->fd()),
              absl::StatusCode::kInvalidArgument, "byte_size");
  ASSERT_TRUE(registry.Register(kAlice, Registration("a", 0, 4096), object->fd()).ok());
  ExpectError(registry.Register(kAlice, Registration("a", 0, 4096), object->fd()),
              absl::StatusCode::kAlreadyExists, "name");
  EXPECT_EQ(registry.size(), 1);
}

TEST(SharedMemoryRegistry, ResolveChecksSizeAndBounds) {
  auto object = Object(4096);
  SharedMemoryRegistry registry;
  ASSERT_TRUE(registry.Register(kAlice, Registration("a", 0, 1000), object->fd()).ok());
  ExpectError(registry.Resolve(kAlice, Ref("a", 0, 99), 100, "v.shared_memory").status(),
              absl::StatusCode::kInvalidArgument, "v.shared_memory.byte_size");
  ExpectError(registry.Resolve(kAlice, Ref("a", 901, 100), 100, "v.shared_memory").status(),
              absl::StatusCode::kInvalidArgument, "v.shared_memory.offset");
  ExpectError(
      registry.Resolve(kAlice, Ref("a", ~uint64_t{0} - 10, 100), 100, "v.shared_memory").status(),
      absl::StatusCode::kInvalidArgument, "v.shared_memory.offset");
  EXPECT_TRUE(registry.Resolve(kAlice, Ref("a", 900, 100), 100, "v.shared_memory").ok());
}

TEST(SharedMemoryRegistry, RegionsBelongToTheirOwner) {
  auto object = Object(4096);
  SharedMemoryRegistry registry;
  for (const char* name : {"a", "b", "c"}) {
    ASSERT_TRUE(registry.Register(kAlice, Registration(name, 0, 64), object->fd()).ok());
  }
  // Bob may use the same names for regions of his own.
  ASSERT_TRUE(registry.Register(kBob, Registration("a", 0, 128), object->fd()).ok());
  // Alice's regions do not exist for Bob: not found, the same answer as for a name nobody used.
  ExpectError(registry.Resolve(kBob, Ref("b", 0, 64), 64, "q.shared_memory").status(),
              absl::StatusCode::kNotFound, "q.shared_memory.region");
  ExpectError(registry.Resolve(kBob, Ref("zz", 0, 64), 64, "q.shared_memory").status(),
              absl::StatusCode::kNotFound, "q.shared_memory.region");
  ExpectError(registry.Unregister(kBob, "b").status(), absl::StatusCode::kNotFound, "name");
  // "a" resolves to each owner's own region.
  auto bobs = registry.Resolve(kBob, Ref("a", 0, 128), 128, "q.shared_memory");
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  ExpectError(registry.Resolve(kAlice, Ref("a", 0, 128), 128, "q.shared_memory").status(),
              absl::StatusCode::kInvalidArgument, "q.shared_memory.offset");  // alice's is 64
  // The empty name clears only the caller's own.
  auto removed = registry.Unregister(kBob, "");
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 1);
  EXPECT_EQ(registry.size(kAlice), 3);
  EXPECT_EQ(registry.size(kBob), 0);
  removed = registry.Unregister(kAlice, "");
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 3);
  EXPECT_EQ(registry.mapped_bytes(), 0u);
}

TEST(SharedMemoryRegistry, EachOwnerHasItsOwnCap) {
  auto object = Object(4096);
  SharedMemoryRegistry::Limits limits;
  limits.max_regions_per_owner = 3;
  limits.max_regions = 5;
  SharedMemoryRegistry registry(limits, {});
  for (const char* name : {"a", "b", "c"}) {
    ASSERT_TRUE(registry.Register(kAlice, Registration(name, 0, 64), object->fd()).ok());
  }
  ExpectError(registry.Register(kAlice, Registration("d", 0, 64), object->fd()),
              absl::StatusCode::kResourceExhausted, "name");
  // Alice's full cap leaves Bob room.
  ASSERT_TRUE(registry.Register(kBob, Registration("a", 0, 64), object->fd()).ok());
  ASSERT_TRUE(registry.Register(kBob, Registration("b", 0, 64), object->fd()).ok());
  ExpectError(registry.Register(Identity{"carol"}, Registration("a", 0, 64), object->fd()),
              absl::StatusCode::kResourceExhausted, "name");  // the server-wide bound
  ASSERT_TRUE(registry.Unregister(kAlice, "a").ok());
  EXPECT_TRUE(registry.Register(kAlice, Registration("d", 0, 64), object->fd()).ok());
}

TEST(SharedMemoryRegistry, SameHostPeers) {
  EXPECT_TRUE(IsSameHostPeer("ipv4:127.0.0.1:50123"));
  EXPECT_TRUE(IsSameHostPeer("ipv4:127.1.2.3:1"));
  EXPECT_TRUE(IsSameHostPeer("ipv6:[::1]:50123"));
  EXPECT_TRUE(IsSameHostPeer("ipv6:%5B::1%5D:50123"));
  EXPECT_TRUE(IsSameHostPeer("ipv6:[::ffff:127.0.0.1]:9"));
  EXPECT_TRUE(IsSameHostPeer("unix:/tmp/attnserve.sock"));
  EXPECT_FALSE(IsSameHostPeer("ipv4:10.0.0.7:50123"));
  EXPECT_FALSE(IsSameHostPeer("ipv4:128.0.0.1:50123"));
  EXPECT_FALSE(IsSameHostPeer("ipv6:[2001:db8::1]:50123"));
  EXPECT_FALSE(IsSameHostPeer("ipv6:[::10]:5"));
  EXPECT_FALSE(IsSameHostPeer(""));
}

TEST(SharedMemoryRegistry, PinsRegionsAndUnpinsAfterTheLastUser) {
  auto object = Object(3 * 4096);
  int pins = 0, unpins = 0;
  void* pinned_at = nullptr;
  HostMemoryPinning pinning;
  pinning.pin = [&](void* p, int64_t bytes) {
    ++pins;
    pinned_at = p;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u);  // the whole page-aligned mapping
    EXPECT_GE(bytes, 5000);
    return absl::OkStatus();
  };
  pinning.unpin = [&](void* p) {
    ++unpins;
    EXPECT_EQ(p, pinned_at);
  };
  SharedMemoryRegistry registry({}, pinning);
  bool pinned = false;
  ASSERT_TRUE(registry.Register(kAlice, Registration("a", 4100, 5000), object->fd(), &pinned).ok());
  EXPECT_TRUE(pinned);
  EXPECT_EQ(pins, 1);
  auto span = registry.Resolve(kAlice, Ref("a", 0, 5000), 5000, "q.shared_memory");
  ASSERT_TRUE(span.ok());
  EXPECT_TRUE(span->region->pinned());
  EXPECT_TRUE(span->region->Contains(span->data + 10, 4990));
  EXPECT_FALSE(span->region->Contains(span->data + 10, 4991));
  EXPECT_FALSE(span->region->Contains(span->data - 1, 1));
  ASSERT_TRUE(registry.Unregister(kAlice, "a").ok());
  EXPECT_EQ(unpins, 0);  // a request still holds it
  span->region.reset();
  EXPECT_EQ(unpins, 1);

  // A region that cannot be page-locked is still served, unpinned.
  HostMemoryPinning failing;
  failing.pin = [](void*, int64_t) { return absl::UnavailableError("no"); };
  failing.unpin = [&](void*) { ++unpins; };
  SharedMemoryRegistry unpinnable({}, failing);
  ASSERT_TRUE(unpinnable.Register(kAlice, Registration("b", 0, 4096), object->fd(), &pinned).ok());
  EXPECT_FALSE(pinned);
  auto b = unpinnable.Resolve(kAlice, Ref("b", 0, 16), 16, "q.shared_memory");
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->region->pinned());
  ASSERT_TRUE(unpinnable.Unregister(kAlice, "b").ok());
  b->region.reset();
  EXPECT_EQ(unpins, 1);
}

// The descriptor socket takes only what a region may safely be made of.
TEST(DescriptorSocket, AcceptsOnlySealedWritableMemfds) {
  // A sealed memfd (the client's buffer) passes; it cannot shrink any more.
  auto object = Object(4096);
  EXPECT_TRUE(DescriptorSocket::CheckDescriptor(object->fd()).ok());
  EXPECT_NE(ftruncate(object->fd(), 0), 0);
  EXPECT_EQ(errno, EPERM);

  auto expect_refused = [](int fd, const std::string& words) {
    const absl::Status s = DescriptorSocket::CheckDescriptor(fd);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), words)) << s;
  };
  const int unsealed = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(unsealed, 0);
  expect_refused(unsealed, "shrinking");
  const int no_sealing = memfd_create("t", MFD_CLOEXEC);
  expect_refused(no_sealing, "shrinking");  // sealing not allowed: F_SEAL_SEAL only
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  expect_refused(pipe_fds[0], "memory object");
  char path[] = "/tmp/attnserve-fd-XXXXXX";
  const int file = mkstemp(path);
  ASSERT_GE(file, 0);
  unlink(path);
  expect_refused(file, "sealed");  // a regular file that cannot be sealed
  const int read_only = open(("/proc/self/fd/" + std::to_string(object->fd())).c_str(), O_RDONLY);
  ASSERT_GE(read_only, 0);
  expect_refused(read_only, "reading and writing");
  const int write_sealed = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(fcntl(write_sealed, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_WRITE), 0);
  expect_refused(write_sealed, "writes");
  for (int fd : {unsealed, no_sealing, pipe_fds[0], pipe_fds[1], file, read_only, write_sealed}) {
    close(fd);
  }
}

TEST(DescriptorSocket, TokensRegisterOnceAndExpire) {
  DescriptorSocket::Options options;
  options.token_lifetime = absl::Milliseconds(300);
  auto socket = DescriptorSocket::Start(options);
  ASSERT_TRUE(socket.ok()) << socket.status();
  EXPECT_TRUE(absl::StartsWith((*socket)->address(), "@"));
  auto object = Object(4096);
  auto token = wire::PassDescriptor((*socket)->address(), object->fd());
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(token->size(), 32u);  // 128 random bits
  EXPECT_EQ((*socket)->pending(), 1);
  auto fd = (*socket)->Claim(*token);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_TRUE(DescriptorSocket::CheckDescriptor(fd->get()).ok());
  EXPECT_EQ((*socket)->Claim(*token).status().code(), absl::StatusCode::kNotFound);  // once
  EXPECT_EQ((*socket)->Claim("0123").status().code(), absl::StatusCode::kNotFound);

  auto late = wire::PassDescriptor((*socket)->address(), object->fd());
  ASSERT_TRUE(late.ok());
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_EQ((*socket)->Claim(*late).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*socket)->pending(), 0);

  // What the socket refuses comes back as the server's reason.
  const int unsealed = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  auto refused = wire::PassDescriptor((*socket)->address(), unsealed);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "shrinking")) << refused.status();
  close(unsealed);
}

TEST(DescriptorSocket, RefusesMalformedMessages) {
  auto socket = DescriptorSocket::Start({});
  ASSERT_TRUE(socket.ok()) << socket.status();
  sockaddr_un sa;
  socklen_t length = 0;
  ASSERT_TRUE(wire::MakeUnixAddress((*socket)->address(), &sa, &length).ok());
  auto exchange = [&](const std::string& text, int fds) {
    const int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    EXPECT_EQ(connect(s, reinterpret_cast<const sockaddr*>(&sa), length), 0);
    auto object = Object(4096);
    std::vector<int> sent(static_cast<size_t>(fds), object->fd());
    iovec iov{const_cast<char*>(text.data()), text.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fds > 0) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds);
      std::memcpy(CMSG_DATA(c), sent.data(), sizeof(int) * fds);
    }
    EXPECT_GE(sendmsg(s, &msg, MSG_NOSIGNAL), 0);
    char answer[256];
    const ssize_t n = recv(s, answer, sizeof(answer), 0);
    close(s);
    return std::string(answer, n > 0 ? static_cast<size_t>(n) : 0);
  };
  EXPECT_TRUE(absl::StartsWith(exchange("attnserve-fd/1", 1), "ok ")) << exchange("", 0);
  EXPECT_TRUE(absl::StartsWith(exchange("attnserve-fd/1", 0), "error message: expected exactly"));
  EXPECT_TRUE(absl::StartsWith(exchange("attnserve-fd/1", 3), "error message: expected exactly"));
  EXPECT_TRUE(absl::StartsWith(exchange("hello", 1), "error message: expected 'attnserve-fd/1'"));
  // A client that connects and never sends is closed at its deadline; others are still served.
  const int idle = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_EQ(connect(idle, reinterpret_cast<const sockaddr*>(&sa), length), 0);
  EXPECT_TRUE(absl::StartsWith(exchange("attnserve-fd/1", 1), "ok "));
  close(idle);
}

client::ShapeSpec SmallSpec() {
  client::ShapeSpec s;
  s.dtype = attn::DType::kF16;
  s.batch = 2;
  s.seqlen_q = 5;
  s.seqlen_k = 7;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 16;
  return s;
}

TEST(RequestDecoderSharedMemory, TensorsResolveIntoTheRegion) {
  v1::AttendRequest r = client::MakeRandomRequest(SmallSpec(), 7);
  const std::string q_bytes = r.q().data(), k_bytes = r.k().data();
  auto buffer = client::SharedMemoryBuffer::Create(64 << 10);
  ASSERT_TRUE(buffer.ok());
  int64_t offset = 0;
  for (v1::Tensor* t : {r.mutable_q(), r.mutable_k(), r.mutable_v()}) {
    ASSERT_TRUE(client::MoveToSharedMemory(t, "r", **buffer, &offset).ok());
  }
  *r.mutable_o_shared_memory() =
      Ref("r", static_cast<uint64_t>(client::SharedMemoryAlignUp(offset)), q_bytes.size());
  SharedMemoryRegistry registry;
  ASSERT_TRUE(registry.Register(kAlice, Registration("r", 0, 64 << 10), (*buffer)->fd()).ok());
  const SharedMemoryScope alice(&registry, kAlice);

  auto d = DecodeAttendRequest(r, {}, &alice);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(std::memcmp(d->q, q_bytes.data(), q_bytes.size()), 0);
  EXPECT_EQ(std::memcmp(d->k, k_bytes.data(), k_bytes.size()), 0);
  EXPECT_NE(d->q, reinterpret_cast<const char*>((*buffer)->data()));  // the server's own mapping
  ASSERT_NE(d->o_out, nullptr);
  EXPECT_EQ(d->o_out_ref->offset(), r.o_shared_memory().offset());
  EXPECT_EQ(d->regions.size(), 4u);           // q, k, v and o each hold the region
  EXPECT_FALSE(d->InPinnedRegion(d->q, 16));  // this registry does not page-lock

  // Without a registry (shared memory off) the reference is refused, naming the field.
  ExpectError(DecodeAttendRequest(r, {}).status(), absl::StatusCode::kInvalidArgument,
              "q.shared_memory");
  // Bytes in both places.
  v1::AttendRequest both = r;
  both.mutable_k()->set_data("xx");
  ExpectError(DecodeAttendRequest(both, {}, &alice).status(), absl::StatusCode::kInvalidArgument,
              "k.data");
  // Another identity cannot name alice's region.
  const SharedMemoryScope bob(&registry, kBob);
  ExpectError(DecodeAttendRequest(r, {}, &bob).status(), absl::StatusCode::kNotFound,
              "q.shared_memory.region");
  // A wrong size for O, an unknown region for V.
  v1::AttendRequest bad_o = r;
  bad_o.mutable_o_shared_memory()->set_byte_size(q_bytes.size() - 2);
  ExpectError(DecodeAttendRequest(bad_o, {}, &alice).status(), absl::StatusCode::kInvalidArgument,
              "o_shared_memory.byte_size");
  v1::AttendRequest bad_v = r;
  bad_v.mutable_v()->mutable_shared_memory()->set_region("elsewhere");
  ExpectError(DecodeAttendRequest(bad_v, {}, &alice).status(), absl::StatusCode::kNotFound,
              "v.shared_memory.region");

  // AttendBackward reads d_o by reference too; O comes back in its response only.
  v1::AttendBackwardRequest b;
  *b.mutable_forward() = r;
  b.mutable_forward()->clear_o_shared_memory();
  *b.mutable_d_o() = r.q();
  auto db = DecodeAttendBackwardRequest(b, {}, &alice);
  ASSERT_TRUE(db.ok()) << db.status();
  EXPECT_EQ(std::memcmp(db->d_o, q_bytes.data(), q_bytes.size()), 0);
  *b.mutable_forward()->mutable_o_shared_memory() = r.o_shared_memory();
  ExpectError(DecodeAttendBackwardRequest(b, {}, &alice).status(),
              absl::StatusCode::kInvalidArgument, "forward.o_shared_memory");
}

TEST(ClientSharedMemoryBuffer, CreateMoveRead) {
  auto buffer = client::SharedMemoryBuffer::Create(1000);
  ASSERT_TRUE(buffer.ok());
  v1::Tensor t;
  t.set_data(std::string(300, 'x'));
  int64_t offset = 10;
  ASSERT_TRUE(client::MoveToSharedMemory(&t, "r", **buffer, &offset).ok());
  EXPECT_TRUE(t.data().empty());
  EXPECT_EQ(t.shared_memory().offset(), 256u);  // aligned up
  EXPECT_EQ(offset, 556);
  auto back = client::ReadSharedMemory(t.shared_memory(), **buffer);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, std::string(300, 'x'));
  t.set_data(std::string(500, 'y'));
  t.clear_shared_memory();
  EXPECT_EQ(client::MoveToSharedMemory(&t, "r", **buffer, &offset).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(client::ReadSharedMemory(Ref("r", 900, 200), **buffer).status().code(),
            absl::StatusCode::kOutOfRange);
  // Sealed against shrinking: a region made of it can never fault the server.
  EXPECT_TRUE(DescriptorSocket::CheckDescriptor((*buffer)->fd()).ok());
}

}  // namespace
}  // namespace attnserve
