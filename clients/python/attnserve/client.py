"""Client: one channel to an attnserve server, blocking calls (AsyncClient in aio.py mirrors it).

Every method builds its request through _protocol (shared with AsyncClient), calls the stub that
_proto builds from the service descriptor, and turns gRPC failures into AttnServeError. A new
rpc (sessions, training jobs) is a request builder in _protocol and a few lines here and in aio.
"""
import itertools
import os
import uuid

import grpc

from attnserve import _protocol
from attnserve import session as _session
from attnserve import training as _training
from attnserve._proto import Stub, pb
from attnserve.errors import AttnServeError
from attnserve.records import ServerInfo, SessionInfo, from_message
from attnserve.shared_memory import SharedMemoryRegion, pass_descriptor, sealed_memfd, socket_of


class _Base:
    """What both clients share: channel options, credentials, deadlines and request ids."""

    def __init__(self, target, token, root_certificates, timeout, max_message_bytes, options):
        self.target = target
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes)] + list(options)
        self._credentials = (grpc.ssl_channel_credentials(root_certificates=root_certificates)
                             if root_certificates is not None else None)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._timeout = timeout
        # Request ids the server logs and echoes: unique per client, readable in a log line.
        self._id_prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self._regions = itertools.count()

    def _deadline(self, timeout):
        return self._timeout if timeout is None else timeout

    def _request_id(self, given=None):
        return str(given) if given else f"{self._id_prefix}-{next(self._ids)}"

    def _region_name(self, name):
        return name or f"py-{os.getpid()}-{self._id_prefix}-{next(self._regions)}"


class Client(_Base):
    """A connection to an attnserve server.

        import attnserve
        with attnserve.Client("127.0.0.1:50051") as c:
            o = c.attend(q, k, v, causal=True)  # q [batch, seqlen_q, heads, head_dim]

    target: "host:port" or "unix:/path". token: sent as "authorization: Bearer <token>".
    root_certificates (PEM bytes) turns on TLS. timeout: the default deadline of each call in
    seconds (None: no deadline); every method takes its own timeout= too. options: more gRPC
    channel arguments, as (name, value) pairs.

    Arrays are numpy (float32, float16, ml_dtypes.bfloat16) or torch tensors; results come back
    as the same kind, in q's dtype (and on q's device). Every failure raises AttnServeError with
    the gRPC code, the server's message and the request id.
    """

    def __init__(self, target="127.0.0.1:50051", *, token=None, root_certificates=None,
                 timeout=60.0, max_message_bytes=256 << 20, options=()):
        super().__init__(target, token, root_certificates, timeout, max_message_bytes, options)
        if self._credentials is not None:
            self._channel = grpc.secure_channel(target, self._credentials, options=self._options)
        else:
            self._channel = grpc.insecure_channel(target, options=self._options)
        self._stub = Stub(self._channel)
        self._training_stub = _training.Stub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _unary(self, method, request, request_id, timeout, metadata=None):
        try:
            return getattr(self._stub, method)(
                request, timeout=self._deadline(timeout),
                metadata=self._metadata if metadata is None else metadata)
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e, request_id) from None

    def _training_unary(self, method, request, timeout):
        try:
            return getattr(self._training_stub, method)(request, timeout=self._deadline(timeout),
                                                        metadata=self._metadata)
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None

    def train(self, *, timeout=None, **job):
        """Submits a training job of one attention layer; returns its TrainingJob handle
        (watch(), wait(), cancel(), result() with numpy weights). training.py has the layer.

        Data: task="associative_recall" (default) or "copy" with vocab_size and task_seed, or
            inputs= and targets= arrays [num_sequences, seqlen, model_dim] (mean squared error).
        Layer: model_dim (64), num_heads (4), num_kv_heads (num_heads), head_dim (16), causal
            (True), window_size ((-1, -1)), residual (True), layer_norm (True).
        Run: batch_size (16), seqlen (32), steps (300), dtype ("float32"; "float16" or
            "bfloat16" with float32 master weights), seed, path ("auto", "fused", "naive",
            "cpu"), checkpoint_every (0: the server's), name, initial_weights ({name: array}),
            deterministic (False: True makes every step's attention backward bit-identical
            across runs).
        Optimiser: optimizer ("adamw" or "sgd"), learning_rate (1e-2), schedule ("constant",
            "cosine", "linear"), warmup_steps, min_learning_rate, betas, eps, weight_decay,
            max_grad_norm (0: no clipping).
        A job the server cannot run still comes back, FAILED, with the reason in
        job.submitted.error (and result() raises it). Raises AttnServeError.
        """
        return _training.submit(self, _training.spec(**job), timeout)

    def training_job(self, job_id, *, timeout=None):
        """The TrainingJob handle of a job submitted earlier with this client's token; NOT_FOUND
        (AttnServeError) when the token has no job of that id."""
        job = _training.TrainingJob(self, job_id)
        job.submitted = job.status(timeout=timeout)
        return job

    def training_jobs(self, *, timeout=None):
        """JobStatus of every job of this client's token, oldest first."""
        return _training.statuses(self._training_unary(
            "ListTrainingJobs", _training.tpb.ListTrainingJobsRequest(), timeout))

    def info(self, *, timeout=None):
        """The server's ServerInfo: version, devices, engines, limits, stats, ... (every field,
        defaults included)."""
        return from_message(ServerInfo, self._unary("GetServerInfo", pb.GetServerInfoRequest(),
                                                    "", timeout))

    def _attend(self, f, return_result, timeout, shared_memory):
        if shared_memory is not None:
            shared_memory.begin()
        try:
            if shared_memory is not None:
                shared_memory.place_forward(f.request)
            response = self._unary("Attend", f.request, f.request.request_id, timeout)
            result = _protocol.attend_result(
                f, response, shared_memory.read if shared_memory is not None else None)
        finally:
            if shared_memory is not None:
                shared_memory.end()
        return result if return_result else result.result()

    def attend(self, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
               return_lse=False, dropout_p=0.0, layout="bshd", dtype=None, path="auto",
               return_result=False, request_id=None, timeout=None, shared_memory=None):
        """Attention of dense batches, as flash_attn_func: O = softmax(scale * Q K^T + mask) V.

        q: [batch, seqlen_q, heads, head_dim]; k, v: [batch, seqlen_k, kv_heads, head_dim] with
            heads a multiple of kv_heads (GQA / MQA). layout="bhsd" takes and returns torch
            SDPA's [batch, heads, seqlen, head_dim] instead; anything but 4-D is refused.
        softmax_scale: None for 1 / sqrt(head_dim).
        causal: mask aligned to the bottom-right corner, as flash_attn >= 2.1: query row i sees
            keys j <= i + seqlen_k - seqlen_q (so the last query sees every key). torch SDPA's
            is_causal aligns top-left (j <= i) instead: they differ when seqlen_q != seqlen_k.
        window_size: (left, right) keys each side of that bottom-right diagonal, -1 unbounded:
            query i sees keys j in [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q +
            right]. causal=True makes right 0.
        return_lse: also return the log-sum-exp of each query row (natural log, float32),
            [batch, heads, seqlen_q] as flash_attn; -inf for a row that sees no key.
        dropout_p: only 0 (the server has no dropout). Arguments after v are keyword-only:
            flash_attn_func's fourth positional argument is dropout_p, so a positional port
            fails loudly instead of shifting every value.
        dtype: the dtype to compute in ("float32", "float16", "bfloat16"); inputs are rounded
            to it (nearest even) and results return in q's own dtype. Default: q's dtype, which
            must then be float32, float16 or bfloat16 (ml_dtypes or torch).
        path: "auto" (the server picks), "fused", "naive" or "cpu".
        return_result: return an AttendResult (o, lse, engine, path, timing, batch) instead.
        request_id: echoed by the server and in errors; default a fresh unique id.
        timeout: this call's deadline in seconds (default: the client's).
        shared_memory: a SharedMemoryRegion to move Q, K, V and O through (same host).

        Returns O (q's shape, dtype and kind of array), or (O, lse) with return_lse.
        Raises AttnServeError.
        """
        f = _protocol.forward(q, k, v, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, return_lse=return_lse,
                              dropout_p=dropout_p, layout=layout, dtype=dtype, path=path,
                              request_id=self._request_id(request_id))
        return self._attend(f, return_result, timeout, shared_memory)

    def attend_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                      max_seqlen_k=None, *, softmax_scale=None, causal=False,
                      window_size=(-1, -1), return_lse=False, dropout_p=0.0, dtype=None,
                      path="auto", return_result=False, request_id=None, timeout=None,
                      shared_memory=None):
        """Attention of packed variable-length sequences, as flash_attn_varlen_func.

        q: [total_q, heads, head_dim]; k, v: [total_k, kv_heads, head_dim]. cu_seqlens_q,
            cu_seqlens_k: batch + 1 prefix sums starting at 0 (sequence b is rows
            cu_seqlens[b]:cu_seqlens[b + 1]). max_seqlen_q / max_seqlen_k are optional (the
            server needs none); when given they are checked against cu_seqlens.
        causal: bottom-right aligned within each sequence, as flash_attn >= 2.1: query row i
            sees keys j <= i + seqlen_k - seqlen_q of its own sequence (torch SDPA's is_causal
            is top-left, j <= i).
        window_size: (left, right) keys each side of that bottom-right diagonal, -1 unbounded.
        return_lse: also return the LSE, float32 [heads, total_q], natural log (-inf for a row
            that sees no key), as flash_attn_varlen_func.
        The other arguments are attend()'s. Returns O [total_q, heads, head_dim] (q's dtype and
        kind of array), or (O, lse). Raises AttnServeError.
        """
        f = _protocol.forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, varlen=True,
                              softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, return_lse=return_lse,
                              dropout_p=dropout_p, dtype=dtype, path=path,
                              request_id=self._request_id(request_id))
        return self._attend(f, return_result, timeout, shared_memory)

    def _backward(self, b, timeout, shared_memory):
        if shared_memory is not None:
            shared_memory.begin()
        try:
            if shared_memory is not None:
                shared_memory.place_backward(b.request)
            response = self._unary("AttendBackward", b.request, b.request.forward.request_id,
                                   timeout)
        finally:
            if shared_memory is not None:
                shared_memory.end()
        return _protocol.gradients(b, response)

    def backward(self, q, k, v, d_o, *, o=None, lse=None, softmax_scale=None, causal=False,
                 window_size=(-1, -1), layout="bshd", dtype=None, path="auto",
                 deterministic=False, request_id=None, timeout=None, shared_memory=None):
        """Gradients dQ, dK, dV of attend(q, k, v, ...) for the upstream gradient d_o.

        q, k, v, d_o and the mask arguments as attend() (d_o: q's shape). causal: bottom-right
        aligned, as flash_attn >= 2.1 (query row i sees keys j <= i + seqlen_k - seqlen_q), not
        SDPA's top-left. o and lse, both or neither: the forward's outputs (attend with
        return_lse=True); given them the server skips rerunning the forward. deterministic:
        bit-identical gradients for the same inputs on every call, at some cost in speed (the
        server's --deterministic_backward makes every call so). Returns (dq, dk, dv), each like
        its input (dk and dv summed over the query heads sharing a KV head). Raises
        AttnServeError.
        """
        b = _protocol.backward(q, k, v, d_o, o=o, lse=lse, softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, layout=layout,
                               dtype=dtype, path=path, deterministic=deterministic,
                               request_id=self._request_id(request_id))
        return self._backward(b, timeout, shared_memory)

    def backward_varlen(self, q, k, v, d_o, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                        max_seqlen_k=None, *, o=None, lse=None, softmax_scale=None,
                        causal=False, window_size=(-1, -1), dtype=None, path="auto",
                        deterministic=False, request_id=None, timeout=None,
                        shared_memory=None):
        """backward() for attend_varlen's packed layout; lse is [heads, total_q]. causal:
        bottom-right aligned within each sequence (query i sees keys j <= i + seqlen_k -
        seqlen_q), as flash_attn >= 2.1. Returns (dq, dk, dv). Raises AttnServeError."""
        b = _protocol.backward(q, k, v, d_o, o=o, lse=lse, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, varlen=True,
                               softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, dtype=dtype, path=path,
                               deterministic=deterministic,
                               request_id=self._request_id(request_id))
        return self._backward(b, timeout, shared_memory)

    def attend_many(self, problems, *, ordered=False, timeout=None, shared_memory=None):
        """Many forward requests pipelined on one AttendStream call, for throughput (the server
        batches them with whatever else it runs). Yields one AttendResult per problem.

        problems: an iterable (consumed lazily) of dicts of attend()'s keyword arguments with
            q, k, v; with cu_seqlens_q and cu_seqlens_k, attend_varlen()'s. A "request_id" key
            names the request (default: a fresh id). causal is bottom-right aligned as in
            attend() (query i sees keys j <= i + seqlen_k - seqlen_q).
        ordered: yield in the problems' order instead of as answers arrive.
        timeout: the deadline of the whole stream (default: the client's).
        shared_memory: a region holding every problem's tensors one after another.

        A failed request does not end the stream: its result has .error (an AttnServeError,
        also for arguments refused before sending) and result.result() raises it. Only the
        stream itself failing (connection, deadline, authentication) raises AttnServeError here.
        """
        if shared_memory is not None:
            shared_memory.begin()
        stream = _protocol.Stream(self._request_id, ordered, shared_memory)

        def requests():
            try:
                for index, p in enumerate(problems):
                    request = stream.prepare(index, p)
                    if request is not None:
                        yield request
            except Exception as e:  # the caller's iterable failed: end the stream cleanly
                stream.sender_failed(e)
            finally:
                stream.sent_all.set()

        call = self._stub.AttendStream(requests(), timeout=self._deadline(timeout),
                                       metadata=self._metadata)
        try:
            try:
                for response in call:
                    yield from stream.answered(response)
            except grpc.RpcError as e:
                raise AttnServeError.from_rpc_error(e) from None
            yield from stream.finish()
            if stream.problems_error is not None:
                raise stream.problems_error
        finally:
            call.cancel()  # a no-op once finished; stops the stream when the caller breaks off
            if shared_memory is not None:
                shared_memory.end()

    def session(self, num_kv_heads, head_dim, dtype, *, max_tokens=None, ttl=None, route=None,
                timeout=None):
        """Creates a KV session: keys and values kept on the server across calls (a Session,
        with append, attend, info and close; session.py has the details). Use it in a with
        block, which deletes it at the end.

        num_kv_heads, head_dim, dtype ("float32", "float16", "bfloat16"): what it holds; arrays
            given to it are converted to this dtype.
        max_tokens: its largest length (None: the server's SessionLimits.max_tokens).
        ttl: seconds idle before the server expires it (None: the server's default).
        route: a stable key of the caller's choosing (a conversation id, say), sent as the
            x-attnserve-route header with this and every later call of the session, so that a
            session-routing proxy (deploy/nginx, deploy/haproxy) sends them all to the server
            that holds it. Not needed when talking to one server directly.
        Raises AttnServeError.
        """
        request = _session.create_request(num_kv_heads, head_dim, dtype, max_tokens, ttl)
        metadata = _session.route_metadata(self._metadata, route)
        created = from_message(SessionInfo, self._unary("CreateSession", request, "", timeout,
                                                        metadata=metadata))
        return _session.Session(self, created, route)

    def sessions(self, *, route=None, timeout=None):
        """SessionInfo of each KV session this client's token holds on the server. Behind a
        session-routing proxy each server lists its own: route= asks the one that key goes to.
        """
        return _session.infos(self._unary(
            "ListSessions", pb.ListSessionsRequest(), "", timeout,
            metadata=_session.route_metadata(self._metadata, route)))

    def shared_memory(self, size, *, name=None, timeout=None):
        """A SharedMemoryRegion of `size` bytes, registered with the server (same host only):
        a sealed memfd passed over ServerInfo.shared_memory_socket. Use it in a with block, or
        close() it. Raises AttnServeError (FAILED_PRECONDITION when the server offers none)."""
        address = socket_of(self.info(timeout=timeout))
        name = self._region_name(name)
        fd, mapping = sealed_memfd(name, size)
        try:
            try:
                token = pass_descriptor(address, fd, self._deadline(timeout))
            finally:
                os.close(fd)  # the server holds its own copy of the descriptor now
            self._unary("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(
                name=name, offset=0, byte_size=size, fd_token=token), "", timeout)
        except BaseException:
            mapping.close()
            raise
        return SharedMemoryRegion(name, size, mapping, self._unregister_region, is_async=False)

    def _unregister_region(self, name):
        self._unary("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(name=name), "",
                    None)

