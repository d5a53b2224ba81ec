"""KV sessions: a sequence's keys and values kept in one server's memory across calls, so that a
decode step sends its query rows (and its own K/V) instead of the whole context.

    with client.session(8, 128, "bfloat16", route=conversation_id) as s:
        s.append(k, v)                                          # [tokens, kv_heads, head_dim]
        o = s.attend(q, append_k=k1, append_v=v1, causal=True)  # a decode step
    # deleted here

A session lives in the one server process that created it and does not survive its restart (its
id then answers NOT_FOUND). Behind a session-routing proxy (deploy/nginx, deploy/haproxy) every
call of the session carries `route` as the x-attnserve-route header, which the proxy hashes to
pick the server. Session and AsyncSession share their request building here and differ only in
how they wait.
"""
import grpc
import numpy as np

from attnserve import arrays
from attnserve._proto import pb
from attnserve._protocol import Forward, PATHS, _set_scale, _set_window, _tagged, attend_result
from attnserve.errors import AttnServeError, invalid
from attnserve.records import SessionInfo, from_message

ROUTE_HEADER = "x-attnserve-route"
_MAX_ROUTE_LENGTH = 256
# AppendKV chunks: big enough that per-message costs vanish, small enough that the server copies
# one chunk into its pages while the next is still on the wire.
_CHUNK_BYTES = 4 << 20
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def route_metadata(metadata, route):
    """The client's call metadata plus the routing header (unchanged when route is None)."""
    if route is None:
        return metadata
    if (not isinstance(route, str) or not route or len(route) > _MAX_ROUTE_LENGTH
            or not all(" " <= c <= "~" for c in route)):
        raise invalid(f"route: {route!r} is not 1 to {_MAX_ROUTE_LENGTH} printable ASCII "
                      f"characters (it travels as the {ROUTE_HEADER} header)")
    return tuple(metadata or ()) + ((ROUTE_HEADER, route),)


def create_request(num_kv_heads, head_dim, dtype, max_tokens, ttl):
    """The CreateSessionRequest of Client.session's arguments."""
    wire = arrays.dtype_name(dtype)
    if wire is None:
        raise invalid("dtype: the session's dtype is required (float32, float16 or bfloat16)")
    request = pb.CreateSessionRequest(num_kv_heads=_count(num_kv_heads, "num_kv_heads"),
                                      head_dim=_count(head_dim, "head_dim"),
                                      dtype=arrays.WIRE_DTYPES[wire])
    if max_tokens is not None:
        request.max_tokens = _count(max_tokens, "max_tokens")
    if ttl is not None:
        seconds = float(ttl.total_seconds()) if hasattr(ttl, "total_seconds") else float(ttl)
        if not seconds >= 1:  # the wire counts whole seconds; 0 would mean the server's default
            raise invalid(f"ttl: {ttl!r} (seconds >= 1, or None for the server's default)")
        request.ttl_seconds = int(np.ceil(seconds))
    return request


def _count(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise invalid(f"{name}: {value!r} is not a positive integer")
    return int(value)


def _rows(x, name, wire):
    """(values, form, Like) of [tokens, heads, head_dim] rows sent as the session's dtype."""
    values, form, like = arrays.values_of(x, name, wire)
    if values.ndim != 3:
        raise invalid(f"{name}.shape: a session takes 3-D [tokens, heads, head_dim] arrays, not "
                      f"{values.ndim}-D {list(values.shape)}")
    return values, form, like


def _tensor(values, form, wire):
    return arrays.to_tensor(arrays.convert(values, form, wire), wire)


def _kv(k, v, wire, names=("k", "v")):
    """((values, form) of k, of v): K/V rows, checked to match each other."""
    kv, k_form, _ = _rows(k, names[0], wire)
    vv, v_form, _ = _rows(v, names[1], wire)
    if kv.shape != vv.shape:
        raise invalid(f"{names[1]}.shape: {list(vv.shape)} differs from {names[0]}.shape "
                      f"{list(kv.shape)}")
    return (kv, k_form), (vv, v_form)


def append_requests(session_id, wire, k, v, chunk_tokens):
    """The AppendKVRequest messages of one append, made as gRPC sends them (the arguments are
    checked here, before the call starts)."""
    (kv, k_form), (vv, v_form) = _kv(k, v, wire)
    tokens = kv.shape[0]
    if chunk_tokens is None:
        row_bytes = 2 * kv.shape[1] * kv.shape[2] * _ITEMSIZE[wire]
        chunk_tokens = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    rows = _count(chunk_tokens, "chunk_tokens")

    def chunks():
        # One message even for no tokens: the first names the session.
        for at in range(0, max(tokens, 1), rows):
            yield pb.AppendKVRequest(session_id=session_id if at == 0 else "",
                                     k=_tensor(kv[at:at + rows], k_form, wire),
                                     v=_tensor(vv[at:at + rows], v_form, wire))
    return chunks()


@_tagged
def step(session_id, wire, q, *, append_k=None, append_v=None, causal=False,
         window_size=(-1, -1), softmax_scale=None, return_lse=False, path="auto", request_id=""):
    """A Forward for Session.attend's arguments (an Attend with session_id)."""
    if (append_k is None) != (append_v is None):
        raise invalid("append_k, append_v: pass both (the query tokens' own K/V) or neither")
    if path not in PATHS:
        raise invalid(f"path: {path!r} is not one of {', '.join(PATHS)}")
    values, form, like = _rows(q, "q", wire)
    request = pb.AttendRequest(request_id=request_id, session_id=session_id,
                               q=_tensor(values, form, wire), causal=bool(causal),
                               return_lse=bool(return_lse), path=PATHS[path])
    if append_k is not None:
        k, v = _kv(append_k, append_v, wire, names=("append_k", "append_v"))
        request.append = True
        request.k.CopyFrom(_tensor(*k, wire))
        request.v.CopyFrom(_tensor(*v, wire))
    _set_scale(request, softmax_scale)
    _set_window(request, window_size)
    return Forward(request, {"q": like}, "thd", 1, values.shape[0])


def infos(response):
    """SessionInfo of each session of a ListSessionsResponse."""
    return [from_message(SessionInfo, s) for s in response.sessions]


class _Handle:
    """What Session and AsyncSession share: the session's identity and its call metadata."""

    def __init__(self, client, created, route):
        self._client = client
        self._metadata = route_metadata(client._metadata, route)
        self._created = created  # the SessionInfo CreateSession answered
        self._route = route
        self.closed = False

    @property
    def id(self):
        return self._created.session_id

    @property
    def route(self):
        """The key sent as x-attnserve-route with every call of the session (None: none)."""
        return self._route

    @property
    def dtype(self):
        return self._created.dtype

    @property
    def num_kv_heads(self):
        return self._created.num_kv_heads

    @property
    def head_dim(self):
        return self._created.head_dim

    def __repr__(self):
        route = f", route={self.route!r}" if self.route is not None else ""
        return (f"{type(self).__name__}({self.id}, {self.num_kv_heads} KV heads x "
                f"{self.head_dim}, {self.dtype}{route})")

    def _closed_by(self, error):
        """close() after a failed delete: a session that is gone is closed; anything else
        raises (and a later close() tries again)."""
        if error.code != grpc.StatusCode.NOT_FOUND:
            raise error
        self.closed = True

    def _result(self, f, response, return_result):
        result = attend_result(f, response)
        return result if return_result else result.result()


class Session(_Handle):
    """A KV session on the server (Client.session makes one). Use it in a with block, or
    close() it; every method raises AttnServeError (NOT_FOUND once the session is deleted,
    expired, or its server restarted)."""

    def append(self, k, v, *, chunk_tokens=None, timeout=None):
        """Appends k and v ([tokens, num_kv_heads, head_dim]) at the end of the session, in
        chunks of chunk_tokens rows (default: about 4 MiB of K and V each) streamed on one
        AppendKV call. All or nothing: on any failure the session holds what it held before.
        Arrays are converted to the session's dtype (rounded to nearest even). Returns the
        SessionInfo after the append."""
        messages = append_requests(self.id, self.dtype, k, v, chunk_tokens)
        try:
            response = self._client._stub.AppendKV(
                messages, timeout=self._client._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None
        return from_message(SessionInfo, response.session)

    def attend(self, q, *, append_k=None, append_v=None, causal=False, window_size=(-1, -1),
               softmax_scale=None, return_lse=False, path="auto", return_result=False,
               request_id=None, timeout=None):
        """Attention of q over the session's keys and values.

        q: [tokens, heads, head_dim], heads a multiple of the session's num_kv_heads (GQA);
            converted to the session's dtype, O comes back in q's own dtype and kind of array.
        append_k, append_v: [tokens, num_kv_heads, head_dim], the query tokens' own K/V,
            appended to the session first and then attended over (a prefill chunk or a decode
            step); they stay in the session. Without them the session is left as it is.
        causal: aligned to the bottom-right corner, as flash_attn (>= 2.1) and its
            flash_attn_with_kvcache: the query rows are the session's last positions, so with
            L keys (after the append) query row i of n sees keys j <= L - n + i. torch SDPA's
            is_causal is top-left (j <= i) instead.
        window_size: (left, right) keys each side of that diagonal, -1 unbounded.
        softmax_scale: None for 1 / sqrt(head_dim).
        return_lse: also return the LSE, float32 [heads, tokens], natural log, as
            flash_attn_varlen_func does.
        path, return_result, request_id, timeout: as Client.attend.

        Returns O [tokens, heads, head_dim], or (O, lse). Raises AttnServeError.
        """
        f = step(self.id, self.dtype, q, append_k=append_k, append_v=append_v, causal=causal,
                 window_size=window_size, softmax_scale=softmax_scale, return_lse=return_lse,
                 path=path, request_id=self._client._request_id(request_id))
        response = self._client._unary("Attend", f.request, f.request.request_id, timeout,
                                       metadata=self._metadata)
        return self._result(f, response, return_result)

    def info(self, *, timeout=None):
        """The session as the server holds it now (a SessionInfo: tokens, bytes, pages, ...)."""
        return from_message(SessionInfo, self._client._unary(
            "GetSession", pb.GetSessionRequest(session_id=self.id), "", timeout,
            metadata=self._metadata))

    def delete(self, *, timeout=None):
        """Deletes the session (its pages go back to the server's pool once running steps are
        done). Raises AttnServeError, NOT_FOUND when it is already gone."""
        self._client._unary("DeleteSession", pb.DeleteSessionRequest(session_id=self.id), "",
                            timeout, metadata=self._metadata)
        self.closed = True

    def close(self, *, timeout=None):
        """delete(), once, and quietly when the session is already gone (expired, deleted, or
        lost with a server restart)."""
        if not self.closed:
            try:
                self.delete(timeout=timeout)
            except AttnServeError as e:
                self._closed_by(e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncSession(_Handle):
    """Session for AsyncClient: the same methods as coroutines; `async with await
    client.session(...) as s:`, or `await s.close()`."""

    async def append(self, k, v, *, chunk_tokens=None, timeout=None):
        """Session.append as a coroutine."""
        messages = append_requests(self.id, self.dtype, k, v, chunk_tokens)
        try:
            response = await self._client._stub.AppendKV(
                messages, timeout=self._client._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None
        return from_message(SessionInfo, response.session)

    async def attend(self, q, *, append_k=None, append_v=None, causal=False,
                     window_size=(-1, -1), softmax_scale=None, return_lse=False, path="auto",
                     return_result=False, request_id=None, timeout=None):
        """Session.attend as a coroutine. causal is bottom-right aligned: with L keys after the
        append, query row i of n sees keys j <= L - n + i (as flash_attn_with_kvcache)."""
        f = step(self.id, self.dtype, q, append_k=append_k, append_v=append_v, causal=causal,
                 window_size=window_size, softmax_scale=softmax_scale, return_lse=return_lse,
                 path=path, request_id=self._client._request_id(request_id))
        response = await self._client._unary("Attend", f.request, f.request.request_id, timeout,
                                             metadata=self._metadata)
        return self._result(f, response, return_result)

    async def info(self, *, timeout=None):
        """Session.info as a coroutine."""
        return from_message(SessionInfo, await self._client._unary(
            "GetSession", pb.GetSessionRequest(session_id=self.id), "", timeout,
            metadata=self._metadata))

    async def delete(self, *, timeout=None):
        """Session.delete as a coroutine."""
        await self._client._unary("DeleteSession", pb.DeleteSessionRequest(session_id=self.id),
                                  "", timeout, metadata=self._metadata)
        self.closed = True

    async def close(self, *, timeout=None):
        """Session.close as a coroutine."""
        if not self.closed:
            try:
                await self.delete(timeout=timeout)
            except AttnServeError as e:
                self._closed_by(e)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
