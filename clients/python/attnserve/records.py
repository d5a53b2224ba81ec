"""The server's messages as typed, immutable dataclasses: ServerInfo (GetServerInfo) with every
field of the proto's, the Timing and BatchInfo of an attend answer, and SessionInfo (a KV
session's Session message).

Fields the server left at their defaults are present with those defaults (``info().gpu`` is
False on a CPU server), int64 values are ints, enums are the names the client's arguments use
("bfloat16", "fused"), repeated fields are tuples."""
import dataclasses
from dataclasses import dataclass
from typing import Tuple

from google.protobuf.descriptor import FieldDescriptor

from attnserve._proto import enum_names


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cpu" or "cuda"
    memory_bytes: int


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int
    max_batch_tokens: int
    max_batch_requests: int
    max_queue_delay_us: int
    queue_capacity: int
    memory_limit_bytes: int  # per lane: one batch's Q, K, V, O and LSE must fit
    max_head_dim: int
    batch_lanes: int
    max_heads: int
    max_sequences: int
    max_stream_buffer_bytes: int
    max_shared_memory_regions: int  # per identity


@dataclass(frozen=True)
class Stats:
    requests_accepted: int
    requests_rejected: int
    requests_completed: int
    requests_failed: int
    batches: int
    batched_requests: int
    max_batch_requests_seen: int


@dataclass(frozen=True)
class SessionLimits:
    page_bytes: int  # 0: the server offers no KV sessions
    pool_bytes: int  # per device
    max_tokens: int  # a session's default (and largest) length
    default_ttl_seconds: int
    max_sessions: int  # per identity


@dataclass(frozen=True)
class ServerInfo:
    version: str
    devices: Tuple[Device, ...]
    engines: Tuple[str, ...]  # in the order AUTO prefers them
    paths: Tuple[str, ...]  # what path= may ask for: "auto", "fused", "naive", "cpu"
    gpu: bool  # False: the CPU engine serves every request
    dtypes: Tuple[str, ...]
    head_dims: Tuple[int, ...]  # the GPU kernels' specialisations; any up to max_head_dim runs
    limits: Limits
    stats: Stats
    auth_required: bool
    backward_engines: Tuple[str, ...]  # empty: no training (backward) on this server
    shared_memory: bool
    shared_memory_socket: str  # where SharedMemoryRegion passes its descriptor; "" = disabled
    sessions: SessionLimits
    deterministic_backward: bool  # every backward runs deterministic, whatever the request says


@dataclass(frozen=True)
class Timing:
    queue_us: int  # accepted -> its batch started
    compute_us: int  # the batch's staging, engine call and copies back
    total_us: int  # accepted -> response ready
    kernel_us: int  # the engine call alone, shared by the batch; 0 when not timed


@dataclass(frozen=True)
class BatchInfo:
    batch_id: int
    requests: int
    tokens: int  # query + key tokens of the whole batch


@dataclass(frozen=True)
class SessionInfo:
    """A KV session as the server holds it (the proto's Session message)."""

    session_id: str  # 128 random bits, hex; only the identity that created it can use it
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens: int
    max_tokens: int
    bytes: int  # pool bytes its pages hold
    pages: int
    page_tokens: int
    device: str  # "cuda:N" or "cpu"
    created_unix_ms: int
    last_used_unix_ms: int
    ttl_seconds: int


_RECORDS = {cls.__name__: cls for cls in (Device, Limits, Stats, SessionLimits, ServerInfo, Timing,
                                          BatchInfo)}
_RECORDS["Session"] = SessionInfo  # "Session" is the handle (session.py)


def from_message(cls, message):
    """One of the dataclasses above, from the message of the same name."""
    values = {}
    for field in dataclasses.fields(cls):
        descriptor = message.DESCRIPTOR.fields_by_name[field.name]
        convert = _converter(descriptor)
        value = getattr(message, field.name)
        if descriptor.label == FieldDescriptor.LABEL_REPEATED:
            values[field.name] = tuple(convert(v) for v in value)
        else:
            values[field.name] = convert(value)
    return cls(**values)


def _converter(descriptor):
    if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
        record = _RECORDS[descriptor.message_type.name]
        return lambda m: from_message(record, m)
    if descriptor.type == FieldDescriptor.TYPE_ENUM:
        names = {number: name for name, number in enum_names(descriptor.enum_type).items()}
        return lambda v: names.get(v, str(v))
    return lambda v: v

