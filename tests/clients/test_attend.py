"""attend / attend_varlen / backward against the real server, checked against a float64 numpy
reference: dense and variable-length, causal with seqlen_q != seqlen_k (bottom-right), GQA, a
sliding window, float32 / float16 / bfloat16, both layouts."""
import numpy as np
import pytest

import attnserve
from attnserve import _protocol
from reference import GRAD_TOLERANCE, TOLERANCE, assert_close, attention, bf16_round, rounded

DTYPES = ["float32", "float16", "bfloat16"]


def inputs(rng, dtype, *shapes):
    """Uniform(-1, 1) arrays already rounded to dtype (float32 values, float16 arrays)."""
    out = [rounded(rng.uniform(-1, 1, s), dtype) for s in shapes]
    return [x.astype(np.float16) if dtype == "float16" else x for x in out]


def wire_dtype(dtype):
    # numpy has no bfloat16 without ml_dtypes: float32 arrays with dtype="bfloat16".
    return "bfloat16" if dtype == "bfloat16" else None


DENSE = [
    # q shape [b, sq, h, d], k shape [b, sk, hk, d], causal, window
    ((2, 33, 4, 32), (2, 47, 2, 32), True, (-1, -1)),  # causal, sq < sk, GQA 2:1
    ((1, 17, 2, 64), (1, 5, 2, 64), True, (-1, -1)),  # sq > sk: leading rows see no key
    ((1, 1, 8, 64), (1, 177, 1, 64), False, (-1, -1)),  # one decode step, MQA
    ((1, 65, 2, 16), (1, 65, 2, 16), False, (9, 3)),  # sliding window
    ((2, 20, 3, 24), (2, 29, 3, 24), True, (4, -1)),  # causal + left window, odd head_dim
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qs,ks,causal,window", DENSE)
def test_dense_matches_reference(client, rng, dtype, qs, ks, causal, window):
    q, k, v = inputs(rng, dtype, qs, ks, ks)
    o, lse = client.attend(q, k, v, causal=causal, window_size=window, return_lse=True,
                           dtype=wire_dtype(dtype))
    want_o, want_lse = attention(q, k, v, causal=causal, window=window)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert_close("o", o, want_o, TOLERANCE[dtype])
    # flash_attn's dense LSE layout: [batch, heads, seqlen_q], from the wire's [heads, total_q].
    want_lse = want_lse.reshape(qs[2], qs[0], qs[1]).transpose(1, 0, 2)
    assert lse.shape == (qs[0], qs[2], qs[1]) and lse.dtype == np.float32
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)  # -inf where a row sees no key
    assert_close("lse", lse[finite], want_lse[finite], 1e-3)


VARLEN = [
    # q shape [tq, h, d], k shape [tk, hk, d], cu_seqlens_q, cu_seqlens_k, causal, window
    ((60, 4, 64), (90, 1, 64), [0, 25, 60], [0, 50, 90], True, (-1, -1)),
    ((40, 2, 16), (40, 2, 16), [0, 0, 17, 40], [0, 3, 20, 40], True, (5, -1)),  # empty seq
    ((30, 6, 32), (31, 3, 32), [0, 1, 30], [0, 30, 31], False, (-1, -1)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qs,ks,cu_q,cu_k,causal,window", VARLEN)
def test_varlen_matches_reference(client, rng, dtype, qs, ks, cu_q, cu_k, causal, window):
    q, k, v = inputs(rng, dtype, qs, ks, ks)
    o, lse = client.attend_varlen(q, k, v, np.array(cu_q, dtype=np.int32), cu_k,
                                  causal=causal, window_size=window, return_lse=True,
                                  dtype=wire_dtype(dtype))
    want_o, want_lse = attention(q, k, v, causal=causal, window=window, cu_q=cu_q, cu_k=cu_k)
    assert_close("o", o, want_o, TOLERANCE[dtype])
    assert lse.shape == (qs[1], qs[0])  # [heads, total_q], as flash_attn_varlen_func
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert_close("lse", lse[finite], want_lse[finite], 1e-3)


def test_varlen_max_seqlen_positional_as_flash_attn(client, rng):
    q, k, v = inputs(rng, "float32", (12, 2, 16), (12, 2, 16), (12, 2, 16))
    cu = [0, 5, 12]
    o = client.attend_varlen(q, k, v, cu, cu, 7, 7, causal=True)  # flash_attn's positional order
    assert_close("o", o, attention(q, k, v, causal=True, cu_q=cu, cu_k=cu)[0], 1e-4)
    with pytest.raises(attnserve.AttnServeError, match="max_seqlen_q"):
        client.attend_varlen(q, k, v, cu, cu, 6, 7)  # shorter than the longest sequence


def test_causal_is_bottom_right_not_top_left(client, rng):
    """With seqlen_q < seqlen_k the last query row sees every key (SDPA's top-left mask would
    hide all but the first seqlen_q)."""
    q, k, v = inputs(rng, "float32", (1, 4, 1, 16), (1, 10, 1, 16), (1, 10, 1, 16))
    o = client.attend(q, k, v, causal=True)
    bottom_right = attention(q, k, v, causal=True)[0]
    assert_close("o", o, bottom_right, 1e-4)
    full_last_row = attention(q[:, -1:], k, v)[0]
    assert_close("last row", o[:, -1:], full_last_row, 1e-4)


def test_softmax_scale(client, rng):
    q, k, v = inputs(rng, "float32", (1, 9, 2, 32), (1, 9, 2, 32), (1, 9, 2, 32))
    o = client.attend(q, k, v, softmax_scale=0.37)
    assert_close("o", o, attention(q, k, v, scale=0.37)[0], 1e-4)


def test_bhsd_layout_matches_bshd(client, rng):
    q, k, v = inputs(rng, "float32", (2, 11, 4, 32), (2, 13, 2, 32), (2, 13, 2, 32))
    to_bhsd = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    o, lse = client.attend(to_bhsd(q), to_bhsd(k), to_bhsd(v), causal=True, layout="bhsd",
                           return_lse=True)
    want_o, want_lse = attention(q, k, v, causal=True)
    assert o.shape == (2, 4, 11, 32)  # SDPA's [batch, heads, seqlen, head_dim] back
    assert_close("o", o, to_bhsd(want_o), 1e-4)
    assert lse.shape == (2, 4, 11)
    assert_close("lse", lse, want_lse.reshape(4, 2, 11).transpose(1, 0, 2), 1e-4)
    # Non-contiguous views (what x.transpose(1, 2) gives in torch) are accepted as they are.
    o2 = client.attend(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                       causal=True, layout="bhsd")
    assert_close("o (views)", o2, to_bhsd(want_o), 1e-4)


def test_float16_out_and_dtype_conversion(client, rng):
    q, k, v = inputs(rng, "float32", (1, 8, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16))
    # float32 arrays computed in float16: inputs rounded on the way, O back as float32.
    o = client.attend(q, k, v, dtype="fp16")
    assert o.dtype == np.float32
    want = attention(*(rounded(x, "float16") for x in (q, k, v)))[0]
    assert_close("o", o, want, TOLERANCE["float16"])
    # float64 only with an explicit dtype (never narrowed silently), and comes back float64.
    o64 = client.attend(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                        dtype="float32")
    assert o64.dtype == np.float64
    assert_close("o64", o64, attention(q, k, v)[0], 1e-4)


def test_bfloat16_bits_in_and_out(client, rng):
    """uint16 arrays with dtype="bfloat16" are taken as bfloat16 bits and O comes back as bits."""
    q, k, v = inputs(rng, "bfloat16", (1, 12, 2, 32), (1, 12, 2, 32), (1, 12, 2, 32))
    bits = [(x.view(np.uint32) >> 16).astype(np.uint16) for x in (q, k, v)]
    o_bits = client.attend(*bits, dtype="bfloat16")
    assert o_bits.dtype == np.uint16
    o = (o_bits.astype(np.uint32) << 16).view(np.float32)
    assert_close("o", o, attention(q, k, v)[0], TOLERANCE["bfloat16"])
    assert np.array_equal(bf16_round(o), o)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("varlen", [False, True])
def test_backward_matches_reference(client, rng, dtype, varlen):
    if varlen:
        qs, ks, cu_q, cu_k = (30, 4, 32), (41, 2, 32), [0, 13, 30], [0, 20, 41]
    else:
        qs, ks, cu_q, cu_k = (2, 17, 4, 32), (2, 23, 2, 32), None, None
    q, k, v, d_o = inputs(rng, dtype, qs, ks, ks, qs)
    want_o, _, dq_ref, dk_ref, dv_ref = attention(q, k, v, d_o, causal=True, cu_q=cu_q,
                                                  cu_k=cu_k)
    send = dict(causal=True, dtype=wire_dtype(dtype))
    if varlen:
        o, lse = client.attend_varlen(q, k, v, cu_q, cu_k, return_lse=True, **send)
        runs = [client.backward_varlen(q, k, v, d_o, cu_q, cu_k, **send),
                client.backward_varlen(q, k, v, d_o, cu_q, cu_k, o=o, lse=lse, **send)]
    else:
        o, lse = client.attend(q, k, v, return_lse=True, **send)
        runs = [client.backward(q, k, v, d_o, **send),
                client.backward(q, k, v, d_o, o=o, lse=lse, **send)]
    for dq, dk, dv in runs:  # the server reruns the forward; it uses the client's o and lse
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert dq.dtype == q.dtype
        assert_close("dq", dq, dq_ref, GRAD_TOLERANCE[dtype])
        assert_close("dk", dk, dk_ref, GRAD_TOLERANCE[dtype])
        assert_close("dv", dv, dv_ref, GRAD_TOLERANCE[dtype])


def test_backward_bhsd(client, rng):
    q, k, v, d_o = inputs(rng, "float32", (1, 9, 2, 16), (1, 12, 2, 16), (1, 12, 2, 16),
                          (1, 9, 2, 16))
    _, _, dq_ref, dk_ref, dv_ref = attention(q, k, v, d_o, causal=True)
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    o, lse = client.attend(t(q), t(k), t(v), causal=True, layout="bhsd", return_lse=True)
    dq, dk, dv = client.backward(t(q), t(k), t(v), t(d_o), o=o, lse=lse, causal=True,
                                 layout="bhsd")
    for name, got, want in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        assert_close(name, got, t(want), 1e-4)


def test_deterministic_backward(client, rng):
    """deterministic=True goes into the request, and its gradients are the reference's, the
    same bytes on every call."""
    q, k, v, d_o = inputs(rng, "float32", (1, 300, 2, 16), (1, 300, 1, 16), (1, 300, 1, 16),
                          (1, 300, 2, 16))
    assert _protocol.backward(q, k, v, d_o, deterministic=True).request.deterministic
    assert not _protocol.backward(q, k, v, d_o).request.deterministic
    _, _, dq_ref, dk_ref, dv_ref = attention(q, k, v, d_o, causal=True)
    runs = [client.backward(q, k, v, d_o, causal=True, deterministic=True) for _ in range(2)]
    for name, got, want in zip(("dq", "dk", "dv"), runs[0], (dq_ref, dk_ref, dv_ref)):
        assert_close(name, got, want, GRAD_TOLERANCE["float32"])
    for first, second in zip(*runs):
        assert first.tobytes() == second.tobytes()
    assert client.info().deterministic_backward is False


def test_return_result(client, rng):
    q, k, v = inputs(rng, "float32", (1, 6, 2, 16), (1, 6, 2, 16), (1, 6, 2, 16))
    r = client.attend(q, k, v, return_result=True, request_id="mine-1")
    assert r.ok and r.request_id == "mine-1" and r.lse is None
    assert r.engine in client.info().engines and r.path in ("cpu", "fused", "naive")
    assert isinstance(r.timing, attnserve.Timing) and r.timing.total_us >= r.timing.queue_us
    assert isinstance(r.batch, attnserve.BatchInfo) and r.batch.requests >= 1
    assert_close("o", r.result(), attention(q, k, v)[0], 1e-4)
