"""AsyncClient: Client's methods as coroutines over grpc.aio, for asyncio programs.

    async with attnserve.AsyncClient("127.0.0.1:50051") as c:
        o = await c.attend(q, k, v, causal=True)
        async for r in c.attend_many(problems):
            ...

Arguments, results and errors are exactly Client's (see its docstrings); only the waiting
differs. Request building and response decoding are shared through _protocol.
"""
import asyncio
import os

import grpc
import grpc.aio

from attnserve import _protocol
from attnserve import session as _session
from attnserve import training as _training
from attnserve._proto import Stub, pb
from attnserve.client import _Base
from attnserve.errors import AttnServeError
from attnserve.records import ServerInfo, SessionInfo, from_message
from attnserve.shared_memory import SharedMemoryRegion, pass_descriptor, sealed_memfd, socket_of


class AsyncClient(_Base):
    """Client for asyncio: the same constructor and methods, each a coroutine (attend_many an
    async generator). Create it inside a running event loop; close with `await c.close()` or
    `async with`."""

    def __init__(self, target="127.0.0.1:50051", *, token=None, root_certificates=None,
                 timeout=60.0, max_message_bytes=256 << 20, options=()):
        super().__init__(target, token, root_certificates, timeout, max_message_bytes, options)
        if self._credentials is not None:
            self._channel = grpc.aio.secure_channel(target, self._credentials,
                                                    options=self._options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=self._options)
        self._stub = Stub(self._channel)
        self._training_stub = _training.Stub(self._channel)

    async def close(self):
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _unary(self, method, request, request_id, timeout, metadata=None):
        try:
            return await getattr(self._stub, method)(
                request, timeout=self._deadline(timeout),
                metadata=self._metadata if metadata is None else metadata)
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e, request_id) from None

    async def _training_unary(self, method, request, timeout):
        try:
            return await getattr(self._training_stub, method)(
                request, timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None

    async def train(self, *, timeout=None, **job):
        """Client.train as a coroutine: an AsyncTrainingJob (await its status(), cancel(),
        wait(), result(); `async for` over its watch())."""
        return await _training.submit_async(self, _training.spec(**job), timeout)

    async def training_job(self, job_id, *, timeout=None):
        """Client.training_job as a coroutine: the AsyncTrainingJob of an earlier job."""
        job = _training.AsyncTrainingJob(self, job_id)
        job.submitted = await job.status(timeout=timeout)
        return job

    async def training_jobs(self, *, timeout=None):
        """Client.training_jobs as a coroutine."""
        return _training.statuses(await self._training_unary(
            "ListTrainingJobs", _training.tpb.ListTrainingJobsRequest(), timeout))

    async def info(self, *, timeout=None):
        """Client.info: the server's ServerInfo, every field."""
        return from_message(ServerInfo, await self._unary(
            "GetServerInfo", pb.GetServerInfoRequest(), "", timeout))

    async def _attend(self, f, return_result, timeout, shared_memory):
        if shared_memory is not None:
            shared_memory.begin()
        try:
            if shared_memory is not None:
                shared_memory.place_forward(f.request)
            response = await self._unary("Attend", f.request, f.request.request_id, timeout)
            result = _protocol.attend_result(
                f, response, shared_memory.read if shared_memory is not None else None)
        finally:
            if shared_memory is not None:
                shared_memory.end()
        return result if return_result else result.result()

    async def attend(self, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                     return_lse=False, dropout_p=0.0, layout="bshd", dtype=None, path="auto",
                     return_result=False, request_id=None, timeout=None, shared_memory=None):
        """Client.attend as a coroutine: dense [batch, seqlen, heads, head_dim] (layout="bhsd"
        for SDPA's order). causal is bottom-right aligned, as flash_attn >= 2.1: query row i
        sees keys j <= i + seqlen_k - seqlen_q (SDPA's is_causal is top-left). return_lse adds
        the float32 LSE [batch, heads, seqlen_q], natural log."""
        f = _protocol.forward(q, k, v, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, return_lse=return_lse,
                              dropout_p=dropout_p, layout=layout, dtype=dtype, path=path,
                              request_id=self._request_id(request_id))
        return await self._attend(f, return_result, timeout, shared_memory)

    async def attend_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                            max_seqlen_k=None, *, softmax_scale=None, causal=False,
                            window_size=(-1, -1), return_lse=False, dropout_p=0.0, dtype=None,
                            path="auto", return_result=False, request_id=None, timeout=None,
                            shared_memory=None):
        """Client.attend_varlen as a coroutine: packed [total, heads, head_dim] with cu_seqlens.
        causal is bottom-right aligned per sequence, as flash_attn >= 2.1 (query i sees keys
        j <= i + seqlen_k - seqlen_q). The LSE is float32 [heads, total_q], natural log."""
        f = _protocol.forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, varlen=True,
                              softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, return_lse=return_lse,
                              dropout_p=dropout_p, dtype=dtype, path=path,
                              request_id=self._request_id(request_id))
        return await self._attend(f, return_result, timeout, shared_memory)

    async def _backward(self, b, timeout, shared_memory):
        if shared_memory is not None:
            shared_memory.begin()
        try:
            if shared_memory is not None:
                shared_memory.place_backward(b.request)
            response = await self._unary("AttendBackward", b.request,
                                         b.request.forward.request_id, timeout)
        finally:
            if shared_memory is not None:
                shared_memory.end()
        return _protocol.gradients(b, response)

    async def backward(self, q, k, v, d_o, *, o=None, lse=None, softmax_scale=None,
                       causal=False, window_size=(-1, -1), layout="bshd", dtype=None,
                       path="auto", deterministic=False, request_id=None, timeout=None,
                       shared_memory=None):
        """Client.backward as a coroutine: (dq, dk, dv). causal is bottom-right aligned, as
        flash_attn >= 2.1 (query i sees keys j <= i + seqlen_k - seqlen_q)."""
        b = _protocol.backward(q, k, v, d_o, o=o, lse=lse, softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, layout=layout,
                               dtype=dtype, path=path, deterministic=deterministic,
                               request_id=self._request_id(request_id))
        return await self._backward(b, timeout, shared_memory)

    async def backward_varlen(self, q, k, v, d_o, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                              max_seqlen_k=None, *, o=None, lse=None, softmax_scale=None,
                              causal=False, window_size=(-1, -1), dtype=None, path="auto",
                              deterministic=False, request_id=None, timeout=None,
                              shared_memory=None):
        """Client.backward_varlen as a coroutine. causal is bottom-right aligned per sequence,
        as flash_attn >= 2.1 (query i sees keys j <= i + seqlen_k - seqlen_q)."""
        b = _protocol.backward(q, k, v, d_o, o=o, lse=lse, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, varlen=True,
                               softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, dtype=dtype, path=path,
                               deterministic=deterministic,
                               request_id=self._request_id(request_id))
        return await self._backward(b, timeout, shared_memory)

    async def attend_many(self, problems, *, ordered=False, timeout=None, shared_memory=None):
        """Client.attend_many as an async generator; problems may be an iterable or an async
        iterable of attend()'s (or attend_varlen()'s) keyword dicts. causal is bottom-right
        aligned (query i sees keys j <= i + seqlen_k - seqlen_q). Yields an AttendResult per
        problem; a failed request sets its .error and the stream goes on."""
        if shared_memory is not None:
            shared_memory.begin()
        stream = _protocol.Stream(self._request_id, ordered, shared_memory)

        async def requests():
            try:
                if hasattr(problems, "__aiter__"):
                    index = 0
                    async for p in problems:
                        request = stream.prepare(index, p)
                        index += 1
                        if request is not None:
                            yield request
                else:
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
                async for response in call:
                    for result in stream.answered(response):
                        yield result
            except grpc.RpcError as e:
                raise AttnServeError.from_rpc_error(e) from None
            for result in stream.finish(wait=False):
                yield result
            if stream.problems_error is not None:
                raise stream.problems_error
        finally:
            call.cancel()
            if shared_memory is not None:
                shared_memory.end()

    async def session(self, num_kv_heads, head_dim, dtype, *, max_tokens=None, ttl=None,
                      route=None, timeout=None):
        """Client.session as a coroutine: an AsyncSession (`async with await c.session(...) as
        s:`), whose append, attend, info, delete and close are coroutines."""
        request = _session.create_request(num_kv_heads, head_dim, dtype, max_tokens, ttl)
        metadata = _session.route_metadata(self._metadata, route)
        created = from_message(SessionInfo, await self._unary("CreateSession", request, "",
                                                              timeout, metadata=metadata))
        return _session.AsyncSession(self, created, route)

    async def sessions(self, *, route=None, timeout=None):
        """Client.sessions as a coroutine."""
        return _session.infos(await self._unary(
            "ListSessions", pb.ListSessionsRequest(), "", timeout,
            metadata=_session.route_metadata(self._metadata, route)))

    async def shared_memory(self, size, *, name=None, timeout=None):
        """Client.shared_memory as a coroutine; close the region with `await region.aclose()`
        or `async with`."""
        address = socket_of(await self.info(timeout=timeout))
        name = self._region_name(name)
        fd, mapping = sealed_memfd(name, size)
        try:
            try:  # a local socket answers at once, but never block the event loop on it
                token = await asyncio.get_running_loop().run_in_executor(
                    None, pass_descriptor, address, fd, self._deadline(timeout))
            finally:
                os.close(fd)
            await self._unary("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(
                name=name, offset=0, byte_size=size, fd_token=token), "", timeout)
        except BaseException:
            mapping.close()
            raise
        return SharedMemoryRegion(name, size, mapping, self._unregister_region, is_async=True)

    async def _unregister_region(self, name):
        await self._unary("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(name=name),
                          "", None)

