"""attnserve's Python client: numpy arrays in, numpy arrays out, over gRPC.

    from attnserve_client import Client
    with Client("127.0.0.1:50051") as c:
        o, lse = c.attend(q, k, v, causal=True, return_lse=True)
        dq, dk, dv = c.backward(q, k, v, d_o, o=o, lse=lse, causal=True)
        for i, o, lse in c.attend_many([dict(q=q, k=k, v=v), dict(q=q2, k=k2, v=v2)]):
            ...  # pipelined on one AttendStream call, in completion order
        with c.shared_memory(64 << 20) as region:  # same host: tensors by reference
            o = c.attend(q, k, v, shared_memory=region)

Layouts as in proto/attnserve/v1/attention.proto: dense [batch, seqlen, heads, head_dim], or
variable-length [tokens, heads, head_dim] with cu_seqlens_q / cu_seqlens_k. float32 and float16
arrays travel as they are. numpy has no bfloat16: pass dtype="bfloat16" and float32 arrays are
rounded to bfloat16 (nearest even) on the way out; bfloat16 results come back as float32.
Failures raise grpc.RpcError; the server's message names the field (e.g. "q.data: ...").

Needs grpcio, protobuf and numpy, and the message classes protoc generates from
attention.proto (the CMake target attnserve_python_proto writes them to
BUILD/clients/python/gen): PYTHONPATH=clients/python:BUILD/clients/python/gen.
"""
from attnserve_client.client import Client, SharedMemoryRegion, from_tensor, to_tensor

__all__ = ["Client", "SharedMemoryRegion", "from_tensor", "to_tensor"]
