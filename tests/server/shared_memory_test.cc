// Shared-memory regions: the registry (mapping, lookups, errors that name the field, lifetime),
// the same-host peer check, the decoder resolving tensors by reference, and the client's buffer.
#include "server/shared_memory.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>
#include <numeric>

#include "absl/strings/match.h"
#include "clients/cli/request_factory.h"
#include "clients/cli/shared_memory_buffer.h"
#include "server/request_decoder.h"

namespace attnserve {
namespace {

// A client-side object whose bytes are 0, 1, 2, ... (mod 251), still linked so that the
// registry can open it by name.
std::unique_ptr<client::SharedMemoryBuffer> Object(int64_t bytes) {
  auto buffer = client::SharedMemoryBuffer::Create(bytes);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  for (int64_t i = 0; i < bytes; ++i) (*buffer)->data()[i] = static_cast<std::byte>(i % 251);
  return *std::move(buffer);
}

v1::RegisterSharedMemoryRequest Registration(const std::string& name, const std::string& key,
                                             uint64_t offset, uint64_t bytes) {
  v1::RegisterSharedMemoryRequest r;
  r.set_name(name);
  r.set_key(key);
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
  ASSERT_TRUE(registry.Register(Registration("a", object->key(), 4100, 5000)).ok());
  EXPECT_EQ(registry.size(), 1);
  EXPECT_EQ(registry.mapped_bytes(), 5000u);
  auto span = registry.Resolve(Ref("a", 10, 100), 100, "q.shared_memory");
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
  ASSERT_TRUE(registry.Register(Registration("a", object->key(), 0, 8192)).ok());
  auto span = registry.Resolve(Ref("a", 0, 8192), 8192, "q.shared_memory");
  ASSERT_TRUE(span.ok());
  object.reset();  // the client unmaps and removes the name
  auto removed = registry.Unregister("a");
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 1);
  EXPECT_EQ(registry.size(), 0);
  // Still mapped for the request that resolved it.
  EXPECT_EQ(span->data[8191], static_cast<std::byte>(8191 % 251));
  ExpectError(registry.Resolve(Ref("a", 0, 1), 1, "k.shared_memory").status(),
              absl::StatusCode::kInvalidArgument, "k.shared_memory.region");
  ExpectError(registry.Unregister("a").status(), absl::StatusCode::kNotFound, "name");
}

TEST(SharedMemoryRegistry, RegistrationErrorsNameTheField) {
  auto object = Object(4096);
  SharedMemoryRegistry registry;
  ExpectError(registry.Register(Registration("", object->key(), 0, 16)),
              absl::StatusCode::kInvalidArgument, "name");
  ExpectError(registry.Register(Registration("a", "../etc/passwd", 0, 16)),
              absl::StatusCode::kInvalidArgument, "key");
  ExpectError(registry.Register(Registration("a", "/", 0, 16)), absl::StatusCode::kInvalidArgument,
              "key");
  ExpectError(registry.Register(Registration("a", "/attnserve-no-such-object", 0, 16)),
              absl::StatusCode::kNotFound, "key");
  ExpectError(registry.Register(Registration("a", object->key(), 0, 0)),
              absl::StatusCode::kInvalidArgument, "byte_size");
  ExpectError(registry.Register(Registration("a", object->key(), 4000, 97)),
              absl::StatusCode::kInvalidArgument, "byte_size");
  ExpectError(registry.Register(Registration("a", object->key(), ~uint64_t{0}, 2)),
              absl::StatusCode::kInvalidArgument, "byte_size");
  ASSERT_TRUE(registry.Register(Registration("a", object->key(), 0, 4096)).ok());
  ExpectError(registry.Register(Registration("a", object->key(), 0, 4096)),
              absl::StatusCode::kAlreadyExists, "name");
  EXPECT_EQ(registry.size(), 1);
}

TEST(SharedMemoryRegistry, ResolveChecksSizeAndBounds) {
  auto object = Object(4096);
  SharedMemoryRegistry registry;
  ASSERT_TRUE(registry.Register(Registration("a", object->key(), 0, 1000)).ok());
  ExpectError(registry.Resolve(Ref("a", 0, 99), 100, "v.shared_memory").status(),
              absl::StatusCode::kInvalidArgument, "v.shared_memory.byte_size");
  ExpectError(registry.Resolve(Ref("a", 901, 100), 100, "v.shared_memory").status(),
              absl::StatusCode::kInvalidArgument, "v.shared_memory.offset");
  ExpectError(registry.Resolve(Ref("a", ~uint64_t{0} - 10, 100), 100, "v.shared_memory").status(),
              absl::StatusCode::kInvalidArgument, "v.shared_memory.offset");
  EXPECT_TRUE(registry.Resolve(Ref("a", 900, 100), 100, "v.shared_memory").ok());
}

TEST(SharedMemoryRegistry, UnregisterEverything) {
  auto object = Object(4096);
  SharedMemoryRegistry registry;
  for (const char* name : {"a", "b", "c"}) {
    ASSERT_TRUE(registry.Register(Registration(name, object->key(), 0, 64)).ok());
  }
  auto removed = registry.Unregister("");
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 3);
  EXPECT_EQ(registry.mapped_bytes(), 0u);
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
  SharedMemoryRegistry registry(pinning);
  bool pinned = false;
  ASSERT_TRUE(registry.Register(Registration("a", object->key(), 4100, 5000), &pinned).ok());
  EXPECT_TRUE(pinned);
  EXPECT_EQ(pins, 1);
  auto span = registry.Resolve(Ref("a", 0, 5000), 5000, "q.shared_memory");
  ASSERT_TRUE(span.ok());
  EXPECT_TRUE(span->region->pinned());
  EXPECT_TRUE(span->region->Contains(span->data + 10, 4990));
  EXPECT_FALSE(span->region->Contains(span->data + 10, 4991));
  EXPECT_FALSE(span->region->Contains(span->data - 1, 1));
  ASSERT_TRUE(registry.Unregister("a").ok());
  EXPECT_EQ(unpins, 0);  // a request still holds it
  span->region.reset();
  EXPECT_EQ(unpins, 1);

  // A region that cannot be page-locked is still served, unpinned.
  HostMemoryPinning failing;
  failing.pin = [](void*, int64_t) { return absl::UnavailableError("no"); };
  failing.unpin = [&](void*) { ++unpins; };
  SharedMemoryRegistry unpinnable(failing);
  ASSERT_TRUE(unpinnable.Register(Registration("b", object->key(), 0, 4096), &pinned).ok());
  EXPECT_FALSE(pinned);
  auto b = unpinnable.Resolve(Ref("b", 0, 16), 16, "q.shared_memory");
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->region->pinned());
  ASSERT_TRUE(unpinnable.Unregister("b").ok());
  b->region.reset();
  EXPECT_EQ(unpins, 1);
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
  ASSERT_TRUE(registry.Register(Registration("r", (*buffer)->key(), 0, 64 << 10)).ok());

  auto d = DecodeAttendRequest(r, {}, &registry);
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
  ExpectError(DecodeAttendRequest(both, {}, &registry).status(), absl::StatusCode::kInvalidArgument,
              "k.data");
  // A wrong size for O, an unknown region for V.
  v1::AttendRequest bad_o = r;
  bad_o.mutable_o_shared_memory()->set_byte_size(q_bytes.size() - 2);
  ExpectError(DecodeAttendRequest(bad_o, {}, &registry).status(),
              absl::StatusCode::kInvalidArgument, "o_shared_memory.byte_size");
  v1::AttendRequest bad_v = r;
  bad_v.mutable_v()->mutable_shared_memory()->set_region("elsewhere");
  ExpectError(DecodeAttendRequest(bad_v, {}, &registry).status(),
              absl::StatusCode::kInvalidArgument, "v.shared_memory.region");

  // AttendBackward reads d_o by reference too; O comes back in its response only.
  v1::AttendBackwardRequest b;
  *b.mutable_forward() = r;
  b.mutable_forward()->clear_o_shared_memory();
  *b.mutable_d_o() = r.q();
  auto db = DecodeAttendBackwardRequest(b, {}, &registry);
  ASSERT_TRUE(db.ok()) << db.status();
  EXPECT_EQ(std::memcmp(db->d_o, q_bytes.data(), q_bytes.size()), 0);
  *b.mutable_forward()->mutable_o_shared_memory() = r.o_shared_memory();
  ExpectError(DecodeAttendBackwardRequest(b, {}, &registry).status(),
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
  // Unlinking removes the name but not the memory.
  const std::string key = (*buffer)->key();
  (*buffer)->Unlink();
  SharedMemoryRegistry registry;
  EXPECT_EQ(registry.Register(Registration("gone", key, 0, 16)).code(),
            absl::StatusCode::kNotFound);
  (*buffer)->data()[999] = std::byte{1};
}

}  // namespace
}  // namespace attnserve
