"""attnserve's Python client: attention on a server, in the conventions of flash_attn and SDPA.

    import attnserve
    with attnserve.Client("127.0.0.1:50051") as c:
        o = c.attend(q, k, v, causal=True)            # [batch, seqlen, heads, head_dim]
        o, lse = c.attend_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, return_lse=True)
        dq, dk, dv = c.backward(q, k, v, d_o, causal=True)
        for r in c.attend_many([dict(q=q, k=k, v=v), dict(q=q2, k=k2, v=v2)]):
            r.index, r.o, r.error                      # pipelined on one stream
        c.info().limits.max_head_dim
        with c.session(8, 128, "bfloat16", route=conversation_id) as s:   # a KV session
            s.append(k, v); o = s.attend(q, append_k=k1, append_v=v1, causal=True)
        job = c.train(task="associative_recall", steps=300)   # an offline training job
        job.watch(), job.cancel(), job.result().weights["w_q"]

causal masks are aligned to the bottom-right corner when seqlen_q != seqlen_k, as in flash_attn
>= 2.1 (query row i sees keys j <= i + seqlen_k - seqlen_q); torch SDPA's is_causal aligns
top-left. Arrays are numpy (float32, float16, ml_dtypes.bfloat16) or torch tensors and come back
as the same kind, in q's dtype. Every failure raises AttnServeError(code, message, request_id).
AsyncClient has the same methods for asyncio.
"""
from importlib import metadata as _metadata

from attnserve.aio import AsyncClient
from attnserve.client import Client
from attnserve.errors import AttnServeError
from attnserve.records import (BatchInfo, Device, Limits, ServerInfo, SessionInfo, SessionLimits,
                               Stats, Timing)
from attnserve.results import AttendResult
from attnserve.session import AsyncSession, Session
from attnserve.shared_memory import SharedMemoryRegion
from attnserve.training import AsyncTrainingJob, JobStatus, TrainingJob, TrainingResult

try:
    __version__ = _metadata.version("attnserve")
except _metadata.PackageNotFoundError:  # imported from a source tree
    __version__ = "0+unknown"

__all__ = ["AsyncClient", "AsyncSession", "AsyncTrainingJob", "AttendResult", "AttnServeError",
           "BatchInfo", "Client", "Device", "JobStatus", "Limits", "ServerInfo", "Session",
           "SessionInfo", "SessionLimits", "SharedMemoryRegion", "Stats", "Timing", "TrainingJob",
           "TrainingResult", "__version__"]
