"""Stand-ins for torch and ml_dtypes, which Debian 12 does not ship for this machine's tests.

They offer only what the client touches, and behave as the real modules do there: a bfloat16
torch tensor refuses .numpy() (so the client must view it as int16 first), torch.from_numpy
shares memory and knows no uint16, an ml_dtypes.bfloat16 array is 2 bytes an element.
Tests that have the real module installed run against it instead (see test_arrays.py).
"""
import sys
import types
from contextlib import contextmanager

import numpy as np


def make_torch():
    torch = types.ModuleType("torch")

    class dtype:
        def __init__(self, name, numpy_dtype):
            self.name, self.numpy_dtype = name, np.dtype(numpy_dtype)

        def __repr__(self):
            return "torch." + self.name

    class device:
        def __init__(self, type_):
            self.type = type_

        def __eq__(self, other):
            return isinstance(other, device) and other.type == self.type

        def __repr__(self):
            return f"device(type='{self.type}')"

    torch.float32 = dtype("float32", np.float32)
    torch.float16 = dtype("float16", np.float16)
    torch.float64 = dtype("float64", np.float64)
    torch.int16 = dtype("int16", np.int16)
    torch.int32 = dtype("int32", np.int32)
    torch.int64 = dtype("int64", np.int64)
    torch.bfloat16 = dtype("bfloat16", np.uint16)  # stored as its bits
    by_numpy = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                np.dtype(np.float64): torch.float64, np.dtype(np.int16): torch.int16,
                np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}

    class Tensor:
        def __init__(self, array, dtype_, device_=None):
            self._a, self.dtype = array, dtype_
            self.device = device_ or device("cpu")

        @property
        def shape(self):
            return tuple(self._a.shape)

        def dim(self):
            return self._a.ndim

        def detach(self):
            return Tensor(self._a, self.dtype, self.device)

        def cpu(self):
            return Tensor(self._a, self.dtype, device("cpu"))

        def contiguous(self):
            return Tensor(np.ascontiguousarray(self._a), self.dtype, self.device)

        def transpose(self, a, b):
            return Tensor(np.swapaxes(self._a, a, b), self.dtype, self.device)

        def view(self, dtype_):
            assert dtype_.numpy_dtype.itemsize == self._a.dtype.itemsize
            return Tensor(self._a.view(dtype_.numpy_dtype), dtype_, self.device)

        def numpy(self):
            if self.device.type != "cpu":
                raise TypeError("can't convert cuda:0 device type tensor to numpy")
            if self.dtype is torch.bfloat16:
                raise TypeError("Got unsupported ScalarType BFloat16")
            return self._a

        def to(self, target):
            if isinstance(target, device):
                return Tensor(self._a, self.dtype, target)
            return Tensor(self._a.astype(target.numpy_dtype), target, self.device)

        def float(self):
            """Values as float32 (bfloat16 widened), for the tests' comparisons."""
            if self.dtype is torch.bfloat16:
                return (self._a.astype(np.uint32) << 16).view(np.float32)
            return self._a.astype(np.float32)

    def from_numpy(a):
        if a.dtype not in by_numpy:
            raise TypeError(f"can't convert np.ndarray of type numpy.{a.dtype}")
        return Tensor(a, by_numpy[a.dtype])

    def tensor(values, dtype=None, device=None):
        a = np.asarray(values)
        d = dtype or by_numpy[a.dtype]
        if d is torch.bfloat16:
            bits = (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16)
            a = bits.astype(np.uint16)
        else:
            a = a.astype(d.numpy_dtype)
        return Tensor(a, d, device)

    torch.Tensor, torch.device, torch.dtype = Tensor, device, dtype
    torch.from_numpy, torch.tensor = from_numpy, tensor
    return torch


def make_ml_dtypes():
    module = types.ModuleType("ml_dtypes")
    # A 2-byte dtype of its own, as ml_dtypes.bfloat16 is; its values are bfloat16 bits.
    module.bfloat16 = np.dtype([("bfloat16_bits", "<u2")])
    return module


@contextmanager
def installed(name, module):
    """The module importable as `name` for the block (and whatever was there put back)."""
    saved = sys.modules.get(name)
    sys.modules[name] = module
    try:
        yield module
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved
