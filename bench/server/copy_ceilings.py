#!/usr/bin/env python3
"""The ceilings a served attention request meets on its way, measured on the GPU machine next to
server_bench.sh, so that its end-to-end figures can be split into copies and kernel:

- host memcpy of one request's payload (what the server's staging copy and the response's
  O copy cost per byte, one thread);
- pinned host -> device and device -> host copies of Q+K+V and O (PCIe);
- PyTorch SDPA (FLASH backend) on the served shapes: a stand-in for the kernel time, since the
  response's compute_us also holds the staging and copies. docs/performance.md has our fused
  kernel at 1.0-1.3x FLASH on these shapes.

Prints one JSON line per measurement. CUDA events, median of repeats after a warm-up.
"""
import json
import statistics
import time

import torch

SHAPES = {  # name: (seqlen, heads, head_dim, dtype)
    "small": (64, 8, 64, torch.float16),
    "large": (4096, 32, 128, torch.bfloat16),
}


def cuda_ms(fn, repeats=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn, repeats=10):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def emit(what, shape, ms, nbytes=None, flops=None):
    row = {"what": what, "set": shape, "ms": round(ms, 4)}
    if nbytes:
        row.update(bytes=nbytes, gb_per_s=round(nbytes / ms / 1e6, 2))
    if flops:
        row.update(tflops=round(flops / ms / 1e9, 1))
    print(json.dumps(row), flush=True)


def main():
    torch.set_num_threads(1)
    for name, (n, h, d, dtype) in SHAPES.items():
        qkv_bytes, o_bytes = 3 * n * h * d * 2, n * h * d * 2
        src = torch.empty(qkv_bytes, dtype=torch.uint8).random_(0, 255)
        dst = torch.empty_like(src)
        emit("host_memcpy_qkv", name, host_ms(lambda: dst.copy_(src)), qkv_bytes)
        pinned = torch.empty(qkv_bytes, dtype=torch.uint8).pin_memory()
        dev = torch.empty(qkv_bytes, dtype=torch.uint8, device="cuda")
        emit("h2d_pinned_qkv", name, cuda_ms(lambda: dev.copy_(pinned, non_blocking=True)),
             qkv_bytes)
        emit("d2h_pinned_o", name,
             cuda_ms(lambda: pinned[:o_bytes].copy_(dev[:o_bytes], non_blocking=True)), o_bytes)
        q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        flops = 4 * h * n * n * d
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            try:
                with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend,
                                                            backend)):
                    ms = cuda_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
                emit(f"sdpa_{backend.split('_')[0].lower()}", name, ms, flops=flops)
            except Exception as e:  # a backend that refuses the shape
                print(json.dumps({"what": backend, "set": name, "error": str(e)[:200]}))
        del src, dst, pinned, dev, q, k, v


if __name__ == "__main__":
    main()
