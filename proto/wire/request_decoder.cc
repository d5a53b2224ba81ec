#include "proto/wire/request_decoder.h"

#include <limits>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attn/status_macros.h"

namespace attnserve {
namespace {

// cu_seqlens are int32, so every token count must fit.
constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
// Bytes the server holds per sequence of a request: its cu_seqlens entries, in the decoded
// problem and again in the packed batch.
constexpr int64_t kSequenceIndexBytes = 4 * sizeof(int32_t);

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

std::string ShapeString(const v1::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

// Checks a tensor's dtype, rank and dimension ranges, and that its bytes match shape x dtype.
absl::Status CheckTensor(const char* name, const v1::Tensor& t, attn::DType dtype, int rank) {
  if (t.shape_size() != rank) {
    return Invalid(absl::StrCat(name, ".shape"),
                   absl::StrCat("expected ", rank, " dimensions like q, got ", ShapeString(t)));
  }
  int64_t elements = 1;
  for (int i = 0; i < rank; ++i) {
    const int64_t dim = t.shape(i);
    if (dim < 0 || dim > kMaxTokens) {
      return Invalid(absl::StrCat(name, ".shape[", i, "]"), absl::StrCat("out of range: ", dim));
    }
    if (dim != 0 && elements > std::numeric_limits<int64_t>::max() / 8 / dim) {
      return Invalid(absl::StrCat(name, ".shape"), absl::StrCat(ShapeString(t), " is too large"));
    }
    elements *= dim;
  }
  const int64_t expected = elements * attn::DTypeSize(dtype);
  if (t.has_shared_memory()) {
    // The byte count is checked against the reference when it is resolved.
    if (!t.data().empty()) {
      return Invalid(absl::StrCat(name, ".data"),
                     absl::StrCat(t.data().size(), " bytes while ", name,
                                  ".shared_memory is set: the elements go in one or the other"));
    }
    return absl::OkStatus();
  }
  if (static_cast<int64_t>(t.data().size()) != expected) {
    return Invalid(absl::StrCat(name, ".data"),
                   absl::StrCat(t.data().size(), " bytes, expected ", expected, " (shape ",
                                ShapeString(t), " x ", std::string(attn::DTypeName(dtype)), ")"));
  }
  return absl::OkStatus();
}

int64_t TensorBytes(const v1::Tensor& t, attn::DType dtype) {
  int64_t elements = 1;
  for (int64_t dim : t.shape()) elements *= dim;
  return elements * attn::DTypeSize(dtype);
}

// Where a checked tensor's elements are: its own bytes, or a registered shared-memory range
// (kept mapped by `d`).
absl::StatusOr<const char*> ElementsOf(const std::string& name, const v1::Tensor& t,
                                       attn::DType dtype, const SharedMemoryResolver* shared_memory,
                                       DecodedForward* d) {
  if (!t.has_shared_memory()) return t.data().data();
  if (shared_memory == nullptr) {
    return Invalid(absl::StrCat(name, ".shared_memory"),
                   "shared memory is disabled on this server; send the bytes in data");
  }
  absl::StatusOr<MemorySpan> span =
      shared_memory->Resolve(t.shared_memory(), static_cast<uint64_t>(TensorBytes(t, dtype)),
                             absl::StrCat(name, ".shared_memory"));
  if (!span.ok()) return span.status();
  d->regions.push_back(std::move(span->region));
  return reinterpret_cast<const char*>(span->data);
}

absl::Status CheckDim(const char* field, int64_t got, int64_t want, const char* what) {
  if (got != want) {
    return Invalid(field, absl::StrCat(got, " differs from ", what, " ", want));
  }
  return absl::OkStatus();
}

}  // namespace

TensorSizes TensorSizesOf(const attn::AttentionProblem& p) {
  const int64_t es = attn::DTypeSize(p.dtype);
  return {p.total_q() * p.num_heads * p.head_dim * es,
          p.total_k() * p.num_kv_heads * p.head_dim * es, p.total_q() * p.num_heads * 4};
}

int64_t WorkingSetBytes(const attn::AttentionProblem& p) {
  const TensorSizes s = TensorSizesOf(p);
  return 2 * s.q + 2 * s.kv + s.lse + (p.batch() + 1) * kSequenceIndexBytes;
}

int64_t BackwardWorkingSetBytes(const attn::AttentionProblem& p) {
  const TensorSizes s = TensorSizesOf(p);
  return 4 * s.q + 4 * s.kv + s.lse + (p.batch() + 1) * kSequenceIndexBytes;
}

absl::StatusOr<attn::DType> FromProtoDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return attn::DType::kF32;
    case v1::DTYPE_FLOAT16:
      return attn::DType::kF16;
    case v1::DTYPE_BFLOAT16:
      return attn::DType::kBF16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", static_cast<int>(dtype), " is not float32, float16 or bfloat16"));
  }
}

v1::DType ToProtoDType(attn::DType dtype) {
  switch (dtype) {
    case attn::DType::kF32:
      return v1::DTYPE_FLOAT32;
    case attn::DType::kF16:
      return v1::DTYPE_FLOAT16;
    case attn::DType::kBF16:
      return v1::DTYPE_BFLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DecodedForward> DecodeAttendRequest(const v1::AttendRequest& r,
                                                   const DecodeLimits& limits,
                                                   const SharedMemoryResolver* shared_memory) {
  if (!r.has_q()) return Invalid("q", "missing");
  if (!r.has_k()) return Invalid("k", "missing");
  if (!r.has_v()) return Invalid("v", "missing");
  if (!v1::Path_IsValid(r.path())) {
    return Invalid("path", absl::StrCat("unknown value ", static_cast<int>(r.path())));
  }

  auto dtype = FromProtoDType(r.q().dtype());
  if (!dtype.ok()) return Invalid("q.dtype", std::string(dtype.status().message()));
  for (const auto& [name, t] :
       {std::pair<const char*, const v1::Tensor*>{"k", &r.k()}, {"v", &r.v()}}) {
    if (t->dtype() != r.q().dtype()) {
      return Invalid(absl::StrCat(name, ".dtype"),
                     absl::StrCat(v1::DType_Name(t->dtype()), " differs from q.dtype ",
                                  v1::DType_Name(r.q().dtype())));
    }
  }

  const int rank = r.q().shape_size();
  if (rank != 3 && rank != 4) {
    return Invalid("q.shape", absl::StrCat("expected [batch, seqlen, heads, head_dim] or [tokens, "
                                           "heads, head_dim], got ",
                                           ShapeString(r.q())));
  }
  ATTN_RETURN_IF_ERROR(CheckTensor("q", r.q(), *dtype, rank));
  ATTN_RETURN_IF_ERROR(CheckTensor("k", r.k(), *dtype, rank));
  ATTN_RETURN_IF_ERROR(CheckTensor("v", r.v(), *dtype, rank));
  for (int i = 0; i < rank; ++i) {
    if (r.v().shape(i) != r.k().shape(i)) {
      return Invalid("v.shape", absl::StrCat(ShapeString(r.v()), " differs from k.shape ",
                                             ShapeString(r.k())));
    }
  }

  DecodedForward d;
  attn::AttentionProblem& p = d.problem;
  p.dtype = *dtype;
  const auto& qs = r.q().shape();
  const auto& ks = r.k().shape();
  if (rank == 4) {
    if (r.cu_seqlens_q_size() != 0 || r.cu_seqlens_k_size() != 0) {
      return Invalid("cu_seqlens_q", "only for the variable-length (3-D) layout");
    }
    ATTN_RETURN_IF_ERROR(CheckDim("k.shape[0]", ks[0], qs[0], "q.shape[0] (batch)"));
    ATTN_RETURN_IF_ERROR(CheckDim("k.shape[3]", ks[3], qs[3], "q.shape[3] (head_dim)"));
    if (qs[0] < 1 || qs[0] > limits.max_sequences) {
      return Invalid("q.shape[0]",
                     absl::StrCat("batch must be in [1, ", limits.max_sequences, "], got ", qs[0]));
    }
    if (qs[0] * qs[1] > kMaxTokens || ks[0] * ks[1] > kMaxTokens) {
      return Invalid("q.shape", "more than 2^31-1 tokens");
    }
    p.num_heads = static_cast<int>(qs[2]);
    p.num_kv_heads = static_cast<int>(ks[2]);
    p.head_dim = static_cast<int>(qs[3]);
    p.cu_seqlens_q.assign(1, 0);
    p.cu_seqlens_k.assign(1, 0);
    for (int64_t b = 0; b < qs[0]; ++b) {
      p.cu_seqlens_q.push_back(static_cast<int32_t>((b + 1) * qs[1]));
      p.cu_seqlens_k.push_back(static_cast<int32_t>((b + 1) * ks[1]));
    }
  } else {
    ATTN_RETURN_IF_ERROR(CheckDim("k.shape[2]", ks[2], qs[2], "q.shape[2] (head_dim)"));
    p.num_heads = static_cast<int>(qs[1]);
    p.num_kv_heads = static_cast<int>(ks[1]);
    p.head_dim = static_cast<int>(qs[2]);
    if (r.cu_seqlens_q_size() == 0 && r.cu_seqlens_k_size() == 0) {
      p.cu_seqlens_q = {0, static_cast<int32_t>(qs[0])};
      p.cu_seqlens_k = {0, static_cast<int32_t>(ks[0])};
    } else {
      if (r.cu_seqlens_q_size() == 0)
        return Invalid("cu_seqlens_q", "missing (cu_seqlens_k is set)");
      if (r.cu_seqlens_k_size() == 0)
        return Invalid("cu_seqlens_k", "missing (cu_seqlens_q is set)");
      for (const auto& [name, size] :
           {std::pair<const char*, int>{"cu_seqlens_q", r.cu_seqlens_q_size()},
            {"cu_seqlens_k", r.cu_seqlens_k_size()}}) {
        if (size - 1 > limits.max_sequences) {
          return Invalid(
              name, absl::StrCat(size, " entries: at most ", limits.max_sequences, " sequences (",
                                 limits.max_sequences + 1, " entries) per request"));
        }
      }
      p.cu_seqlens_q.assign(r.cu_seqlens_q().begin(), r.cu_seqlens_q().end());
      p.cu_seqlens_k.assign(r.cu_seqlens_k().begin(), r.cu_seqlens_k().end());
      if (p.cu_seqlens_q.back() != qs[0]) {
        return Invalid("cu_seqlens_q", absl::StrCat("last entry ", p.cu_seqlens_q.back(),
                                                    " differs from q.shape[0] ", qs[0]));
      }
      if (p.cu_seqlens_k.back() != ks[0]) {
        return Invalid("cu_seqlens_k", absl::StrCat("last entry ", p.cu_seqlens_k.back(),
                                                    " differs from k.shape[0] ", ks[0]));
      }
    }
  }
  if (p.num_heads < 1) return Invalid("q.shape", "num_heads must be >= 1");
  if (p.num_heads > limits.max_heads) {
    return Invalid("q.shape", absl::StrCat("num_heads ", p.num_heads, " is more than the ",
                                           limits.max_heads, " heads this server takes"));
  }
  if (p.num_kv_heads < 1) return Invalid("k.shape", "num_kv_heads must be >= 1");
  if (p.num_heads % p.num_kv_heads != 0) {
    return Invalid("k.shape",
                   absl::StrCat("num_kv_heads ", p.num_kv_heads, " does not divide num_heads ",
                                p.num_heads, " (GQA ratio must be an integer)"));
  }
  p.causal = r.causal();
  for (const auto& [name, has, value] :
       {std::tuple<const char*, bool, int32_t>{"window_left", r.has_window_left(), r.window_left()},
        {"window_right", r.has_window_right(), r.window_right()}}) {
    if (has && value < -1) {
      return Invalid(name, absl::StrCat(value,
                                        ": a window side is >= 0 keys, or -1 (or unset) "
                                        "for unbounded"));
    }
  }
  p.window_left = r.has_window_left() ? r.window_left() : -1;
  p.window_right = r.has_window_right() ? r.window_right() : -1;
  p.softmax_scale = r.softmax_scale();
  ATTN_RETURN_IF_ERROR(attn::ValidateProblem(p));

  const int64_t bytes = WorkingSetBytes(p);
  if (bytes > limits.memory_limit_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("request: needs ", bytes,
                                                     " bytes for Q, K, V, O, LSE and its sequence "
                                                     "index; the server's memory limit per batch "
                                                     "is ",
                                                     limits.memory_limit_bytes, " bytes"));
  }

  ATTN_ASSIGN_OR_RETURN(d.q, ElementsOf("q", r.q(), p.dtype, shared_memory, &d));
  ATTN_ASSIGN_OR_RETURN(d.k, ElementsOf("k", r.k(), p.dtype, shared_memory, &d));
  ATTN_ASSIGN_OR_RETURN(d.v, ElementsOf("v", r.v(), p.dtype, shared_memory, &d));
  if (r.has_o_shared_memory()) {
    if (shared_memory == nullptr) {
      return Invalid("o_shared_memory",
                     "shared memory is disabled on this server; O comes back in the response");
    }
    ATTN_ASSIGN_OR_RETURN(MemorySpan span,
                          shared_memory->Resolve(r.o_shared_memory(),
                                                 static_cast<uint64_t>(TensorBytes(r.q(), p.dtype)),
                                                 "o_shared_memory"));
    d.o_out = span.data;
    d.o_out_ref = &r.o_shared_memory();
    d.regions.push_back(std::move(span.region));
  }
  d.o_shape.assign(qs.begin(), qs.end());
  d.return_lse = r.return_lse();
  d.path = r.path();
  return d;
}

absl::StatusOr<DecodedForward> DecodeSessionAttendRequest(
    const v1::AttendRequest& r, const KvGeometry& session, const DecodeLimits& limits,
    const SharedMemoryResolver* shared_memory) {
  if (!r.has_q()) return Invalid("q", "missing");
  if (!v1::Path_IsValid(r.path())) {
    return Invalid("path", absl::StrCat("unknown value ", static_cast<int>(r.path())));
  }
  if (r.cu_seqlens_q_size() != 0 || r.cu_seqlens_k_size() != 0) {
    return Invalid("cu_seqlens_q", "not with session_id: a session step is one sequence");
  }
  if (r.append() != (r.has_k() || r.has_v())) {
    return r.append() ? Invalid(r.has_k() ? "v" : "k",
                                "missing: append needs k and v (the new "
                                "tokens' keys and values)")
                      : Invalid(r.has_k() ? "k" : "v",
                                "only with append: without it a step attends over the session's "
                                "keys as they are");
  }
  auto dtype = FromProtoDType(r.q().dtype());
  if (!dtype.ok()) return Invalid("q.dtype", std::string(dtype.status().message()));
  if (*dtype != session.dtype) {
    return Invalid("q.dtype",
                   absl::StrCat(v1::DType_Name(r.q().dtype()), " differs from the session's ",
                                v1::DType_Name(ToProtoDType(session.dtype))));
  }
  if (r.q().shape_size() != 3) {
    return Invalid("q.shape",
                   absl::StrCat("expected [tokens, heads, head_dim] with session_id, got ",
                                ShapeString(r.q())));
  }
  ATTN_RETURN_IF_ERROR(CheckTensor("q", r.q(), *dtype, 3));
  const auto& qs = r.q().shape();
  if (qs[2] != session.head_dim) {
    return Invalid("q.shape[2]", absl::StrCat("head_dim ", qs[2], " differs from the session's ",
                                              session.head_dim));
  }
  DecodedForward d;
  attn::AttentionProblem& p = d.problem;
  p.dtype = *dtype;
  p.num_heads = static_cast<int>(qs[1]);
  p.num_kv_heads = session.num_kv_heads;
  p.head_dim = session.head_dim;
  if (p.num_heads < 1 || p.num_heads > limits.max_heads) {
    return Invalid("q.shape[1]", absl::StrCat("num_heads must be in [1, ", limits.max_heads,
                                              "], got ", p.num_heads));
  }
  if (p.num_heads % p.num_kv_heads != 0) {
    return Invalid("q.shape[1]",
                   absl::StrCat("num_heads ", p.num_heads, " is not a multiple of the session's ",
                                p.num_kv_heads, " KV heads"));
  }
  int64_t appended = 0;
  if (r.append()) {
    for (const auto& [name, t] :
         {std::pair<const char*, const v1::Tensor*>{"k", &r.k()}, {"v", &r.v()}}) {
      if (t->dtype() != r.q().dtype()) {
        return Invalid(absl::StrCat(name, ".dtype"),
                       absl::StrCat(v1::DType_Name(t->dtype()), " differs from q.dtype ",
                                    v1::DType_Name(r.q().dtype())));
      }
      ATTN_RETURN_IF_ERROR(CheckTensor(name, *t, *dtype, 3));
      if (t->shape(1) != session.num_kv_heads || t->shape(2) != session.head_dim) {
        return Invalid(absl::StrCat(name, ".shape"),
                       absl::StrCat(ShapeString(*t), ": the session holds [tokens, ",
                                    session.num_kv_heads, ", ", session.head_dim, "]"));
      }
    }
    if (r.v().shape(0) != r.k().shape(0)) {
      return Invalid("v.shape", absl::StrCat(ShapeString(r.v()), " differs from k.shape ",
                                             ShapeString(r.k())));
    }
    appended = r.k().shape(0);
  }
  for (const auto& [name, has, value] :
       {std::tuple<const char*, bool, int32_t>{"window_left", r.has_window_left(), r.window_left()},
        {"window_right", r.has_window_right(), r.window_right()}}) {
    if (has && value < -1) {
      return Invalid(name, absl::StrCat(value,
                                        ": a window side is >= 0 keys, or -1 (or unset) "
                                        "for unbounded"));
    }
  }
  p.cu_seqlens_q = {0, static_cast<int32_t>(qs[0])};
  p.cu_seqlens_k = {0, static_cast<int32_t>(appended)};
  p.causal = r.causal();
  p.window_left = r.has_window_left() ? r.window_left() : -1;
  p.window_right = r.has_window_right() ? r.window_right() : -1;
  p.softmax_scale = r.softmax_scale();
  ATTN_RETURN_IF_ERROR(attn::ValidateProblem(p));
  const TensorSizes sizes = TensorSizesOf(p);
  const int64_t bytes = 2 * sizes.q + 2 * sizes.kv + sizes.lse + 2 * kSequenceIndexBytes;
  if (bytes > limits.memory_limit_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request: needs ", bytes, " bytes for Q, O, LSE and the keys it appends; ",
        "the server's memory limit per batch is ", limits.memory_limit_bytes, " bytes"));
  }
  ATTN_ASSIGN_OR_RETURN(d.q, ElementsOf("q", r.q(), p.dtype, shared_memory, &d));
  if (r.append()) {
    ATTN_ASSIGN_OR_RETURN(d.k, ElementsOf("k", r.k(), p.dtype, shared_memory, &d));
    ATTN_ASSIGN_OR_RETURN(d.v, ElementsOf("v", r.v(), p.dtype, shared_memory, &d));
  }
  if (r.has_o_shared_memory()) {
    if (shared_memory == nullptr) {
      return Invalid("o_shared_memory",
                     "shared memory is disabled on this server; O comes back in the response");
    }
    ATTN_ASSIGN_OR_RETURN(
        MemorySpan span, shared_memory->Resolve(r.o_shared_memory(), static_cast<uint64_t>(sizes.q),
                                                "o_shared_memory"));
    d.o_out = span.data;
    d.o_out_ref = &r.o_shared_memory();
    d.regions.push_back(std::move(span.region));
  }
  d.o_shape.assign(qs.begin(), qs.end());
  d.return_lse = r.return_lse();
  d.path = r.path();
  return d;
}

absl::StatusOr<DecodedKvRows> DecodeKvRows(const v1::Tensor& k, const v1::Tensor& v,
                                           const KvGeometry& session, const DecodeLimits& limits,
                                           const SharedMemoryResolver* shared_memory) {
  DecodedForward holder;  // keeps referenced regions
  int64_t rows = 0;
  for (const auto& [name, t] : {std::pair<const char*, const v1::Tensor*>{"k", &k}, {"v", &v}}) {
    auto dtype = FromProtoDType(t->dtype());
    if (!dtype.ok())
      return Invalid(absl::StrCat(name, ".dtype"), std::string(dtype.status().message()));
    if (*dtype != session.dtype) {
      return Invalid(absl::StrCat(name, ".dtype"),
                     absl::StrCat(v1::DType_Name(t->dtype()), " differs from the session's ",
                                  v1::DType_Name(ToProtoDType(session.dtype))));
    }
    ATTN_RETURN_IF_ERROR(CheckTensor(name, *t, *dtype, 3));
    if (t->shape(1) != session.num_kv_heads || t->shape(2) != session.head_dim) {
      return Invalid(absl::StrCat(name, ".shape"),
                     absl::StrCat(ShapeString(*t), ": the session holds [tokens, ",
                                  session.num_kv_heads, ", ", session.head_dim, "]"));
    }
    rows = t->shape(0);
  }
  if (v.shape(0) != k.shape(0)) {
    return Invalid("v.shape",
                   absl::StrCat(ShapeString(v), " differs from k.shape ", ShapeString(k)));
  }
  const int64_t bytes = 2 * TensorBytes(k, session.dtype);
  if (bytes > limits.memory_limit_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "k: a chunk of ", bytes, " bytes of K and V is over the server's memory limit per batch (",
        limits.memory_limit_bytes, " bytes); send it in smaller chunks"));
  }
  DecodedKvRows d;
  ATTN_ASSIGN_OR_RETURN(d.k, ElementsOf("k", k, session.dtype, shared_memory, &holder));
  ATTN_ASSIGN_OR_RETURN(d.v, ElementsOf("v", v, session.dtype, shared_memory, &holder));
  d.rows = rows;
  d.regions = std::move(holder.regions);
  return d;
}

absl::StatusOr<DecodedBackward> DecodeAttendBackwardRequest(
    const v1::AttendBackwardRequest& r, const DecodeLimits& limits,
    const SharedMemoryResolver* shared_memory) {
  if (!r.has_forward()) return Invalid("forward", "missing (q, k, v and the mask)");
  if (r.forward().has_o_shared_memory()) {
    return Invalid("forward.o_shared_memory",
                   "not used by AttendBackward (the gradients come back in the response)");
  }
  absl::StatusOr<DecodedForward> decoded = DecodeAttendRequest(r.forward(), limits, shared_memory);
  if (!decoded.ok()) {
    // Name the field as the client wrote it: forward.q.data, not q.data.
    return absl::Status(
        decoded.status().code(),
        absl::StrCat(
            decoded.status().code() == absl::StatusCode::kInvalidArgument ? "forward." : "",
            decoded.status().message()));
  }
  DecodedBackward d;
  d.forward = *std::move(decoded);
  d.forward.return_lse = false;
  const attn::AttentionProblem& p = d.forward.problem;
  const v1::Tensor& q = r.forward().q();
  const int rank = q.shape_size();
  auto same_as_q = [&](const char* name, const v1::Tensor& t) -> absl::Status {
    if (t.dtype() != q.dtype()) {
      return Invalid(absl::StrCat(name, ".dtype"),
                     absl::StrCat(v1::DType_Name(t.dtype()), " differs from forward.q.dtype ",
                                  v1::DType_Name(q.dtype())));
    }
    ATTN_RETURN_IF_ERROR(CheckTensor(name, t, p.dtype, rank));
    for (int i = 0; i < rank; ++i) {
      if (t.shape(i) != q.shape(i)) {
        return Invalid(
            absl::StrCat(name, ".shape"),
            absl::StrCat(ShapeString(t), " differs from forward.q.shape ", ShapeString(q)));
      }
    }
    return absl::OkStatus();
  };
  if (!r.has_d_o()) return Invalid("d_o", "missing (the gradient of the loss w.r.t. O)");
  ATTN_RETURN_IF_ERROR(same_as_q("d_o", r.d_o()));
  if (r.has_o() != r.has_lse()) {
    return Invalid(r.has_o() ? "lse" : "o",
                   "o and lse come together (the forward's outputs), or neither");
  }
  if (r.has_o()) {
    ATTN_RETURN_IF_ERROR(same_as_q("o", r.o()));
    const v1::Tensor& lse = r.lse();
    if (lse.dtype() != v1::DTYPE_FLOAT32) {
      return Invalid("lse.dtype",
                     absl::StrCat(v1::DType_Name(lse.dtype()), ", expected DTYPE_FLOAT32"));
    }
    ATTN_RETURN_IF_ERROR(CheckTensor("lse", lse, attn::DType::kF32, 2));
    if (lse.shape(0) != p.num_heads || lse.shape(1) != p.total_q()) {
      return Invalid("lse.shape", absl::StrCat(ShapeString(lse), ", expected [", p.num_heads, ", ",
                                               p.total_q(), "] (num_heads, total_q)"));
    }
    ATTN_ASSIGN_OR_RETURN(d.o, ElementsOf("o", r.o(), p.dtype, shared_memory, &d.forward));
    ATTN_ASSIGN_OR_RETURN(d.lse,
                          ElementsOf("lse", lse, attn::DType::kF32, shared_memory, &d.forward));
  }
  const int64_t bytes = BackwardWorkingSetBytes(p);
  if (bytes > limits.memory_limit_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request: the backward pass needs ", bytes,
                     " bytes for Q, K, V, O, dO, dQ, dK, dV and LSE; the server's memory limit "
                     "per batch is ",
                     limits.memory_limit_bytes, " bytes"));
  }
  ATTN_ASSIGN_OR_RETURN(d.d_o, ElementsOf("d_o", r.d_o(), p.dtype, shared_memory, &d.forward));
  d.k_shape.assign(r.forward().k().shape().begin(), r.forward().k().shape().end());
  d.deterministic = r.deterministic();
  return d;
}

}  // namespace attnserve
