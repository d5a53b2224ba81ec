// libFuzzer target: arbitrary bytes into the AttendRequest decoder/validator. Half the inputs
// are parsed as a serialized request (the wire path); the other half build a request field by
// field, which reaches the shape and cu_seqlens checks far more often than random protobuf does.
// Every accepted request then also goes through the AttendBackward decoder with fuzzed d_o, o
// and lse. Tensors sometimes refer to a registered shared-memory region (or to one that is not)
// instead of carrying bytes. Whatever a decoder accepts must describe exactly the bytes it was
// given, and a tensor in shared memory must lie inside the region.
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "attnserve/v1/attention.pb.h"
#include "server/request_decoder.h"
#include "server/shared_memory.h"

namespace {

constexpr uint64_t kRegionBytes = 64 << 10;

const attnserve::Identity kOwner{"fuzzer"};

// One region, "fuzz", registered for the whole run from a sealed memfd, as clients make them.
const attnserve::SharedMemoryRegistry& Registry() {
  static attnserve::SharedMemoryRegistry* registry = [] {
    auto* r = new attnserve::SharedMemoryRegistry;
    const int fd = memfd_create("attnserve-fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, kRegionBytes) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
      std::abort();
    }
    attnserve::v1::RegisterSharedMemoryRequest request;
    request.set_name("fuzz");
    request.set_offset(0);
    request.set_byte_size(kRegionBytes);
    if (!r->Register(kOwner, request, fd).ok()) std::abort();
    close(fd);
    return r;
  }();
  return *registry;
}

attnserve::SharedMemoryScope Scope() { return {&Registry(), kOwner}; }

// The bytes a tensor claims: its data, or its shared-memory range.
int64_t ClaimedBytes(const attnserve::v1::Tensor& t) {
  return t.has_shared_memory() ? static_cast<int64_t>(t.shared_memory().byte_size())
                               : static_cast<int64_t>(t.data().size());
}

// Aborts unless `p` .. p + bytes lies inside the "fuzz" region when `t` is in shared memory.
void CheckInRegion(const attnserve::v1::Tensor& t, const char* p, int64_t bytes) {
  if (!t.has_shared_memory()) return;
  auto span = Registry().Resolve(kOwner, t.shared_memory(), static_cast<uint64_t>(bytes), "t");
  if (!span.ok() || reinterpret_cast<const std::byte*>(p) != span->data ||
      span->data + bytes > span->region->data() + span->region->size()) {
    std::abort();
  }
}

void FillTensor(FuzzedDataProvider& in, attnserve::v1::Tensor* t) {
  t->set_dtype(static_cast<attnserve::v1::DType>(in.ConsumeIntegralInRange<int>(0, 4)));
  const int rank = in.ConsumeIntegralInRange<int>(0, 5);
  int64_t elements = 1;
  for (int i = 0; i < rank; ++i) {
    const int64_t d = in.ConsumeIntegralInRange<int64_t>(-2, 40);
    t->add_shape(d);
    elements *= d > 0 ? d : 1;
  }
  // Usually the right length for float32/16, sometimes off by a little.
  const int64_t size =
      elements * (in.ConsumeBool() ? 4 : 2) + in.ConsumeIntegralInRange<int>(-1, 1);
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {  // by reference, sometimes also with data
    attnserve::v1::SharedMemoryRef& ref = *t->mutable_shared_memory();
    ref.set_region(in.ConsumeBool() ? "fuzz" : "missing");
    ref.set_offset(in.ConsumeIntegralInRange<uint64_t>(0, kRegionBytes + 8));
    ref.set_byte_size(size > 0 ? static_cast<uint64_t>(size) : in.ConsumeIntegral<uint64_t>());
    if (in.ConsumeIntegralInRange<int>(0, 7) != 0) return;
  }
  if (size > 0 && size < (1 << 20)) t->mutable_data()->resize(static_cast<size_t>(size), '\x3c');
}

// The backward decoder on an accepted forward request: d_o usually like q, o/lse sometimes.
void CheckBackward(const attnserve::v1::AttendRequest& forward,
                   const attnserve::DecodeLimits& limits, const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  attnserve::v1::AttendBackwardRequest r;
  *r.mutable_forward() = forward;
  if (in.ConsumeBool()) {
    *r.mutable_d_o() = forward.q();
  } else {
    FillTensor(in, r.mutable_d_o());
  }
  if (in.ConsumeBool()) *r.mutable_o() = forward.q();
  if (in.ConsumeBool()) FillTensor(in, r.mutable_lse());
  const auto decoded = attnserve::DecodeAttendBackwardRequest(r, limits, Scope());
  if (!decoded.ok()) return;
  const attn::AttentionProblem& p = decoded->problem;
  const int64_t q_bytes = p.total_q() * p.num_heads * p.head_dim * attn::DTypeSize(p.dtype);
  const int64_t lse_bytes = p.total_q() * p.num_heads * 4;
  const bool with_forward = decoded->o != nullptr;
  if (q_bytes != ClaimedBytes(r.d_o()) || with_forward != (decoded->lse != nullptr) ||
      (with_forward && (q_bytes != ClaimedBytes(r.o()) || lse_bytes != ClaimedBytes(r.lse()))) ||
      attnserve::BackwardWorkingSetBytes(p) > limits.memory_limit_bytes) {
    std::abort();  // accepted a backward request whose tensors do not match its problem
  }
  CheckInRegion(r.d_o(), decoded->d_o, q_bytes);
  if (with_forward) {
    CheckInRegion(r.o(), decoded->o, q_bytes);
    CheckInRegion(r.lse(), decoded->lse, lse_bytes);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  attnserve::v1::AttendRequest request;
  if (data[0] & 1) {
    if (!request.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  } else {
    FuzzedDataProvider in(data + 1, size - 1);
    FillTensor(in, request.mutable_q());
    FillTensor(in, request.mutable_k());
    if (in.ConsumeBool()) {
      *request.mutable_v() = request.k();
    } else {
      FillTensor(in, request.mutable_v());
    }
    const int n = in.ConsumeIntegralInRange<int>(0, 6);
    for (int i = 0; i < n; ++i) request.add_cu_seqlens_q(in.ConsumeIntegralInRange<int>(-1, 64));
    const int m = in.ConsumeIntegralInRange<int>(0, 6);
    for (int i = 0; i < m; ++i) request.add_cu_seqlens_k(in.ConsumeIntegralInRange<int>(-1, 64));
    request.set_causal(in.ConsumeBool());
    if (in.ConsumeBool()) request.set_window_left(in.ConsumeIntegralInRange<int>(-3, 50));
    if (in.ConsumeBool()) request.set_window_right(in.ConsumeIntegralInRange<int>(-3, 50));
    request.set_softmax_scale(in.ConsumeFloatingPoint<float>());
    request.set_path(static_cast<attnserve::v1::Path>(in.ConsumeIntegralInRange<int>(-1, 5)));
    if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
      attnserve::v1::SharedMemoryRef& ref = *request.mutable_o_shared_memory();
      ref.set_region(in.ConsumeBool() ? "fuzz" : "missing");
      ref.set_offset(in.ConsumeIntegralInRange<uint64_t>(0, kRegionBytes + 8));
      ref.set_byte_size(static_cast<uint64_t>(ClaimedBytes(request.q())));
    }
  }
  attnserve::DecodeLimits limits;
  limits.memory_limit_bytes = int64_t{64} << 20;
  const auto decoded = attnserve::DecodeAttendRequest(request, limits, Scope());
  if (!decoded.ok()) return 0;
  CheckBackward(request, limits, data, size);
  const attn::AttentionProblem& p = decoded->problem;
  const int64_t es = attn::DTypeSize(p.dtype);
  const int64_t q_bytes = p.total_q() * p.num_heads * p.head_dim * es;
  const int64_t kv_bytes = p.total_k() * p.num_kv_heads * p.head_dim * es;
  if (q_bytes != ClaimedBytes(request.q()) || kv_bytes != ClaimedBytes(request.k()) ||
      kv_bytes != ClaimedBytes(request.v()) ||
      attnserve::WorkingSetBytes(p) > limits.memory_limit_bytes || !attn::ValidateProblem(p).ok()) {
    std::abort();  // accepted a request whose tensors do not match its problem
  }
  CheckInRegion(request.q(), decoded->q, q_bytes);
  CheckInRegion(request.k(), decoded->k, kv_bytes);
  CheckInRegion(request.v(), decoded->v, kv_bytes);
  if (request.has_o_shared_memory() != (decoded->o_out != nullptr)) std::abort();
  if (decoded->o_out != nullptr) {
    attnserve::v1::Tensor o;
    *o.mutable_shared_memory() = request.o_shared_memory();
    CheckInRegion(o, reinterpret_cast<const char*>(decoded->o_out), q_bytes);
  }
  return 0;
}
