"""Arguments to request messages and responses to results, shared by Client and AsyncClient
(which differ only in how they wait for the server)."""
import collections
import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Dict

import grpc
import numpy as np

from attnserve import arrays
from attnserve._proto import enum_names, pb
from attnserve.errors import AttnServeError, invalid
from attnserve.records import BatchInfo, Timing, from_message
from attnserve.results import AttendResult

PATHS = enum_names(pb.Path.DESCRIPTOR)  # "auto", "fused", "naive", "cpu"
_PATH_NAMES = {number: name for name, number in PATHS.items()}
LAYOUTS = ("bshd", "bhsd")
_INT32_MAX = 2**31 - 1

@dataclass
class Forward:
    """A forward request ready to send, and what is needed to turn its answer into results."""

    request: Any  # pb.AttendRequest
    likes: Dict[str, arrays.Like]  # how q, k and v came in
    layout: str  # "bshd", "bhsd" or "thd" (variable-length)
    batch: int
    seqlen_q: int
    index: int = 0

    @property
    def q_like(self):
        return self.likes["q"]


def _tagged(build):
    """Client-side argument errors carry the request id, as the server's do."""
    @functools.wraps(build)
    def wrapper(*args, request_id="", **kwargs):
        try:
            return build(*args, request_id=request_id, **kwargs)
        except AttnServeError as e:
            if e.request_id:
                raise
            raise AttnServeError(e.code, e.message, request_id) from None
    return wrapper


def _check_layout(arrays_, names, layout, varlen):
    want = 3 if varlen else 4
    for a, name in zip(arrays_, names):
        shape = list(np.shape(a))
        ndim = len(shape)
        if ndim != want:
            if varlen:
                raise invalid(f"{name}.shape: attend_varlen takes 3-D [total, heads, head_dim] "
                              f"arrays, not {ndim}-D {shape}")
            raise invalid(f"{name}.shape: attend takes 4-D arrays ([batch, seqlen, heads, "
                          f"head_dim] with layout='bshd', [batch, heads, seqlen, head_dim] with "
                          f"layout='bhsd'), not {ndim}-D {shape}; use attend_varlen for "
                          "[total, heads, head_dim]")
    if not varlen and layout not in LAYOUTS:
        raise invalid(f"layout: {layout!r} is not 'bshd' (flash_attn's [batch, seqlen, heads, "
                      "head_dim]) or 'bhsd' (torch SDPA's [batch, heads, seqlen, head_dim])")


def _wire_values(x, name, wire, layout):
    """(values in their wire form and the [b, s, h, d] order, wire form, Like) of an input."""
    values, form, like = arrays.values_of(x, name, wire)
    if layout == "bhsd":
        values = arrays.swap_seq_heads(values)
    to = wire or form
    return arrays.convert(values, form, to), to, like


def _sequence_lengths(cu, name, max_seqlen):
    lengths = np.diff(np.asarray(cu, dtype=np.int64))
    if max_seqlen is not None and lengths.size and int(lengths.max()) > max_seqlen:
        raise invalid(f"max_seqlen_{name[-1]}: {max_seqlen} is less than the longest sequence in "
                      f"{name} ({int(lengths.max())})")


@_tagged
def forward(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
            max_seqlen_k=None, varlen=False, dropout_p=0.0, softmax_scale=None, causal=False,
            window_size=(-1, -1), return_lse=False, layout="bshd", dtype=None, path="auto",
            request_id=""):
    """A Forward for attend / attend_varlen's arguments (see Client.attend for their meaning)."""
    if dropout_p:
        raise invalid(f"dropout_p: {dropout_p} (the server has no dropout; pass 0)")
    _check_layout((q, k, v), ("q", "k", "v"), layout, varlen)
    wire = arrays.dtype_name(dtype)
    if path not in PATHS:
        raise invalid(f"path: {path!r} is not one of {', '.join(PATHS)}")
    values, likes = {}, {}
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        vals, form, likes[name] = _wire_values(x, name, wire, None if varlen else layout)
        values[name] = arrays.to_tensor(vals, form)
    request = pb.AttendRequest(request_id=request_id, q=values["q"], k=values["k"], v=values["v"],
                               causal=bool(causal), return_lse=bool(return_lse),
                               path=PATHS[path])
    _set_scale(request, softmax_scale)
    _set_window(request, window_size)
    q_shape = request.q.shape
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise invalid("cu_seqlens_q, cu_seqlens_k: attend_varlen needs both")
        cu_q = arrays.ints(cu_seqlens_q, "cu_seqlens_q")
        cu_k = arrays.ints(cu_seqlens_k, "cu_seqlens_k")
        _sequence_lengths(cu_q, "cu_seqlens_q", max_seqlen_q)
        _sequence_lengths(cu_k, "cu_seqlens_k", max_seqlen_k)
        request.cu_seqlens_q.extend(cu_q)
        request.cu_seqlens_k.extend(cu_k)
        return Forward(request, likes, "thd", max(len(cu_q) - 1, 0), 0)
    return Forward(request, likes, layout, q_shape[0], q_shape[1])


def _set_scale(request, softmax_scale):
    if softmax_scale is not None:
        scale = float(softmax_scale)
        if scale == 0.0 or not math.isfinite(scale):
            raise invalid(f"softmax_scale: {softmax_scale} (the protocol reads 0 as 'unset', "
                          "1/sqrt(head_dim)); pass a finite non-zero scale or None")
        request.softmax_scale = scale


def _set_window(request, window_size):
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise invalid(f"window_size: {window_size!r} is not a (left, right) pair") from None
    for side, w in (("left", left), ("right", right)):
        if w < -1 or w > _INT32_MAX:
            raise invalid(f"window_size: {side} {w} (keys, or -1 for unbounded)")
    if left >= 0:
        request.window_left = left
    if right >= 0:
        request.window_right = right


def output(values, form, like, layout):
    """O (or dQ) back in the caller's layout and kind of array."""
    if layout == "bhsd":
        values = arrays.swap_seq_heads(values)
    return arrays.to_user(values, form, like)


def lse_output(values, f):
    """The wire's LSE [heads, total_q] as flash_attn returns it: [batch, heads, seqlen_q] for
    the dense layouts, [heads, total_q] for variable-length."""
    if f.layout != "thd" and values.ndim == 2:
        heads = values.shape[0]
        values = values.reshape(heads, f.batch, f.seqlen_q).transpose(1, 0, 2)
    return arrays.to_user(values, "float32", f.q_like.as_float32())


def lse_input(lse, f):
    """An LSE as lse_output returned it (or the wire's [heads, total_q]) as a wire Tensor."""
    values, form, _ = arrays.values_of(lse, "lse", "float32")
    values = arrays.convert(values, form, "float32")
    if values.ndim == 3 and f.layout != "thd":
        batch, heads, seqlen_q = values.shape
        values = values.transpose(1, 0, 2).reshape(heads, batch * seqlen_q)
    return arrays.to_tensor(values, "float32")


def response_tensor(t, read, request_id):
    """(values, form) of a response Tensor; read(ref) fetches its bytes from shared memory when
    it points there."""
    data = None
    if t.HasField("shared_memory"):
        if read is None:
            raise AttnServeError(grpc.StatusCode.INTERNAL, "the response points into shared "
                                 "memory this call did not give", request_id)
        data = read(t.shared_memory)
    return arrays.from_tensor(t, data, request_id)


def attend_result(f, response, read=None):
    """An AttendResult of an AttendResponse (its error, when the stream reported one)."""
    rid = response.request_id or f.request.request_id
    if response.HasField("error") and response.error.code != 0:
        return AttendResult(index=f.index, request_id=rid, error=AttnServeError.from_status(
            response.error.code, response.error.message, rid))
    o = output(*response_tensor(response.o, read, rid), f.q_like, f.layout)
    lse = None
    if f.request.return_lse:
        lse = lse_output(response_tensor(response.lse, None, rid)[0], f)
    return AttendResult(index=f.index, request_id=rid, o=o, lse=lse, engine=response.engine,
                        path=_PATH_NAMES.get(response.path, str(response.path)),
                        timing=from_message(Timing, response.timing),
                        batch=from_message(BatchInfo, response.batch))


@dataclass
class Backward:
    request: Any  # pb.AttendBackwardRequest
    forward: Forward


@_tagged
def backward(q, k, v, d_o, *, o=None, lse=None, dtype=None, deterministic=False, request_id="",
             **forward_args):
    """A Backward for backward / backward_varlen's arguments."""
    if (o is None) != (lse is None):
        raise invalid("o, lse: pass both (the forward's outputs, with return_lse=True) or neither")
    f = forward(q, k, v, dtype=dtype, request_id=request_id, **forward_args)
    wire = arrays.dtype_name(dtype)
    layout = None if f.layout == "thd" else f.layout
    names = ("d_o",) + (("o",) if o is not None else ())
    _check_layout((d_o,) + ((o,) if o is not None else ()), names, f.layout, f.layout == "thd")
    request = pb.AttendBackwardRequest(forward=f.request, deterministic=bool(deterministic))
    request.d_o.CopyFrom(arrays.to_tensor(*_wire_values(d_o, "d_o", wire, layout)[:2]))
    if o is not None:
        request.o.CopyFrom(arrays.to_tensor(*_wire_values(o, "o", wire, layout)[:2]))
        request.lse.CopyFrom(lse_input(lse, f))
    return Backward(request, f)


def gradients(b, response):
    """(dq, dk, dv) of an AttendBackwardResponse, each like its input."""
    rid = response.request_id or b.request.forward.request_id
    f = b.forward
    return tuple(output(*arrays.from_tensor(t, None, rid), f.likes[name], f.layout)
                 for t, name in ((response.d_q, "q"), (response.d_k, "k"), (response.d_v, "v")))


def problem(p, index, request_id):
    """A Forward for one of attend_many's problems: a dict of attend's (or, with cu_seqlens_q,
    attend_varlen's) arguments."""
    if not isinstance(p, dict):
        raise invalid(f"problem {index}: a dict of attend's arguments, not {type(p).__name__}",
                      request_id)
    args = dict(p)
    rid = str(args.pop("request_id", None) or request_id)
    varlen = "cu_seqlens_q" in args or "cu_seqlens_k" in args
    allowed = _VARLEN_ARGS if varlen else _DENSE_ARGS
    unknown = sorted(set(args) - allowed)
    missing = sorted({"q", "k", "v"} - set(args))
    if unknown or missing:
        what = (f"unknown argument(s) {', '.join(unknown)}" if unknown
                else f"missing {', '.join(missing)}")
        raise invalid(f"problem {index}: {what}", rid)
    f = forward(varlen=varlen, request_id=rid, **args)
    f.index = index
    return f


_DENSE_ARGS = {"q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "return_lse",
               "layout", "dtype", "path"}
_VARLEN_ARGS = (_DENSE_ARGS - {"layout"}) | {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                             "max_seqlen_k"}


class Stream:
    """The bookkeeping of one attend_many call, whichever client waits on it.

    The sender (gRPC's thread or task, through prepare) turns problems into requests; problems
    refused before sending become results at once. The receiver hands each response to answered
    and, once the stream ended, calls finish; both return the results to yield now."""

    def __init__(self, new_request_id, ordered, shared_memory):
        self._new_request_id = new_request_id
        self._shared_memory = shared_memory
        self._read = shared_memory.read if shared_memory is not None else None
        self._pending = {}  # request_id -> Forward: written by the sender before it sends
        self._refused = collections.deque()
        self._ordered = ordered
        self._held = {}
        self._next = 0
        self.sent_all = threading.Event()
        self.problems_error = None  # what the caller's iterable raised, for the receiver to raise

    def prepare(self, index, p):
        """The request of one problem, or None when it was refused (its result is queued)."""
        rid = self._new_request_id(p.get("request_id") if isinstance(p, dict) else None)
        try:
            f = problem(p, index, rid)
            rid = f.request.request_id
            if rid in self._pending:
                raise invalid(f"problem {index}: request_id {rid!r} is already in flight", rid)
            if self._shared_memory is not None:
                self._shared_memory.place_forward(f.request)
        except AttnServeError as e:
            self._refused.append(AttendResult(index=index, request_id=rid, error=e))
            return None
        self._pending[rid] = f
        return f.request

    def sender_failed(self, error):
        self.problems_error = error

    def answered(self, response):
        out = self._drain_refused()
        f = self._pending.pop(response.request_id, None)
        if f is not None:  # None: an id this call never sent (no conforming server sends one)
            out += self._order(attend_result(f, response, self._read))
        return out

    def finish(self, wait=True):
        """The results left once the stream ended cleanly (then raise problems_error, if the
        caller's iterable raised one)."""
        # The server closes the stream only after the last request was sent, so the sender is
        # done by now; the bound only guards a sender thread against a server that closes
        # early (an asyncio sender runs on the caller's loop, which must not block).
        if wait:
            self.sent_all.wait(5.0)
        out = self._drain_refused()
        for f in list(self._pending.values()):
            out += self._order(AttendResult(
                index=f.index, request_id=f.request.request_id, error=AttnServeError(
                    grpc.StatusCode.UNKNOWN, "the stream ended without an answer to this "
                    "request", f.request.request_id)))
        self._pending.clear()
        out += [self._held.pop(i) for i in sorted(self._held)]
        return out

    def _drain_refused(self):
        out = []
        while self._refused:
            out += self._order(self._refused.popleft())
        return out

    def _order(self, result):
        if not self._ordered:
            return [result]
        self._held[result.index] = result
        out = []
        while self._next in self._held:
            out.append(self._held.pop(self._next))
            self._next += 1
        return out
