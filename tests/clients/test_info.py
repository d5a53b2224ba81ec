"""info(): a typed dataclass with every field of the proto's ServerInfo, defaults included."""
import dataclasses
import time

import numpy as np

import attnserve
from attnserve.v1 import attention_pb2 as pb

RECORDS = {"ServerInfo": attnserve.ServerInfo, "Device": attnserve.Device,
           "Limits": attnserve.Limits, "Stats": attnserve.Stats, "Timing": attnserve.Timing,
           "BatchInfo": attnserve.BatchInfo, "SessionLimits": attnserve.SessionLimits,
           "Session": attnserve.SessionInfo}


def test_every_proto_field_is_a_dataclass_field():
    """A field added to the proto without its dataclass field fails here."""
    for name, cls in RECORDS.items():
        message = getattr(pb, name).DESCRIPTOR
        assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in message.fields], name


def test_values_and_types(client):
    info = client.info()
    assert isinstance(info, attnserve.ServerInfo)
    assert info.gpu is False  # a default-valued field is present (the CPU server)
    assert info.auth_required is False
    assert info.version and "cpu_tiled" in info.engines and "cpu_tiled" in info.backward_engines
    assert set(info.dtypes) == {"float32", "float16", "bfloat16"}
    assert "cpu" in info.paths
    assert info.devices and info.devices[0].kind == "cpu"
    assert isinstance(info.shared_memory_socket, str)
    for record in (info.limits, info.stats) + info.devices:
        for f in dataclasses.fields(record):
            value = getattr(record, f.name)
            if f.type is int or f.type == "int":
                assert type(value) is int, (type(record).__name__, f.name, value)
    assert info.limits.max_message_bytes > 0 and info.limits.max_head_dim >= 128
    assert all(type(d) is int for d in info.head_dims)


def test_stats_count(client, rng):
    before = client.info().stats.requests_completed
    q = rng.uniform(-1, 1, (1, 4, 1, 8)).astype(np.float32)
    client.attend(q, q, q)
    for _ in range(100):  # the server may count a request just after answering it
        if client.info().stats.requests_completed == before + 1:
            break
        time.sleep(0.02)
    assert client.info().stats.requests_completed == before + 1


def test_frozen_and_hashable(client):
    info = client.info()
    assert dataclasses.asdict(info)["limits"]["max_head_dim"] == info.limits.max_head_dim
    hash(info)  # tuples all the way down
    try:
        info.gpu = True
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("ServerInfo should be immutable")
