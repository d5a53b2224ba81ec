"""The Client class and the numpy <-> Tensor conversions (see the package docstring)."""
import itertools
import os
from multiprocessing import shared_memory as _shm

import grpc
import numpy as np
from google.protobuf import json_format

from attnserve.v1 import attention_pb2 as pb

_SERVICE = "/attnserve.v1.AttentionService/"
_PATHS = {"auto": pb.PATH_AUTO, "fused": pb.PATH_FUSED, "naive": pb.PATH_NAIVE, "cpu": pb.PATH_CPU}
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_DTYPES = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16, "bfloat16": pb.DTYPE_BFLOAT16}


def _to_bfloat16_bits(a):
    """float32 -> bfloat16 bits, rounding to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = np.isnan(a)
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def to_tensor(array, dtype=None):
    """A numpy array as a Tensor. dtype: "float32", "float16" or "bfloat16"; by default the
    array's own (float32 or float16). A uint16 array with dtype="bfloat16" is taken as bits."""
    a = np.asarray(array)
    name = dtype or {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(a.dtype)
    if name not in _DTYPES:
        raise ValueError(f"dtype: {a.dtype} is not float32 or float16 (pass dtype='bfloat16' "
                         "for bfloat16)")
    if name == "bfloat16":
        data = a.astype("<u2") if a.dtype == np.uint16 else _to_bfloat16_bits(a)
    else:
        data = a.astype("<f4" if name == "float32" else "<f2")
    return pb.Tensor(dtype=_DTYPES[name], shape=list(a.shape),
                     data=np.ascontiguousarray(data).tobytes())


def from_tensor(t):
    """A Tensor as a numpy array: float32 or float16 as sent, bfloat16 widened to float32."""
    shape = tuple(t.shape)
    if t.dtype == pb.DTYPE_FLOAT32:
        return np.frombuffer(t.data, dtype="<f4").reshape(shape).copy()
    if t.dtype == pb.DTYPE_FLOAT16:
        return np.frombuffer(t.data, dtype="<f2").reshape(shape).copy()
    if t.dtype == pb.DTYPE_BFLOAT16:
        bits = np.frombuffer(t.data, dtype="<u2").astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).reshape(shape).copy()
    raise ValueError(f"tensor dtype {t.dtype} is not float32, float16 or bfloat16")


_ALIGN = 256
_region_ids = itertools.count()


class SharedMemoryRegion:
    """A POSIX shared-memory object registered with the server (Client.shared_memory): requests
    given it send their tensors by reference and get O back through it, instead of moving the
    bytes through gRPC. Same host only. One call at a time uses a region (each call lays its
    tensors out from the start; attend_many lays out all of its problems); close() unregisters
    it."""

    def __init__(self, client, size, name=None):
        self._client = client
        self.name = name or f"py-{os.getpid()}-{next(_region_ids)}"
        self.size = size
        self._shm = _shm.SharedMemory(create=True, size=size)
        try:
            client._call(client._register, pb.RegisterSharedMemoryRequest(
                name=self.name, key="/" + self._shm.name, offset=0, byte_size=size))
        except BaseException:
            self._shm.close()
            self._shm.unlink()
            raise
        # Both sides have it mapped: the name is no longer needed, and nothing stays behind in
        # /dev/shm whichever side goes away first.
        self._shm.unlink()
        self._next = 0

    def _reset(self):
        self._next = 0

    def _take(self, nbytes):
        at = -(-self._next // _ALIGN) * _ALIGN
        if at + nbytes > self.size:
            raise ValueError(f"shared memory: {nbytes} bytes at offset {at} do not fit in region "
                             f"'{self.name}' of {self.size} bytes")
        self._next = at + nbytes
        return pb.SharedMemoryRef(region=self.name, offset=at, byte_size=nbytes)

    def _place(self, tensor):
        """Moves a Tensor's bytes into the region; the Tensor then refers to them."""
        ref = self._take(len(tensor.data))
        self._shm.buf[ref.offset:ref.offset + ref.byte_size] = tensor.data
        tensor.ClearField("data")
        tensor.shared_memory.CopyFrom(ref)

    def _read(self, ref):
        return bytes(self._shm.buf[ref.offset:ref.offset + ref.byte_size])

    def close(self):
        if self._shm is None:
            return
        try:
            self._client._call(self._client._unregister,
                               pb.UnregisterSharedMemoryRequest(name=self.name))
        finally:
            self._shm.close()
            self._shm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Client:
    """One channel to an attnserve server. target: "host:port" (or "unix:/path").
    root_certificates (PEM bytes) turns on TLS; token adds "authorization: Bearer <token>"."""

    def __init__(self, target, *, root_certificates=None, token=None, timeout=60.0,
                 max_message_bytes=256 << 20):
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        if root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._metadata = [("authorization", f"Bearer {token}")] if token else None
        self._timeout = timeout
        self._attend = self._method("Attend", pb.AttendRequest, pb.AttendResponse)
        self._backward = self._method("AttendBackward", pb.AttendBackwardRequest,
                                      pb.AttendBackwardResponse)
        self._info = self._method("GetServerInfo", pb.GetServerInfoRequest, pb.ServerInfo)
        self._register = self._method("RegisterSharedMemory", pb.RegisterSharedMemoryRequest,
                                      pb.RegisterSharedMemoryResponse)
        self._unregister = self._method("UnregisterSharedMemory",
                                        pb.UnregisterSharedMemoryRequest,
                                        pb.UnregisterSharedMemoryResponse)
        self._stream = self._channel.stream_stream(
            _SERVICE + "AttendStream", request_serializer=pb.AttendRequest.SerializeToString,
            response_deserializer=pb.AttendResponse.FromString)

    def _method(self, name, request, response):
        return self._channel.unary_unary(_SERVICE + name,
                                         request_serializer=request.SerializeToString,
                                         response_deserializer=response.FromString)

    def _call(self, method, request):
        return method(request, timeout=self._timeout, metadata=self._metadata)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def info(self):
        """GetServerInfo as a dict (devices, engines, backward_engines, limits, stats, ...)."""
        return json_format.MessageToDict(self._call(self._info, pb.GetServerInfoRequest()),
                                         preserving_proto_field_name=True)

    def shared_memory(self, size, name=None):
        """A SharedMemoryRegion of `size` bytes registered with the server (use it as a context
        manager, or close() it): pass it as attend(..., shared_memory=region) or backward(...)."""
        return SharedMemoryRegion(self, size, name)

    def _request(self, q, k, v, *, causal=False, window_left=None, window_right=None, scale=None,
                 cu_seqlens_q=None, cu_seqlens_k=None, path="auto", dtype=None, request_id=""):
        r = pb.AttendRequest(request_id=request_id, q=to_tensor(q, dtype), k=to_tensor(k, dtype),
                             v=to_tensor(v, dtype), causal=causal, softmax_scale=scale or 0.0,
                             path=_PATHS[path])
        if cu_seqlens_q is not None:
            r.cu_seqlens_q.extend(int(x) for x in cu_seqlens_q)
        if cu_seqlens_k is not None:
            r.cu_seqlens_k.extend(int(x) for x in cu_seqlens_k)
        if window_left is not None:
            r.window_left = window_left
        if window_right is not None:
            r.window_right = window_right
        return r

    def attend(self, q, k, v, *, causal=False, window_left=None, window_right=None, scale=None,
               cu_seqlens_q=None, cu_seqlens_k=None, return_lse=False, path="auto", dtype=None,
               request_id="", shared_memory=None):
        """O (dtype and shape of q; float32 for bfloat16), and with return_lse the float32 LSE
        [heads, total_q] as a second value. The response's timing and batch are on
        self.last_response. shared_memory: a SharedMemoryRegion for Q, K, V and O."""
        request = self._request(q, k, v, causal=causal, window_left=window_left,
                                window_right=window_right, scale=scale,
                                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, path=path,
                                dtype=dtype, request_id=request_id)
        request.return_lse = return_lse
        if shared_memory is not None:
            shared_memory._reset()
            o_bytes = len(request.q.data)
            for t in (request.q, request.k, request.v):
                shared_memory._place(t)
            request.o_shared_memory.CopyFrom(shared_memory._take(o_bytes))
        response = self._call(self._attend, request)
        self.last_response = response
        o_tensor = response.o
        if o_tensor.HasField("shared_memory"):  # O is in the region; the response says where
            o_tensor = pb.Tensor(dtype=o_tensor.dtype, shape=o_tensor.shape,
                                 data=shared_memory._read(o_tensor.shared_memory))
        o = from_tensor(o_tensor)
        return (o, from_tensor(response.lse)) if return_lse else o

    def backward(self, q, k, v, d_o, *, o=None, lse=None, causal=False, window_left=None,
                 window_right=None, scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 path="auto", dtype=None, request_id="", shared_memory=None):
        """dQ, dK, dV of the attention of (q, k, v) for the upstream gradient d_o. o and lse,
        from a forward call with return_lse, save the server a forward pass. shared_memory: a
        SharedMemoryRegion for the inputs (the gradients come back in the response)."""
        if (o is None) != (lse is None):
            raise ValueError("o and lse: pass both (the forward's outputs) or neither")
        request = pb.AttendBackwardRequest(
            forward=self._request(q, k, v, causal=causal, window_left=window_left,
                                  window_right=window_right, scale=scale,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, path=path,
                                  dtype=dtype, request_id=request_id),
            d_o=to_tensor(d_o, dtype))
        if o is not None:
            request.o.CopyFrom(to_tensor(o, dtype))
            request.lse.CopyFrom(to_tensor(np.asarray(lse, dtype=np.float32), "float32"))
        if shared_memory is not None:
            shared_memory._reset()
            f = request.forward
            for t in (f.q, f.k, f.v, request.d_o) + ((request.o, request.lse) if o is not None
                                                     else ()):
                shared_memory._place(t)
        response = self._call(self._backward, request)
        self.last_response = response
        return from_tensor(response.d_q), from_tensor(response.d_k), from_tensor(response.d_v)

    def attend_many(self, problems, *, timeout=None, shared_memory=None):
        """Many forward requests pipelined on one AttendStream call, for throughput: the server
        batches them with whatever else it is running. problems: an iterable of dicts with the
        arguments of attend() (q, k, v and the keywords). Yields (index, o, lse or None) as the
        answers arrive, in completion order. A failed request raises RuntimeError naming its
        index, the status code and the server's message when its answer arrives (the stream
        itself failing raises grpc.RpcError). shared_memory: a SharedMemoryRegion that holds
        every problem's Q, K, V and O one after the other (each request in flight needs its
        own space); a problem that does not fit ends the stream with grpc.RpcError."""
        if shared_memory is not None:
            shared_memory._reset()

        def requests():
            for i, p in enumerate(problems):
                p = dict(p)
                return_lse = p.pop("return_lse", False)
                r = self._request(**p, request_id=str(i))  # unknown keys raise TypeError
                r.return_lse = return_lse
                if shared_memory is not None:
                    o_bytes = len(r.q.data)
                    for t in (r.q, r.k, r.v):
                        shared_memory._place(t)
                    r.o_shared_memory.CopyFrom(shared_memory._take(o_bytes))
                yield r

        for response in self._stream(requests(), timeout=timeout or self._timeout,
                                     metadata=self._metadata):
            index = int(response.request_id)
            if response.HasField("error"):
                code = _CODE_NAMES.get(response.error.code, str(response.error.code))
                raise RuntimeError(f"problem {index}: {code}: {response.error.message}")
            lse = from_tensor(response.lse) if response.HasField("lse") else None
            o_tensor = response.o
            if o_tensor.HasField("shared_memory"):
                o_tensor = pb.Tensor(dtype=o_tensor.dtype, shape=o_tensor.shape,
                                     data=shared_memory._read(o_tensor.shared_memory))
            yield index, from_tensor(o_tensor), lse
