"""AsyncClient: the same methods as Client, as coroutines on grpc.aio."""
import asyncio
import inspect

import grpc
import numpy as np
import pytest

import attnserve
from reference import TOLERANCE, assert_close, attention


def run(coroutine):
    return asyncio.run(coroutine)


def test_same_public_methods_and_signatures():
    public = lambda cls: {n: getattr(cls, n) for n in dir(cls) if not n.startswith("_")}
    sync, aio = public(attnserve.Client), public(attnserve.AsyncClient)
    assert sorted(sync) == sorted(aio)
    for name, method in sync.items():
        if callable(method):
            assert inspect.signature(method) == inspect.signature(aio[name]), name
            assert (inspect.iscoroutinefunction(aio[name])
                    or inspect.isasyncgenfunction(aio[name])), name


def test_attend_backward_info(server, rng):
    q = rng.uniform(-1, 1, (2, 13, 4, 32)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, 21, 2, 32)).astype(np.float32)
    v = rng.uniform(-1, 1, (2, 21, 2, 32)).astype(np.float32)
    d_o = rng.uniform(-1, 1, q.shape).astype(np.float32)
    want_o, want_lse, dq_ref, dk_ref, dv_ref = attention(q, k, v, d_o, causal=True)

    async def main():
        async with attnserve.AsyncClient(server.target) as c:
            info = await c.info()
            assert isinstance(info, attnserve.ServerInfo) and not info.gpu
            # Concurrent calls on one channel.
            outs = await asyncio.gather(*(c.attend(q, k, v, causal=True) for _ in range(4)))
            o, lse = await c.attend(q, k, v, causal=True, return_lse=True)
            grads = await c.backward(q, k, v, d_o, o=o, lse=lse, causal=True)
            cu = [0, 6, 13]
            ov = await c.attend_varlen(q[0], k[0], v[0], cu, [0, 10, 21], causal=True)
            return outs, o, grads, ov, cu

    outs, o, (dq, dk, dv), ov, cu = run(main())
    for x in outs + [o]:
        assert_close("o", x, want_o, TOLERANCE["float32"])
    assert_close("dq", dq, dq_ref, 1e-4)
    assert_close("dk", dk, dk_ref, 1e-4)
    assert_close("dv", dv, dv_ref, 1e-4)
    want_v = attention(q[0], k[0], v[0], causal=True, cu_q=cu, cu_k=[0, 10, 21])[0]
    assert_close("varlen o", ov, want_v, 1e-4)


def test_errors_and_timeout(server, slow_server, rng):
    q = rng.uniform(-1, 1, (1, 8, 2, 16)).astype(np.float32)

    async def main():
        async with attnserve.AsyncClient(server.target) as c:
            with pytest.raises(attnserve.AttnServeError) as e:
                await c.attend(q, q, q[:, :, :1], request_id="async-bad")
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.message.startswith("v.shape") and e.value.request_id == "async-bad"
            with pytest.raises(attnserve.AttnServeError) as e:
                await c.attend(q[0], q[0], q[0])  # refused before sending, as Client does
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        async with attnserve.AsyncClient(slow_server.target) as c:
            with pytest.raises(attnserve.AttnServeError) as e:
                await c.attend(q, q, q, timeout=0.2, request_id="async-late")
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert e.value.request_id == "async-late"
            assert (await c.attend(q, q, q, timeout=20)).shape == q.shape

    run(main())


def test_attend_many_with_bad_request_in_the_middle(server, rng):
    ps, wants = [], []
    for i in range(6):
        q = rng.uniform(-1, 1, (1, 4 + i, 2, 16)).astype(np.float32)
        ps.append(dict(q=q, k=q, v=q, causal=True))
        wants.append(attention(q, q, q, causal=True)[0])
    ps[2] = dict(ps[2], v=ps[2]["v"][:, :, :1])

    async def problems():  # an async iterable works as well as a plain one
        for p in ps:
            yield p

    async def main():
        async with attnserve.AsyncClient(server.target) as c:
            plain = [r async for r in c.attend_many(ps, ordered=True)]
            lazy = [r async for r in c.attend_many(problems())]
            return plain, lazy

    plain, lazy = run(main())
    assert [r.index for r in plain] == list(range(6))
    for results in (plain, sorted(lazy, key=lambda r: r.index)):
        assert [r.ok for r in results] == [True, True, False, True, True, True]
        assert results[2].error.code == grpc.StatusCode.INVALID_ARGUMENT
        for r in results:
            if r.ok:
                assert_close(f"o[{r.index}]", r.o, wants[r.index], 1e-4)
