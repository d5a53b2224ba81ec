// libFuzzer target: arbitrary bytes through the door's whole path short of an engine: decode,
// validate under the server's limits, and plan (the batch key, the packing of a batch, the
// staging layout a lane would use). Half the inputs are parsed as a serialized request (the wire
// path); the other half build a request field by field, which reaches the shape and cu_seqlens
// checks far more often than random protobuf does. Every accepted request then also goes through
// the AttendBackward decoder with fuzzed d_o, o and lse. Tensors sometimes refer to a registered
// shared-memory region (or to one that is not) instead of carrying bytes. Whatever a decoder
// accepts must describe exactly the bytes it was given, stay within every limit, and plan into
// a layout that fits; a tensor in shared memory must lie inside the region. The seed corpus is
// tests/server/fuzz_corpus (valid requests of each layout, encoded by protoc).
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "proto/wire/request_decoder.h"
#include "server/shared_memory.h"
#include "server/staging.h"
#include "server/work.h"

namespace {

constexpr uint64_t kRegionBytes = 64 << 10;

// The server's limits, small enough that fuzzed requests reach them.
attnserve::DecodeLimits Limits() {
  attnserve::DecodeLimits limits;
  limits.memory_limit_bytes = int64_t{64} << 20;
  limits.max_heads = 24;
  limits.max_sequences = 16;
  return limits;
}

// Aborts unless `offsets` (in order) are aligned, increasing, and each range ends before the
// next begins.
void CheckLayout(const std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t end) {
  int64_t at = 0;
  for (const auto& [offset, bytes] : ranges) {
    if (offset % attnserve::kStagingAlign != 0 || offset < at || bytes < 0) std::abort();
    at = offset + bytes;
  }
  if (end < at) std::abort();
}

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

const attnserve::SharedMemoryScope* Scope() {
  static const auto* scope = new attnserve::SharedMemoryScope(&Registry(), kOwner);
  return scope;
}

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
  const attn::AttentionProblem& p = decoded->problem();
  const int64_t q_bytes = p.total_q() * p.num_heads * p.head_dim * attn::DTypeSize(p.dtype);
  const int64_t lse_bytes = p.total_q() * p.num_heads * 4;
  const bool with_forward = decoded->o != nullptr;
  if (q_bytes != ClaimedBytes(r.d_o()) || with_forward != (decoded->lse != nullptr) ||
      (with_forward && (q_bytes != ClaimedBytes(r.o()) || lse_bytes != ClaimedBytes(r.lse()))) ||
      attnserve::BackwardWorkingSetBytes(p) > limits.memory_limit_bytes) {
    std::abort();  // accepted a backward request whose tensors do not match its problem
  }
  const attnserve::BackwardStaging at = attnserve::BackwardStaging::For(p);
  const int64_t kv_bytes = p.total_k() * p.num_kv_heads * p.head_dim * attn::DTypeSize(p.dtype);
  CheckLayout({{at.q, q_bytes},
               {at.k, kv_bytes},
               {at.v, kv_bytes},
               {at.d_o, q_bytes},
               {at.o, q_bytes},
               {at.lse, lse_bytes},
               {at.dq, q_bytes},
               {at.dk, kv_bytes},
               {at.dv, kv_bytes}},
              at.end);
  if (at.end > attnserve::BackwardWorkingSetBytes(p) + 9 * attnserve::kStagingAlign) std::abort();
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
  const attnserve::DecodeLimits limits = Limits();
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
  // Every count the request named is within the limits.
  if (p.num_heads > limits.max_heads || p.batch() > limits.max_sequences ||
      p.effective_window_left() < -1 || p.effective_window_right() < -1) {
    std::abort();
  }
  CheckInRegion(request.q(), decoded->q, q_bytes);
  CheckInRegion(request.k(), decoded->k, kv_bytes);
  CheckInRegion(request.v(), decoded->v, kv_bytes);
  if (request.has_o_shared_memory() != (decoded->o_out != nullptr)) std::abort();

  // The plan: the request batched with a copy of itself, as a lane packs compatible requests.
  const attn::AttentionProblem packed = attnserve::PackProblems({&p, &p});
  if (!attn::ValidateProblem(packed).ok() || packed.total_q() != 2 * p.total_q() ||
      packed.total_k() != 2 * p.total_k() || packed.batch() != 2 * p.batch() ||
      !(attnserve::BatchKey::Of(0, packed) == attnserve::BatchKey::Of(0, p))) {
    std::abort();
  }
  const bool lse = decoded->return_lse;
  const attnserve::ForwardStaging at = attnserve::ForwardStaging::For(packed, lse, false);
  const int64_t lse_bytes = lse ? packed.total_q() * packed.num_heads * 4 : 0;
  CheckLayout({{at.q, 2 * q_bytes},
               {at.k, 2 * kv_bytes},
               {at.v, 2 * kv_bytes},
               {at.o, 2 * q_bytes},
               {at.lse, lse_bytes}},
              at.end);
  if (at.end > 2 * attnserve::WorkingSetBytes(p) + 5 * attnserve::kStagingAlign) std::abort();
  if (attnserve::ForwardStaging::For(p, lse, true).end != (lse ? lse_bytes / 2 : 0)) std::abort();
  if (decoded->o_out != nullptr) {
    attnserve::v1::Tensor o;
    *o.mutable_shared_memory() = request.o_shared_memory();
    CheckInRegion(o, reinterpret_cast<const char*>(decoded->o_out), q_bytes);
  }
  return 0;
}
