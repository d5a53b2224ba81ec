#!/usr/bin/python3
"""Writes the request decoder fuzzer's seed corpus: one valid AttendRequest of each layout
(dense, varlen, 3-D single sequence, GQA, causal with a window, LSE wanted, a shared-memory
reference), each prefixed with the byte that makes the fuzzer parse it as a serialized message.

  protoc --proto_path=proto --python_out=/tmp/pb proto/attnserve/v1/attention.proto
  PYTHONPATH=/tmp/pb /usr/bin/python3 tests/server/fuzz_corpus/make_seeds.py tests/server/fuzz_corpus
"""
import os
import struct
import sys

from attnserve.v1 import attention_pb2 as pb


def tensor(shape, dtype=pb.DTYPE_FLOAT32, fill=0.25):
    n = 1
    for d in shape:
        n *= d
    size = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_FLOAT16: 2, pb.DTYPE_BFLOAT16: 2}[dtype]
    if dtype == pb.DTYPE_FLOAT32:
        data = struct.pack(f"<{n}f", *[fill * ((i % 7) - 3) for i in range(n)])
    else:
        data = bytes((i * 37) % 251 for i in range(n * size))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def seeds():
    yield "dense", pb.AttendRequest(q=tensor([2, 3, 2, 8]), k=tensor([2, 5, 2, 8]),
                                    v=tensor([2, 5, 2, 8]))
    yield "varlen", pb.AttendRequest(q=tensor([5, 2, 8]), k=tensor([7, 2, 8]), v=tensor([7, 2, 8]),
                                     cu_seqlens_q=[0, 2, 5], cu_seqlens_k=[0, 3, 7])
    yield "single", pb.AttendRequest(q=tensor([4, 1, 16]), k=tensor([6, 1, 16]),
                                     v=tensor([6, 1, 16]), return_lse=True)
    yield "gqa_f16", pb.AttendRequest(q=tensor([1, 4, 8, 8], pb.DTYPE_FLOAT16),
                                      k=tensor([1, 4, 2, 8], pb.DTYPE_FLOAT16),
                                      v=tensor([1, 4, 2, 8], pb.DTYPE_FLOAT16), causal=True)
    yield "window_bf16", pb.AttendRequest(q=tensor([1, 6, 2, 8], pb.DTYPE_BFLOAT16),
                                          k=tensor([1, 6, 2, 8], pb.DTYPE_BFLOAT16),
                                          v=tensor([1, 6, 2, 8], pb.DTYPE_BFLOAT16),
                                          window_left=2, window_right=1, softmax_scale=0.5)
    ref = pb.AttendRequest(q=tensor([1, 2, 1, 8]), k=tensor([1, 3, 1, 8]), v=tensor([1, 3, 1, 8]))
    ref.q.ClearField("data")
    ref.q.shared_memory.region = "fuzz"
    ref.q.shared_memory.byte_size = 2 * 8 * 4
    ref.o_shared_memory.region = "fuzz"
    ref.o_shared_memory.offset = 4096
    ref.o_shared_memory.byte_size = 2 * 8 * 4
    yield "shared_memory", ref


def main(out):
    for name, request in seeds():
        with open(os.path.join(out, f"seed_{name}"), "wb") as f:
            f.write(b"\x01" + request.SerializeToString())


if __name__ == "__main__":
    main(sys.argv[1])
