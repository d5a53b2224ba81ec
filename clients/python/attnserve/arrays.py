"""Arrays in and out: numpy, ml_dtypes' bfloat16, torch tensors, and the wire's Tensor message.

Inside the client every array is a numpy array of its *values* in one of three forms: float32,
float16, or the uint16 bits of bfloat16 (numpy has no bfloat16 of its own). What the caller
handed in is remembered as a `Like`, so each result goes back as the same kind of array: a torch
tensor on the same device, or a numpy array of the same dtype (ml_dtypes.bfloat16 included).
Neither torch nor ml_dtypes is imported here: an array of theirs can only exist once its module
is loaded, so the client finds them in sys.modules.
"""
import sys
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from attnserve._proto import enum_names, pb
from attnserve.errors import AttnServeError, invalid

WIRE_DTYPES = enum_names(pb.DType.DESCRIPTOR)  # "float32", "float16", "bfloat16"
_WIRE_NAMES = {number: name for name, number in WIRE_DTYPES.items()}
_LITTLE_ENDIAN = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "float64": "<f8"}
_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
            "bf16": "bfloat16"}


def dtype_name(dtype):
    """The wire name of a dtype argument: "bfloat16", "bf16", np.float16, torch.bfloat16, ..."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)  # torch.float16 prints as "torch.float16"
    name = name.lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in WIRE_DTYPES:
        raise invalid(f"dtype: {dtype!r} is not one the server computes in (float32, float16, "
                      "bfloat16)")
    return name


def _ml_bfloat16():
    module = sys.modules.get("ml_dtypes")
    return None if module is None else np.dtype(module.bfloat16)


def _torch_of(x):
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(x, torch.Tensor) else None


@dataclass(frozen=True)
class Like:
    """How an input array came in: its values' form ("float32", "float16", "bfloat16" or
    "float64"), and either the numpy dtype to return or the torch dtype and device."""

    form: str
    numpy_dtype: Any = None
    torch_dtype: Any = None
    device: Any = None

    def as_float32(self):
        """The same kind of array, float32 (the LSE's dtype)."""
        if self.torch_dtype is not None:
            return Like("float32", torch_dtype=sys.modules["torch"].float32, device=self.device)
        return Like("float32", numpy_dtype=np.dtype(np.float32))


def values_of(x, name, wire=None):
    """(numpy values, form, Like) of an input array. wire: the dtype it is sent as, when the
    caller chose one; then float64 converts too (never silently: without dtype= it is refused)."""
    torch = _torch_of(x)
    if torch is not None:
        forms = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
        if wire is not None:
            forms[torch.float64] = "float64"
        form = forms.get(x.dtype)
        if form is None:
            raise invalid(f"{name}.dtype: {x.dtype} is not float32, float16 or bfloat16")
        host = x.detach().cpu().contiguous()
        values = (host.view(torch.int16).numpy().view(np.uint16) if form == "bfloat16"
                  else host.numpy())
        return values, form, Like(form, torch_dtype=x.dtype, device=x.device)

    a = np.asarray(x)
    bfloat16 = _ml_bfloat16()
    if bfloat16 is not None and a.dtype == bfloat16:
        return a.view(np.uint16), "bfloat16", Like("bfloat16", numpy_dtype=a.dtype)
    if a.dtype == np.float32 or a.dtype == np.float16:
        return a, a.dtype.name, Like(a.dtype.name, numpy_dtype=a.dtype)
    if a.dtype == np.uint16 and wire == "bfloat16":  # bfloat16 bits, as the wire carries them
        return a, "bfloat16", Like("bfloat16", numpy_dtype=a.dtype)
    if a.dtype == np.float64 and wire is not None:
        return a, "float64", Like("float64", numpy_dtype=a.dtype)
    if wire is not None:
        raise invalid(f"{name}.dtype: {a.dtype} does not convert to {wire} (float64, float32, "
                      "float16 and bfloat16 do)")
    hint = (" (bfloat16 bits: also pass dtype='bfloat16', or use ml_dtypes.bfloat16 arrays)"
            if a.dtype == np.uint16 else "")
    raise invalid(f"{name}.dtype: {a.dtype} is not float32, float16 or bfloat16; pass dtype= "
                  f"to convert{hint}")


def _to_bfloat16_bits(x):
    """float32 -> bfloat16 bits, rounding to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (u >> np.uint32(16)) | np.uint32(0x40)
    return np.where(np.isnan(x), quiet_nan, rounded).astype(np.uint16)


def _from_bfloat16_bits(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def convert(values, form, to):
    """Values from one form to another: widening is exact, narrowing rounds to nearest even."""
    if form == to:
        return values
    wide = _from_bfloat16_bits(values) if form == "bfloat16" else values
    if to == "bfloat16":
        return _to_bfloat16_bits(wide.astype(np.float32, copy=False))
    return wide.astype(to)


def to_tensor(values, form):
    """A Tensor message of values already in a wire form."""
    data = np.ascontiguousarray(values, dtype=_LITTLE_ENDIAN[form])
    return pb.Tensor(dtype=WIRE_DTYPES[form], shape=list(data.shape), data=data.tobytes())


def from_tensor(t, data=None, request_id=""):
    """(values, form) of a Tensor; data: its bytes when they are elsewhere (shared memory)."""
    form = _WIRE_NAMES.get(t.dtype)
    if form is None:
        raise AttnServeError(grpc.StatusCode.INTERNAL, f"response tensor dtype {t.dtype} is "
                             "unknown", request_id)
    data = t.data if data is None else data
    shape = tuple(t.shape)
    count = int(np.prod(shape, dtype=np.int64))
    itemsize = np.dtype(_LITTLE_ENDIAN[form]).itemsize
    if len(data) != count * itemsize:
        raise AttnServeError(
            grpc.StatusCode.INTERNAL, f"response tensor of shape {list(shape)} holds "
            f"{len(data)} bytes, not {count * itemsize}", request_id)
    return np.frombuffer(data, dtype=_LITTLE_ENDIAN[form]).reshape(shape), form


def to_user(values, form, like):
    """Values as the caller's kind of array (see Like), writable and contiguous."""
    values = np.ascontiguousarray(convert(values, form, like.form))
    if like.torch_dtype is not None:
        torch = sys.modules["torch"]
        if not values.flags.writeable:
            values = values.copy()
        if like.form == "bfloat16":
            out = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(values)
        return out if getattr(like.device, "type", "cpu") == "cpu" else out.to(like.device)
    if like.form == "bfloat16":
        out = values.view(like.numpy_dtype)  # the bits as ml_dtypes.bfloat16 (or uint16 as sent)
    else:
        out = values.astype(like.numpy_dtype, copy=False)
    return out if out.flags.writeable else out.copy()


def swap_seq_heads(values):
    """[b, s, h, d] <-> [b, h, s, d]."""
    return np.swapaxes(values, 1, 2)


def ints(x, name):
    """A list of Python ints from a list, numpy array or torch tensor (cu_seqlens)."""
    if _torch_of(x) is not None:
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise invalid(f"{name}: a 1-D array of integers, not {a.dtype} of shape {list(a.shape)}")
    return [int(v) for v in a]
