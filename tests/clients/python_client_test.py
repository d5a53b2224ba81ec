#!/usr/bin/python3
"""The Python client (clients/python) against the real attnserve binary.

Starts the server on an ephemeral loopback port (CPU engine), sends forward and backward requests
through attnserve_client.Client and checks every answer against a float64 numpy reference of
attention and of its gradients: float32 / float16 / bfloat16, dense and variable-length, GQA,
causal (bottom-right) and a sliding window, also with the tensors in a registered shared-memory
region. Also checks GetServerInfo and that a malformed request raises INVALID_ARGUMENT naming the
field. Exits 77 (skipped) without grpcio, protobuf or numpy.

    python_client_test.py PATH/TO/attnserve   (PYTHONPATH: clients/python and the generated code)
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

try:
    import grpc
    import numpy as np
    from attnserve.v1 import attention_pb2 as pb
    from attnserve_client import Client
except ImportError as e:  # Debian: apt-get install python3-grpcio python3-protobuf python3-numpy
    print(f"skipped: {e}")
    sys.exit(77)


def visible(lq, lk, causal, window_left, window_right):
    """[lq, lk] mask of the keys each query sees (bottom-right aligned, as the server)."""
    rows = np.arange(lq)[:, None] + (lk - lq)
    cols = np.arange(lk)[None, :]
    mask = np.ones((lq, lk), dtype=bool)
    right = 0 if causal else window_right
    if right is not None:
        mask &= cols <= rows + right
    if window_left is not None:
        mask &= cols >= rows - window_left
    return mask


def sequences(q, k, cu_q, cu_k):
    """(q rows, k rows) slices of each sequence, in the packed [tokens, heads, d] layout."""
    if cu_q is None:
        b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
        return [(slice(i * lq, (i + 1) * lq), slice(i * lk, (i + 1) * lk)) for i in range(b)]
    return [(slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1]))
            for i in range(len(cu_q) - 1)]


def packed(x):
    return x.reshape(-1, x.shape[-2], x.shape[-1]).astype(np.float64)


def reference(q, k, v, d_o=None, *, causal=False, window_left=None, window_right=None,
              cu_q=None, cu_k=None):
    """O and LSE [heads, total_q] (and dQ, dK, dV when d_o is given), in float64."""
    Q, K, V = packed(q), packed(k), packed(v)
    dO = None if d_o is None else packed(d_o)
    h, hk, d = Q.shape[1], K.shape[1], Q.shape[2]
    scale = 1.0 / np.sqrt(d)
    O = np.zeros_like(Q)
    lse = np.full((h, Q.shape[0]), -np.inf)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    for rq, rk in sequences(q, k, cu_q, cu_k):
        lq, lk = rq.stop - rq.start, rk.stop - rk.start
        mask = visible(lq, lk, causal, window_left, window_right)
        for i in range(h):
            j = i // (h // hk)
            s = scale * Q[rq, i] @ K[rk, j].T
            s = np.where(mask, s, -np.inf)
            m = s.max(axis=1, initial=-np.inf)
            seen = np.isfinite(m)
            p = np.where(mask, np.exp(s - np.where(seen, m, 0)[:, None]), 0.0)
            l = p.sum(axis=1)
            p = np.divide(p, l[:, None], out=np.zeros_like(p), where=seen[:, None])
            O[rq, i] = p @ V[rk, j]
            lse[i, rq] = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)
            if dO is not None:
                dV[rk, j] += p.T @ dO[rq, i]
                dp = dO[rq, i] @ V[rk, j].T
                ds = p * (dp - (dO[rq, i] * O[rq, i]).sum(axis=1)[:, None])
                dQ[rq, i] = scale * ds @ K[rk, j]
                dK[rk, j] += scale * ds.T @ Q[rq, i]
    shape = lambda x, like: x.reshape(like.shape)
    out = (shape(O, q), lse)
    if dO is not None:
        out += (shape(dQ, q), shape(dK, k), shape(dV, v))
    return out


def rounded(x, dtype):
    """The values the server sees: x rounded to the storage dtype (bfloat16 nearest even)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        u = x.view(np.uint32)
        u = (u + np.uint32(0x7FFF) + ((u >> 16) & 1)) & np.uint32(0xFFFF0000)
        return u.view(np.float32)
    return x


TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}  # O, |O| <= 1
GRAD_TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}  # x max(1, max |ref|)


def check(name, got, want, tol, failures):
    err = float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want))) if want.size else 0.0
    bound = tol * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    status = "ok" if err <= bound else "FAILED"
    print(f"  {name}: max abs error {err:.3g} (bound {bound:.3g}) {status}")
    if err > bound:
        failures.append(name)


def main():
    server = sys.argv[1]
    work = tempfile.mkdtemp()
    port_file = os.path.join(work, "port")
    proc = subprocess.Popen([server, "--listen=127.0.0.1:0", f"--port_file={port_file}",
                             "--metrics_address=", "--cpu_threads=1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    failures = []
    try:
        for _ in range(300):
            if os.path.exists(port_file) and open(port_file).read().strip():
                break
            if proc.poll() is not None:
                print("server exited before listening")
                return 1
            time.sleep(0.1)
        target = "127.0.0.1:" + open(port_file).read().strip()
        rng = np.random.default_rng(2026)
        with Client(target) as c:
            info = c.info()
            print("engines", info["engines"], "backward", info.get("backward_engines"))
            if "cpu_tiled" not in info.get("backward_engines", []) or info.get("gpu", False):
                failures.append("info")

            cases = [
                # dtype, q shape, k shape, heads/kv, causal, window, cu_seqlens
                ("float32", (2, 33, 4, 32), (2, 47, 2, 32), True, None, None, None),
                ("float16", (60, 4, 64), (90, 1, 64), False, None, [0, 25, 60], [0, 50, 90]),
                ("bfloat16", (1, 65, 2, 64), (1, 65, 2, 64), False, 9, None, None),
                ("float32", (40, 2, 16), (40, 2, 16), True, 5, [0, 0, 17, 40], [0, 3, 20, 40]),
            ]
            for n, (dtype, qs, ks, causal, window, cu_q, cu_k) in enumerate(cases):
                print(f"case {n}: {dtype} q{qs} k{ks} causal={causal} window={window} "
                      f"varlen={cu_q is not None}")
                q = rounded(rng.uniform(-1, 1, qs), dtype)
                k = rounded(rng.uniform(-1, 1, ks), dtype)
                v = rounded(rng.uniform(-1, 1, ks), dtype)
                d_o = rounded(rng.uniform(-1, 1, qs), dtype)
                send = dict(causal=causal, window_left=window, cu_seqlens_q=cu_q,
                            cu_seqlens_k=cu_k)
                send_dtype = dtype if dtype == "bfloat16" else None
                cast = (lambda x: x.astype(np.float16)) if dtype == "float16" else (lambda x: x)
                o, lse = c.attend(cast(q), cast(k), cast(v), return_lse=True, dtype=send_dtype,
                                  **send)
                want_o, want_lse, dq_ref, dk_ref, dv_ref = reference(
                    q, k, v, d_o, causal=causal, window_left=window, cu_q=cu_q, cu_k=cu_k)
                check("o", o, want_o, TOLERANCE[dtype], failures)
                finite = np.isfinite(want_lse)
                if not np.array_equal(np.isfinite(lse), finite):
                    failures.append("lse -inf rows")
                check("lse", lse[finite], want_lse[finite], 1e-3, failures)
                for with_forward in (False, True):
                    extra = dict(o=cast(o), lse=lse) if with_forward else {}
                    dq, dk, dv = c.backward(cast(q), cast(k), cast(v), cast(d_o), dtype=send_dtype,
                                            **send, **extra)
                    tag = "with o/lse" if with_forward else "server reruns forward"
                    for name, got, want in (("dq", dq, dq_ref), ("dk", dk, dk_ref),
                                            ("dv", dv, dv_ref)):
                        check(f"{name} ({tag})", got, want, GRAD_TOLERANCE[dtype], failures)

            # Many requests pipelined on one AttendStream call, answered in any order.
            problems, wants = [], []
            for i in range(12):
                lq, lk = 5 + 3 * i, 9 + 2 * i
                q = rng.uniform(-1, 1, (1, lq, 4, 32)).astype(np.float32)
                k = rng.uniform(-1, 1, (1, lk, 2, 32)).astype(np.float32)
                v = rng.uniform(-1, 1, (1, lk, 2, 32)).astype(np.float32)
                problems.append(dict(q=q, k=k, v=v, causal=i % 2 == 1, return_lse=i % 3 == 0))
                wants.append(reference(q, k, v, causal=i % 2 == 1))
            seen = set()
            for index, o, lse in c.attend_many(problems):
                seen.add(index)
                check(f"stream o[{index}]", o, wants[index][0], TOLERANCE["float32"], failures)
                if (lse is not None) != (index % 3 == 0):
                    failures.append(f"stream lse[{index}] presence")
            if seen != set(range(len(problems))):
                failures.append(f"stream answered {sorted(seen)}")
            bad = dict(problems[0], k=problems[0]["k"][:, :, :1])  # k with 1 KV head, v with 2
            try:
                list(c.attend_many([problems[1], bad]))
                failures.append("stream: malformed request accepted")
            except RuntimeError as e:
                print("stream malformed:", e)
                if "INVALID_ARGUMENT" not in str(e):
                    failures.append("stream: malformed request's code")

            # Tensors by reference through a registered shared-memory region: forward (O comes
            # back through the region) and backward (inputs only), checked like the rest.
            with c.shared_memory(1 << 20) as region:
                for dtype in ("float16", "bfloat16"):
                    q = rounded(rng.uniform(-1, 1, (2, 21, 4, 64)), dtype)
                    k = rounded(rng.uniform(-1, 1, (2, 30, 2, 64)), dtype)
                    v = rounded(rng.uniform(-1, 1, (2, 30, 2, 64)), dtype)
                    d_o = rounded(rng.uniform(-1, 1, (2, 21, 4, 64)), dtype)
                    send_dtype = dtype if dtype == "bfloat16" else None
                    cast = (lambda x: x.astype(np.float16)) if dtype == "float16" else (lambda x: x)
                    want_o, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, d_o, causal=True)
                    o = c.attend(cast(q), cast(k), cast(v), causal=True, dtype=send_dtype,
                                 shared_memory=region)
                    if c.last_response.o.data or not c.last_response.o.HasField("shared_memory"):
                        failures.append(f"shm {dtype}: O came back in the message")
                    check(f"shm o {dtype}", o, want_o, TOLERANCE[dtype], failures)
                    dq, dk, dv = c.backward(cast(q), cast(k), cast(v), cast(d_o), causal=True,
                                            dtype=send_dtype, shared_memory=region)
                    for name, got, want in (("dq", dq, dq_ref), ("dk", dk, dk_ref),
                                            ("dv", dv, dv_ref)):
                        check(f"shm {name} {dtype}", got, want, GRAD_TOLERANCE[dtype], failures)
                # Pipelined: every problem's tensors laid out in the region one after another.
                seen = set()
                for index, o, _ in c.attend_many(problems[:6], shared_memory=region):
                    seen.add(index)
                    check(f"shm stream o[{index}]", o, wants[index][0], TOLERANCE["float32"],
                          failures)
                if seen != set(range(6)):
                    failures.append(f"shm stream answered {sorted(seen)}")
                if c.info()["stats"].get("requests_failed"):
                    failures.append("shm: failed requests")
            try:  # unregistered on close: its name is unknown now
                c._call(c._unregister, pb.UnregisterSharedMemoryRequest(name=region.name))
                failures.append("shm: region still registered after close")
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    failures.append(f"shm: unregister after close: {e.code().name}")

            # A malformed request raises with the server's field-named message.
            q = rng.uniform(-1, 1, (1, 8, 2, 16)).astype(np.float32)
            try:
                c.backward(q, q, q, q[:, :4])
                failures.append("malformed d_o accepted")
            except grpc.RpcError as e:
                print("malformed:", e.code().name, e.details())
                if e.code() != grpc.StatusCode.INVALID_ARGUMENT or not e.details().startswith(
                        "d_o."):
                    failures.append("malformed d_o message")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -1
        if code != 0:
            failures.append(f"server exit {code}")
    print("FAILED: " + ", ".join(failures) if failures else "python client: OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
