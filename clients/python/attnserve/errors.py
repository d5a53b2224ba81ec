"""The one exception every attnserve call raises."""
import grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class AttnServeError(Exception):
    """A failed call: code (a grpc.StatusCode), the server's message, and the request id.

    Raised by every method of Client and AsyncClient, and carried by attend_many's results for
    the requests that failed. Arguments the client can check itself (a layout, a number of
    dimensions, a dtype) fail before anything is sent, with INVALID_ARGUMENT as the server would
    give: ``except AttnServeError as e: if e.code == grpc.StatusCode.INVALID_ARGUMENT`` covers
    both. The message names the field, e.g. "q.shape: ..."."""

    def __init__(self, code, message, request_id=""):
        super().__init__(code, message, request_id)
        self.code = code
        self.message = message
        self.request_id = request_id

    def __str__(self):
        where = f" (request {self.request_id})" if self.request_id else ""
        return f"{self.code.name}: {self.message}{where}"

    @classmethod
    def from_rpc_error(cls, error, request_id=""):
        """From a grpc.RpcError (sync or grpc.aio)."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "", request_id)

    @classmethod
    def from_status(cls, code, message, request_id=""):
        """From a numeric status code, as AttendResponse.error carries it."""
        return cls(_CODES.get(code, grpc.StatusCode.UNKNOWN), message, request_id)


def invalid(message, request_id=""):
    return AttnServeError(grpc.StatusCode.INVALID_ARGUMENT, message, request_id)
