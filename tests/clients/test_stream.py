"""attend_many: many requests on one AttendStream; per-request failures come back as results
and the stream goes on."""
import grpc
import numpy as np
import pytest

import attnserve
from reference import TOLERANCE, assert_close, attention


def problems(rng, n):
    out, wants = [], []
    for i in range(n):
        lq, lk = 5 + 3 * i, 9 + 2 * i
        q = rng.uniform(-1, 1, (1, lq, 4, 32)).astype(np.float32)
        k = rng.uniform(-1, 1, (1, lk, 2, 32)).astype(np.float32)
        v = rng.uniform(-1, 1, (1, lk, 2, 32)).astype(np.float32)
        out.append(dict(q=q, k=k, v=v, causal=i % 2 == 1, return_lse=i % 3 == 0))
        wants.append(attention(q, k, v, causal=i % 2 == 1))
    return out, wants


def test_all_answered_and_correct(client, rng):
    ps, wants = problems(rng, 12)
    seen = set()
    for r in client.attend_many(ps):
        assert isinstance(r, attnserve.AttendResult) and r.ok, r.error
        seen.add(r.index)
        assert_close(f"o[{r.index}]", r.o, wants[r.index][0], TOLERANCE["float32"])
        assert (r.lse is not None) == (r.index % 3 == 0)
        if r.lse is not None:
            assert r.lse.shape == (1, 4, ps[r.index]["q"].shape[1])
            assert isinstance(r.result(), tuple)
        assert r.engine and r.timing.total_us > 0
    assert seen == set(range(12))


def test_bad_request_in_the_middle_does_not_end_the_stream(client, rng):
    ps, wants = problems(rng, 7)
    bad_server = dict(ps[2], k=ps[2]["k"][:, :, :1])  # k 1 KV head, v 2: the server refuses
    bad_local = dict(ps[4], q=ps[4]["q"][0])  # 3-D: the client refuses before sending
    unknown_key = dict(ps[5], scale=0.5)  # flash_attn spells it softmax_scale
    sent = ps[:2] + [bad_server] + ps[3:4] + [bad_local, unknown_key] + ps[6:]
    results = list(client.attend_many(sent))
    assert sorted(r.index for r in results) == list(range(7))
    by_index = {r.index: r for r in results}
    for i in (2, 4, 5):
        r = by_index[i]
        assert not r.ok and r.o is None
        assert isinstance(r.error, attnserve.AttnServeError)
        assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT and r.error.request_id
        with pytest.raises(attnserve.AttnServeError):
            r.result()
    assert by_index[2].error.message.startswith("v.shape"), by_index[2].error.message
    assert by_index[4].error.message.startswith("q.shape")
    assert "scale" in by_index[5].error.message
    for i in (0, 1, 3, 6):
        assert by_index[i].ok
        assert_close(f"o[{i}]", by_index[i].o, wants[i][0], TOLERANCE["float32"])


def test_ordered_and_lazy(client, rng):
    ps, wants = problems(rng, 6)
    ps[3] = dict(ps[3], k=ps[3]["k"][:, :, :1])
    results = list(client.attend_many(iter(ps), ordered=True))  # a one-pass iterator
    assert [r.index for r in results] == list(range(6))
    assert [r.ok for r in results] == [True, True, True, False, True, True]


def test_request_ids_and_varlen_problems(client, rng):
    q = rng.uniform(-1, 1, (20, 2, 16)).astype(np.float32)
    cu = [0, 9, 20]
    ps = [dict(q=q, k=q, v=q, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, request_id="a"),
          dict(q=q, k=q, v=q, cu_seqlens_q=cu, cu_seqlens_k=cu, request_id="a")]
    results = sorted(client.attend_many(ps), key=lambda r: r.index)
    assert results[0].request_id == "a" and results[0].ok
    assert_close("o", results[0].o, attention(q, q, q, causal=True, cu_q=cu, cu_k=cu)[0], 1e-4)
    # The same id twice while the first may still be in flight: refused, not mismatched.
    assert results[1].ok or results[1].error.code == grpc.StatusCode.INVALID_ARGUMENT


def test_breaking_off_early_cancels(client, rng):
    ps, _ = problems(rng, 8)
    for r in client.attend_many(ps):
        break
    assert client.attend(ps[0]["q"], ps[0]["k"], ps[0]["v"]).shape == ps[0]["q"].shape


def test_iterable_that_raises_ends_the_stream_with_its_error(client, rng):
    ps, _ = problems(rng, 2)

    def gen():
        yield ps[0]
        raise KeyError("from the caller")

    got = []
    with pytest.raises(KeyError):
        for r in client.attend_many(gen()):
            got.append(r)
    assert [r.index for r in got] == [0]


def test_empty(client):
    assert list(client.attend_many([])) == []
