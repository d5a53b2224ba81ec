"""The Client class and the numpy <-> Tensor conversions (see the package docstring)."""
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
               request_id=""):
        """O (dtype and shape of q; float32 for bfloat16), and with return_lse the float32 LSE
        [heads, total_q] as a second value. The response's timing and batch are on
        self.last_response."""
        request = self._request(q, k, v, causal=causal, window_left=window_left,
                                window_right=window_right, scale=scale,
                                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, path=path,
                                dtype=dtype, request_id=request_id)
        request.return_lse = return_lse
        response = self._call(self._attend, request)
        self.last_response = response
        o = from_tensor(response.o)
        return (o, from_tensor(response.lse)) if return_lse else o

    def backward(self, q, k, v, d_o, *, o=None, lse=None, causal=False, window_left=None,
                 window_right=None, scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 path="auto", dtype=None, request_id=""):
        """dQ, dK, dV of the attention of (q, k, v) for the upstream gradient d_o. o and lse,
        from a forward call with return_lse, save the server a forward pass."""
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
        response = self._call(self._backward, request)
        self.last_response = response
        return from_tensor(response.d_q), from_tensor(response.d_k), from_tensor(response.d_v)

    def attend_many(self, problems, *, timeout=None):
        """Many forward requests pipelined on one AttendStream call, for throughput: the server
        batches them with whatever else it is running. problems: an iterable of dicts with the
        arguments of attend() (q, k, v and the keywords). Yields (index, o, lse or None) as the
        answers arrive, in completion order. A failed request raises RuntimeError naming its
        index, the status code and the server's message when its answer arrives (the stream
        itself failing raises grpc.RpcError)."""
        def requests():
            for i, p in enumerate(problems):
                p = dict(p)
                return_lse = p.pop("return_lse", False)
                r = self._request(**p, request_id=str(i))  # unknown keys raise TypeError
                r.return_lse = return_lse
                yield r

        for response in self._stream(requests(), timeout=timeout or self._timeout,
                                     metadata=self._metadata):
            index = int(response.request_id)
            if response.HasField("error"):
                code = _CODE_NAMES.get(response.error.code, str(response.error.code))
                raise RuntimeError(f"problem {index}: {code}: {response.error.message}")
            lse = from_tensor(response.lse) if response.HasField("lse") else None
            yield index, from_tensor(response.o), lse
