"""Shared memory: a sealed memfd handed over ServerInfo.shared_memory_socket (SCM_RIGHTS), then
RegisterSharedMemory with the token, as RegisterSharedMemoryRequest's comment in attention.proto
says. The descriptor handoff is checked against a stand-in socket here; the tests against the
real server skip while its GetServerInfo names no shared_memory_socket."""
import asyncio
import fcntl
import os
import socket
import threading

import grpc
import numpy as np
import pytest

import attnserve
from attnserve import shared_memory as shm
from reference import GRAD_TOLERANCE, TOLERANCE, assert_close, attention, rounded


def test_memfd_is_sealed_against_shrinking():
    fd, mapping = shm.sealed_memfd("attnserve-test", 8192)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        assert os.fstat(fd).st_size == 8192 and len(mapping) == 8192
    finally:
        mapping.close()
        os.close(fd)


class FakeDescriptorSocket:
    """A SOCK_SEQPACKET listener that takes one message and descriptor and answers `answer`."""

    def __init__(self, address, answer):
        self.address, self.answer = address, answer
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind("\0" + address[1:] if address.startswith("@") else address)
        self.listener.listen(1)
        self.got = {}
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.listener.accept()
        with conn:
            message, fds, _, _ = socket.recv_fds(conn, 1024, 4)
            self.got = {"message": message, "fds": fds}
            if fds:
                self.got["size"] = os.fstat(fds[0]).st_size
                self.got["seals"] = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
                for fd in fds:
                    os.close(fd)
            conn.send(self.answer)

    def close(self):
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize("abstract", [False, True])
def test_descriptor_handoff(tmp_path, abstract):
    address = f"@attnserve-test-{os.getpid()}" if abstract else str(tmp_path / "fd.sock")
    fake = FakeDescriptorSocket(address, b"ok tok-123")
    fd, mapping = shm.sealed_memfd("attnserve-test", 4096)
    try:
        assert shm.pass_descriptor(address, fd, 5) == "tok-123"
    finally:
        mapping.close()
        os.close(fd)
        fake.close()
    assert fake.got["message"] == b"attnserve-fd/1" and len(fake.got["fds"]) == 1
    assert fake.got["size"] == 4096 and fake.got["seals"] & fcntl.F_SEAL_SHRINK


def test_descriptor_refused_and_unreachable(tmp_path):
    address = str(tmp_path / "fd.sock")
    fake = FakeDescriptorSocket(address, b"error the object is not sealed")
    fd, mapping = shm.sealed_memfd("attnserve-test", 4096)
    try:
        with pytest.raises(attnserve.AttnServeError) as e:
            shm.pass_descriptor(address, fd, 5)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "not sealed" in e.value.message
        with pytest.raises(attnserve.AttnServeError) as e:
            shm.pass_descriptor(str(tmp_path / "nobody"), fd, 5)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        mapping.close()
        os.close(fd)
        fake.close()


def test_server_without_socket_is_failed_precondition(client):
    if client.info().shared_memory_socket:
        pytest.skip("this server has a shared_memory_socket")
    with pytest.raises(attnserve.AttnServeError) as e:
        client.shared_memory(1 << 16)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture
def region_client(client):
    if not client.info().shared_memory_socket:
        pytest.skip("the server's GetServerInfo has an empty shared_memory_socket: descriptor "
                    "passing (RegisterSharedMemoryRequest.fd_token) is not in this server yet")
    return client


def cases(rng, dtype):
    q, d_o = (rounded(rng.uniform(-1, 1, (2, 21, 4, 64)), dtype) for _ in range(2))
    k, v = (rounded(rng.uniform(-1, 1, (2, 30, 2, 64)), dtype) for _ in range(2))
    cast = (lambda x: x.astype(np.float16)) if dtype == "float16" else (lambda x: x)
    wire = "bfloat16" if dtype == "bfloat16" else None
    return (q, k, v, d_o), [cast(x) for x in (q, k, v, d_o)], wire


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_attend_and_backward_through_a_region(region_client, rng, dtype):
    c = region_client
    (q, k, v, d_o), sent, wire = cases(rng, dtype)
    want_o, _, dq_ref, dk_ref, dv_ref = attention(q, k, v, d_o, causal=True)
    failed = c.info().stats.requests_failed
    with c.shared_memory(1 << 20) as region:
        o, lse = c.attend(*sent[:3], causal=True, return_lse=True, dtype=wire,
                          shared_memory=region)
        assert_close("o", o, want_o, TOLERANCE[dtype])
        dq, dk, dv = c.backward(*sent, o=o, lse=lse, causal=True, dtype=wire,
                                shared_memory=region)
        for name, got, want in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
            assert_close(name, got, want, GRAD_TOLERANCE[dtype])
        assert c.info().stats.requests_failed == failed
    with pytest.raises(attnserve.AttnServeError) as e:  # unregistered on close
        c._unary("UnregisterSharedMemory",
                 attnserve._proto.pb.UnregisterSharedMemoryRequest(name=region.name), "", 10)
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_attend_many_through_a_region(region_client, rng):
    c = region_client
    ps, wants = [], []
    for i in range(6):
        q = rng.uniform(-1, 1, (1, 5 + 3 * i, 4, 32)).astype(np.float32)
        k = rng.uniform(-1, 1, (1, 9 + 2 * i, 2, 32)).astype(np.float32)
        ps.append(dict(q=q, k=k, v=k, causal=True))
        wants.append(attention(q, k, k, causal=True)[0])
    big = rng.uniform(-1, 1, (1, 600, 4, 32)).astype(np.float32)
    ps.insert(3, dict(q=big, k=big, v=big))  # does not fit: fails alone
    with c.shared_memory(256 << 10) as region:
        results = {r.index: r for r in c.attend_many(ps, shared_memory=region)}
    assert sorted(results) == list(range(7))
    assert results[3].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for i, want in zip([0, 1, 2, 4, 5, 6], wants):
        assert results[i].ok, results[i].error
        assert_close(f"o[{i}]", results[i].o, want, 1e-4)


def test_one_call_at_a_time(region_client, rng):
    q = rng.uniform(-1, 1, (1, 8, 2, 16)).astype(np.float32)
    with region_client.shared_memory(1 << 16) as region:
        region.begin()  # as a call in flight would
        try:
            with pytest.raises(attnserve.AttnServeError) as e:
                region_client.attend(q, q, q, shared_memory=region)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            region.end()
        assert region_client.attend(q, q, q, shared_memory=region).shape == q.shape


def test_async_region(region_client, server, rng):
    q = rng.uniform(-1, 1, (1, 12, 2, 32)).astype(np.float32)

    async def main():
        async with attnserve.AsyncClient(server.target) as c:
            async with await c.shared_memory(1 << 16) as region:
                return await c.attend(q, q, q, causal=True, shared_memory=region)

    assert_close("o", asyncio.run(main()), attention(q, q, q, causal=True)[0], 1e-4)
