"""KV sessions from Python against the real server: a session built by appends of odd sizes answers
like one dense problem over everything appended (the float64 reference), decode steps with and
without append, the errors (deleted sessions, wrong shapes, arguments refused before sending),
the context manager deleting it, the routing header, and the asyncio client."""
import asyncio

import grpc
import numpy as np
import pytest

import attnserve
from reference import TOLERANCE, assert_close, attention, rounded

NOT_FOUND = grpc.StatusCode.NOT_FOUND
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def rows(rng, tokens, heads, head_dim):
    return rng.uniform(-1, 1, (tokens, heads, head_dim)).astype(np.float32)


def reference(q, k, v, dtype, **mask):
    """O [tokens, heads, d] and LSE [heads, tokens] in float64 of a step whose session holds k, v
    (everything appended, the step's own rows included): the dense problem it equals."""
    o, lse = attention(*(rounded(x, dtype)[None] for x in (q, k, v)), **mask)
    return o[0], lse


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_appends_of_odd_sizes_and_steps_match_the_dense_problem(client, rng, dtype):
    tol = TOLERANCE[dtype]
    if dtype == "float32" and client.info().gpu:  # the paged CUDA kernels hold fp16 and bf16
        with pytest.raises(attnserve.AttnServeError) as e:
            client.session(2, 32, dtype)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
        return
    with client.session(2, 32, dtype, route="pytest-odd") as s:
        assert s.dtype == dtype and s.route == "pytest-odd"
        k, v = np.zeros((0, 2, 32), np.float32), np.zeros((0, 2, 32), np.float32)
        for tokens, chunk in ((1, 1), (7, 3), (16, None), (17, 5), (177, 64)):
            kn, vn = rows(rng, tokens, 2, 32), rows(rng, tokens, 2, 32)
            after = s.append(kn, vn, chunk_tokens=chunk)
            k, v = np.concatenate([k, kn]), np.concatenate([v, vn])
            assert after.tokens == len(k)
        # A causal prefill chunk of 5 tokens that appends its own K/V: query row i sees the
        # cache and the chunk up to its own position (bottom-right).
        q, kn, vn = rows(rng, 5, 8, 32), rows(rng, 5, 2, 32), rows(rng, 5, 2, 32)
        o, lse = s.attend(q, append_k=kn, append_v=vn, causal=True, return_lse=True)
        k, v = np.concatenate([k, kn]), np.concatenate([v, vn])
        want_o, want_lse = reference(q, k, v, dtype, causal=True)
        assert o.dtype == np.float32 and o.shape == q.shape and lse.shape == (8, 5)
        assert_close("prefill o", o, want_o, tol)
        assert_close("prefill lse", lse, want_lse, tol)
        # Decode steps: one token appended and attended, then a look without append (the
        # session is left as it was), windowed.
        for _ in range(3):
            q, kn, vn = rows(rng, 1, 8, 32), rows(rng, 1, 2, 32), rows(rng, 1, 2, 32)
            o = s.attend(q, append_k=kn, append_v=vn, causal=True)
            k, v = np.concatenate([k, kn]), np.concatenate([v, vn])
            assert_close("decode o", o, reference(q, k, v, dtype, causal=True)[0], tol)
        q = rows(rng, 2, 8, 32)
        result = s.attend(q, window_size=(40, 0), softmax_scale=0.3, return_result=True)
        want = attention(*(rounded(x, dtype)[None] for x in (q, k, v)), window=(40, 0),
                         scale=0.3)[0][0]
        assert_close("windowed look", result.o, want, tol)
        assert result.engine and result.timing.total_us > 0
        info = s.info()
        assert info.tokens == len(k) == 226
        assert info.pages == -(-info.tokens // info.page_tokens) and info.bytes > 0
        assert (info.num_kv_heads, info.head_dim, info.dtype) == (2, 32, dtype)


def test_context_manager_deletes_and_errors_are_typed(client, rng):
    with client.session(1, 16, "float16") as s:
        sid = s.id
        assert sid in {x.session_id for x in client.sessions()}
        s.append(rows(rng, 3, 1, 16), rows(rng, 3, 1, 16))
    assert s.closed and sid not in {x.session_id for x in client.sessions()}
    for call in (s.info, lambda: s.attend(rows(rng, 1, 1, 16)),
                 lambda: s.append(rows(rng, 1, 1, 16), rows(rng, 1, 1, 16)), s.delete):
        with pytest.raises(attnserve.AttnServeError) as e:
            call()
        assert e.value.code == NOT_FOUND and e.value.message.startswith("session_id"), e.value
    s.close()  # already gone: quiet


def test_close_after_expiry_is_quiet_and_other_errors_name_the_field(client, rng):
    s = client.session(2, 32, "float16", max_tokens=20)
    # Wrong head_dim on append and on a step: INVALID_ARGUMENT naming the field, from the server.
    with pytest.raises(attnserve.AttnServeError) as e:
        s.append(rows(rng, 4, 2, 16), rows(rng, 4, 2, 16))
    assert e.value.code == INVALID and e.value.message.startswith("k.shape"), e.value.message
    with pytest.raises(attnserve.AttnServeError) as e:
        s.attend(rows(rng, 1, 4, 64), request_id="bad-head-dim")
    assert e.value.code == INVALID and e.value.message.startswith("q.shape[2]"), e.value.message
    assert e.value.request_id == "bad-head-dim"
    with pytest.raises(attnserve.AttnServeError) as e:
        s.attend(rows(rng, 1, 3, 32))  # 3 query heads over 2 KV heads
    assert e.value.code == INVALID and e.value.message.startswith("q.shape[1]"), e.value.message
    # Past max_tokens: FAILED_PRECONDITION, and the failed append left the session as it was.
    s.append(rows(rng, 15, 2, 32), rows(rng, 15, 2, 32), chunk_tokens=4)
    with pytest.raises(attnserve.AttnServeError) as e:
        s.append(rows(rng, 6, 2, 32), rows(rng, 6, 2, 32), chunk_tokens=4)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
    assert s.info().tokens == 15
    client.sessions()  # the server kept serving
    s.delete()
    s.close()  # deleted already: no call, no error


@pytest.mark.parametrize("call,field", [
    (lambda c: c.session(0, 32, "float32"), "num_kv_heads"),
    (lambda c: c.session(2, 32.0, "float32"), "head_dim"),
    (lambda c: c.session(2, 32, None), "dtype"),
    (lambda c: c.session(2, 32, "int8"), "dtype"),
    (lambda c: c.session(2, 32, "float32", ttl=0), "ttl"),
    (lambda c: c.session(2, 32, "float32", max_tokens=-1), "max_tokens"),
    (lambda c: c.session(2, 32, "float32", route=""), "route"),
    (lambda c: c.session(2, 32, "float32", route="caf\u00e9"), "route"),
    (lambda c: c.sessions(route="x" * 300), "route"),
])
def test_arguments_refused_before_sending(client, call, field):
    before = len(client.sessions())
    with pytest.raises(attnserve.AttnServeError) as e:
        call(client)
    assert e.value.code == INVALID and e.value.message.startswith(field), e.value.message
    assert len(client.sessions()) == before


def test_step_arguments_refused_before_sending(client, rng):
    with client.session(2, 32, "float16") as s:
        for kwargs, field in ((dict(q=rows(rng, 1, 4, 32)[None]), "q.shape"),
                              (dict(q=rows(rng, 1, 4, 32), append_k=rows(rng, 1, 2, 32)),
                               "append_k, append_v"),
                              (dict(q=rows(rng, 1, 4, 32), append_k=rows(rng, 1, 2, 32),
                                    append_v=rows(rng, 2, 2, 32)), "append_v.shape"),
                              (dict(q=rows(rng, 1, 4, 32), path="gpu"), "path")):
            with pytest.raises(attnserve.AttnServeError) as e:
                s.attend(**kwargs)
            assert e.value.code == INVALID and e.value.message.startswith(field), e.value.message
        with pytest.raises(attnserve.AttnServeError) as e:
            s.append(rows(rng, 2, 2, 32), rows(rng, 2, 2, 32), chunk_tokens=0)
        assert e.value.message.startswith("chunk_tokens")
        assert s.info().tokens == 0


def test_ttl_and_limits_reach_the_server(client, server):
    with client.session(1, 8, "bfloat16", max_tokens=100, ttl=2.5) as s:
        info = s.info()
        assert (info.max_tokens, info.ttl_seconds) == (100, 3)  # whole seconds, rounded up
        assert info.device == "cpu" or info.device.startswith("cuda:")


def test_async_session(server, rng):
    dtype = "bfloat16"
    k, v = rows(rng, 40, 2, 16), rows(rng, 40, 2, 16)
    steps = [(rows(rng, 1, 4, 16), rows(rng, 1, 2, 16), rows(rng, 1, 2, 16)) for _ in range(3)]

    async def main():
        async with attnserve.AsyncClient(server.target) as c:
            async with await c.session(2, 16, dtype, route="pytest-async") as s:
                assert isinstance(s, attnserve.AsyncSession)
                assert (await s.append(k, v, chunk_tokens=7)).tokens == 40
                outs = []
                for q, kn, vn in steps:
                    outs.append(await s.attend(q, append_k=kn, append_v=vn, causal=True,
                                               return_lse=True))
                listed = {x.session_id for x in await c.sessions(route="pytest-async")}
                assert s.id in listed and (await s.info()).tokens == 43
            with pytest.raises(attnserve.AttnServeError) as e:
                await s.info()
            assert e.value.code == NOT_FOUND
            await s.close()
            return outs

    outs = asyncio.run(main())
    all_k, all_v = k, v
    for (q, kn, vn), (o, lse) in zip(steps, outs):
        all_k, all_v = np.concatenate([all_k, kn]), np.concatenate([all_v, vn])
        want_o, want_lse = reference(q, all_k, all_v, dtype, causal=True)
        assert_close("async o", o, want_o, TOLERANCE[dtype])
        assert_close("async lse", lse, want_lse, TOLERANCE[dtype])


def test_route_travels_as_the_header_on_every_call(server, rng):
    """Every call of a session carries x-attnserve-route; calls of a session without route, and
    the client's other calls, carry none."""
    seen = []

    class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
        def _record(self, details):
            metadata = dict(details.metadata or ())
            seen.append((details.method.rsplit("/", 1)[-1], metadata.get("x-attnserve-route")))

        def intercept_unary_unary(self, continuation, details, request):
            self._record(details)
            return continuation(details, request)

        def intercept_stream_unary(self, continuation, details, requests):
            self._record(details)
            return continuation(details, requests)

    with attnserve.Client(server.target, token=None) as c:
        c._channel = grpc.intercept_channel(c._channel, Recorder())
        c._stub = attnserve._proto.Stub(c._channel)
        with c.session(1, 8, "float16", route="conversation-42") as s:
            s.append(rows(rng, 2, 1, 8), rows(rng, 2, 1, 8))
            s.attend(rows(rng, 1, 1, 8), append_k=rows(rng, 1, 1, 8),
                     append_v=rows(rng, 1, 1, 8))
            s.info()
            c.sessions(route="conversation-42")
        c.info()
        with c.session(1, 8, "float16") as plain:
            plain.info()
    routed = ["CreateSession", "AppendKV", "Attend", "GetSession", "ListSessions",
              "DeleteSession"]
    assert seen[:6] == [(m, "conversation-42") for m in routed]
    assert seen[6:] == [("GetServerInfo", None), ("CreateSession", None), ("GetSession", None),
                        ("DeleteSession", None)]


def test_same_session_methods_on_both_clients():
    import inspect
    for name in ("append", "attend", "info", "delete", "close"):
        sync, aio = getattr(attnserve.Session, name), getattr(attnserve.AsyncSession, name)
        assert inspect.signature(sync) == inspect.signature(aio), name
        assert inspect.iscoroutinefunction(aio), name
