"""One forward request's outcome, with what the server says beyond O (engine, timing, batch)."""
from dataclasses import dataclass
from typing import Any, Optional

from attnserve.errors import AttnServeError
from attnserve.records import BatchInfo, Timing


@dataclass
class AttendResult:
    """One forward request's outcome: attend(..., return_result=True) returns one, attend_many
    yields one per problem. A failed request has `error` set and no o; result() raises it."""

    index: int  # the problem's position in attend_many's input (0 for a single call)
    request_id: str
    o: Any = None
    lse: Any = None  # when return_lse: float32, [batch, heads, seqlen_q] or [heads, total_q]
    error: Optional[AttnServeError] = None
    engine: str = ""
    path: str = ""
    timing: Optional[Timing] = None
    batch: Optional[BatchInfo] = None

    @property
    def ok(self):
        return self.error is None

    def result(self):
        """o, or (o, lse) when the LSE was asked for; raises the request's AttnServeError."""
        if self.error is not None:
            raise self.error
        return self.o if self.lse is None else (self.o, self.lse)
