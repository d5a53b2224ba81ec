"""Every failure is an AttnServeError carrying the gRPC code, the server's message (naming the
field) and the request id: bad shapes, arguments refused before sending, authentication,
per-call deadlines, an unreachable server."""
import socket

import grpc
import numpy as np
import pytest

import attnserve
from servers import Server, write_token_file

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def arrays(rng, qs=(1, 8, 2, 16), ks=(1, 8, 2, 16)):
    return [rng.uniform(-1, 1, s).astype(np.float32) for s in (qs, ks, ks)]


def test_bad_shape_is_invalid_argument_naming_the_field(client, rng):
    q, k, v = arrays(rng)
    with pytest.raises(attnserve.AttnServeError) as e:
        client.attend(q, k, v[:, :, :1], request_id="bad-shape")
    assert e.value.code == INVALID
    assert e.value.message.startswith("v.shape"), e.value.message
    assert e.value.request_id == "bad-shape"
    assert "INVALID_ARGUMENT" in str(e.value) and "bad-shape" in str(e.value)


def test_backward_bad_d_o_names_it(client, rng):
    q, k, v = arrays(rng)
    with pytest.raises(attnserve.AttnServeError) as e:
        client.backward(q, k, v, q[:, :4])
    assert e.value.code == INVALID and e.value.message.startswith("d_o."), e.value.message


def test_head_dim_mismatch_from_server(client, rng):
    q, k, v = arrays(rng, ks=(1, 8, 2, 32))
    with pytest.raises(attnserve.AttnServeError) as e:
        client.attend(q, k, v)
    assert e.value.code == INVALID and "shape" in e.value.message


@pytest.mark.parametrize("call,field", [
    (lambda c, q, k, v: c.attend(q[0], k[0], v[0]), "q.shape"),  # 3-D into attend
    (lambda c, q, k, v: c.attend_varlen(q, k, v, [0, 8], [0, 8]), "q.shape"),  # 4-D into varlen
    (lambda c, q, k, v: c.attend(q, k, v, layout="bsd"), "layout"),
    (lambda c, q, k, v: c.attend(q, k, v, softmax_scale=0.0), "softmax_scale"),
    (lambda c, q, k, v: c.attend(q, k, v, dropout_p=0.1), "dropout_p"),
    (lambda c, q, k, v: c.attend(q, k, v, window_size=(-2, 0)), "window_size"),
    (lambda c, q, k, v: c.attend(q, k, v, window_size=3), "window_size"),
    (lambda c, q, k, v: c.attend(q, k, v, path="gpu"), "path"),
    (lambda c, q, k, v: c.attend(q, k, v, dtype="int8"), "dtype"),
    (lambda c, q, k, v: c.attend(q.astype(np.float64), k, v), "q.dtype"),  # never narrowed
    (lambda c, q, k, v: c.attend(q.view(np.uint16)[..., :16], k, v), "q.dtype"),
    (lambda c, q, k, v: c.backward(q, k, v, q, o=q), "o, lse"),
])
def test_refused_before_sending(rng, call, field):
    """Arguments the client can check itself fail as the server would, before any RPC: the
    client points at a port nobody listens on, so anything sent would be UNAVAILABLE."""
    q, k, v = arrays(rng)
    with attnserve.Client(f"127.0.0.1:{closed_port()}", timeout=5) as nowhere:
        with pytest.raises(attnserve.AttnServeError) as e:
            call(nowhere, q, k, v)
    assert e.value.code == INVALID and e.value.message.startswith(field), e.value.message
    assert e.value.request_id  # every call has an id, also when refused locally


def test_positional_flash_attn_arguments_fail_loudly(client, rng):
    """flash_attn_func(q, k, v, dropout_p, softmax_scale, causal): a positional port must not
    shift into attend's keywords."""
    q, k, v = arrays(rng)
    with pytest.raises(TypeError):
        client.attend(q, k, v, 0.0, None, True)


def test_missing_or_wrong_token_is_unauthenticated(binary, rng, tmp_path):
    token = "s3cret-token"
    s = Server(binary, "--auth_token_file=" + write_token_file(str(tmp_path), token))
    try:
        q, k, v = arrays(rng)
        for kwargs in ({}, {"token": "wrong"}):
            with attnserve.Client(s.target, **kwargs) as c:
                with pytest.raises(attnserve.AttnServeError) as e:
                    c.attend(q, k, v, request_id="no-token")
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
                assert e.value.request_id == "no-token"
                with pytest.raises(attnserve.AttnServeError) as e:
                    c.info()
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(attnserve.AttnServeError) as e:  # the whole stream fails
                    list(c.attend_many([dict(q=q, k=k, v=v)]))
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with attnserve.Client(s.target, token=token) as c:
            assert c.info().auth_required
            assert c.attend(q, k, v).shape == q.shape
            assert [r.ok for r in c.attend_many([dict(q=q, k=k, v=v)])] == [True]
    finally:
        assert s.stop() == 0


def test_per_call_timeout(slow_server, rng):
    """Against a server that holds each request 1.5 s: a shorter deadline fails with
    DEADLINE_EXCEEDED, a longer one succeeds; the client's default applies otherwise."""
    q, k, v = arrays(rng)
    with attnserve.Client(slow_server.target, timeout=30) as c:
        with pytest.raises(attnserve.AttnServeError) as e:
            c.attend(q, k, v, timeout=0.2, request_id="short")
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert e.value.request_id == "short"
        assert c.attend(q, k, v, timeout=20).shape == q.shape
        with pytest.raises(attnserve.AttnServeError) as e:  # a stream's deadline covers it all
            list(c.attend_many([dict(q=q, k=k, v=v)], timeout=0.2))
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with attnserve.Client(slow_server.target, timeout=0.2) as c:  # the client's default
        with pytest.raises(attnserve.AttnServeError) as e:
            c.attend(q, k, v)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def closed_port():
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_unavailable(rng):
    with attnserve.Client(f"127.0.0.1:{closed_port()}", timeout=5) as c:
        with pytest.raises(attnserve.AttnServeError) as e:
            c.attend(*arrays(rng))
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_error_pickles():
    import pickle
    e = attnserve.AttnServeError(INVALID, "q.shape: bad", "r-1")
    back = pickle.loads(pickle.dumps(e))
    assert (back.code, back.message, back.request_id) == (INVALID, "q.shape: bad", "r-1")
