"""Shared memory with a same-host server: tensors by reference instead of in the message.

The protocol is RegisterSharedMemoryRequest's comment in proto/attnserve/v1/attention.proto: the
client creates a memfd sealed against shrinking (so the server can never fault on a mapping that
shrank under it), hands the descriptor over ServerInfo.shared_memory_socket with SCM_RIGHTS, and
registers the range with the one-use token the server answers. The server only ever maps what the
client itself could open.
"""
import fcntl
import mmap
import os
import socket
import threading

import grpc

from attnserve._proto import pb
from attnserve.errors import AttnServeError

HELLO = b"attnserve-fd/1"
ALIGN = 256  # where each tensor starts: the alignment the server's copy kernels prefer


def sealed_memfd(name, size):
    """(fd, mmap) of a new memfd of `size` bytes that can no longer shrink."""
    if size < 1:
        raise AttnServeError(grpc.StatusCode.INVALID_ARGUMENT, f"size: {size} (at least 1 byte)")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def pass_descriptor(address, fd, timeout):
    """Sends fd to the server's descriptor socket ("path" or "@abstract-name"); returns the
    fd_token it answers."""
    where = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(timeout)
            s.connect(where)
            socket.send_fds(s, [HELLO], [fd])
            answer = s.recv(4096).decode("utf-8", "replace").strip()
    except OSError as e:
        raise AttnServeError(grpc.StatusCode.UNAVAILABLE, f"shared_memory_socket '{address}': "
                             f"{e.strerror or e} (shared memory needs the server on this host)")
    if answer.startswith("ok "):
        return answer[3:].strip()
    if answer.startswith("error"):
        raise AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"shared_memory_socket '{address}': {answer[5:].strip()}")
    raise AttnServeError(grpc.StatusCode.INTERNAL,
                         f"shared_memory_socket '{address}': unexpected answer {answer!r}")


def socket_of(info):
    """ServerInfo's descriptor socket, or why shared memory cannot be used with this server."""
    if not info.shared_memory:
        raise AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                             "shared memory: the server runs with --shared_memory=false")
    if not info.shared_memory_socket:
        raise AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                             "shared memory: the server names no shared_memory_socket (it "
                             "predates descriptor passing)")
    return info.shared_memory_socket


class SharedMemoryRegion:
    """A memfd mapped here and registered with the server under `name` (Client.shared_memory).

    Pass it as shared_memory= to attend, attend_varlen, backward or attend_many: Q, K, V (and
    dO, O, LSE) are copied into it and travel by reference, and a forward's O comes back through
    it. Each call lays its tensors out from the start of the region, so one call at a time uses
    a region (a second one meanwhile fails with FAILED_PRECONDITION): give concurrent calls a
    region each. attend_many lays every problem out one after another; a problem that does not
    fit fails alone with RESOURCE_EXHAUSTED. close() (or the with block) unregisters it.
    """

    def __init__(self, name, size, mapping, unregister, is_async):
        self.name = name
        self.size = size
        self._map = mapping
        self._unregister = unregister
        self._is_async = is_async
        self._busy = threading.Lock()  # held by the call using the region, released by it
        self._next = 0

    # --- Use by one call: begin, place/reserve tensors, read O, end.
    def begin(self):
        if self._map is None:
            raise AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"shared memory region '{self.name}' is closed")
        if not self._busy.acquire(blocking=False):
            raise AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"shared memory region '{self.name}' is in use by another "
                                 "call: give each concurrent call its own region")
        self._next = 0

    def end(self):
        self._busy.release()

    def _take(self, nbytes, request_id=""):
        at = -(-self._next // ALIGN) * ALIGN
        if at + nbytes > self.size:
            raise AttnServeError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"shared memory: {nbytes} bytes at offset {at} do not fit in "
                                 f"region '{self.name}' of {self.size} bytes", request_id)
        self._next = at + nbytes
        return pb.SharedMemoryRef(region=self.name, offset=at, byte_size=nbytes)

    def _place(self, tensor, request_id):
        ref = self._take(len(tensor.data), request_id)
        self._map[ref.offset:ref.offset + ref.byte_size] = tensor.data
        tensor.ClearField("data")
        tensor.shared_memory.CopyFrom(ref)

    def place_forward(self, request):
        """Moves an AttendRequest's Q, K and V here and has O written here too."""
        rid = request.request_id
        o_bytes = len(request.q.data)
        start = self._next
        try:
            for t in (request.q, request.k, request.v):
                self._place(t, rid)
            request.o_shared_memory.CopyFrom(self._take(o_bytes, rid))
        except AttnServeError:
            self._next = start  # the request is not sent; its space is free for the next one
            raise

    def place_backward(self, request):
        """Moves an AttendBackwardRequest's inputs here (the gradients come in the response)."""
        f = request.forward
        rid = f.request_id
        tensors = [f.q, f.k, f.v, request.d_o]
        if request.HasField("o"):
            tensors += [request.o, request.lse]
        for t in tensors:
            self._place(t, rid)

    def read(self, ref):
        """The bytes a response's SharedMemoryRef points at."""
        if ref.region != self.name or ref.offset + ref.byte_size > self.size:
            raise AttnServeError(grpc.StatusCode.INTERNAL,
                                 f"response points at {ref.region}[{ref.offset}, +"
                                 f"{ref.byte_size}), outside region '{self.name}'")
        return bytes(self._map[ref.offset:ref.offset + ref.byte_size])

    # --- Lifetime.
    def close(self):
        """Unregisters the region (requests using it finish first) and unmaps it."""
        if self._is_async:
            raise TypeError("this region belongs to an AsyncClient: use `await region.aclose()` "
                            "or `async with`")
        if self._map is None:
            return
        try:
            self._unregister(self.name)
        finally:
            self._unmap()

    async def aclose(self):
        if not self._is_async:
            return self.close()
        if self._map is None:
            return
        try:
            await self._unregister(self.name)
        finally:
            self._unmap()

    def _unmap(self):
        mapping, self._map = self._map, None
        mapping.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def __repr__(self):
        state = "closed" if self._map is None else f"{self.size} bytes"
        return f"SharedMemoryRegion({self.name!r}, {state})"
