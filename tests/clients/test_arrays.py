"""Arrays in and out: torch tensors and ml_dtypes' bfloat16 come back as what went in (through
stand-ins when the real modules are absent, and the real ones when installed), bfloat16
rounding, dtype arguments."""
import importlib.util

import numpy as np
import pytest

import attnserve
from attnserve import arrays
from fakes import installed, make_ml_dtypes, make_torch
from reference import TOLERANCE, assert_close, attention, bf16_round, rounded

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_ML_DTYPES = importlib.util.find_spec("ml_dtypes") is not None


def test_bfloat16_rounding_is_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3e38, np.inf, -np.inf, 1e-40],
                 dtype=np.float32)
    bits = arrays.convert(x, "float32", "bfloat16")
    back = arrays.convert(bits, "bfloat16", "float32")
    np.testing.assert_array_equal(back, bf16_round(x))
    assert back[1] == 1.0 and back[2] == 1.015625  # ties to even, both ways
    nan = arrays.convert(np.array([np.nan], dtype=np.float32), "float32", "bfloat16")
    assert np.isnan(arrays.convert(nan, "bfloat16", "float32")[0])


@pytest.mark.parametrize("spelling,name", [("bf16", "bfloat16"), (np.float16, "float16"),
                                           ("FLOAT32", "float32"), ("half", "float16")])
def test_dtype_spellings(spelling, name):
    assert arrays.dtype_name(spelling) == name


def test_fake_torch_round_trip_without_a_server():
    torch = make_torch()
    with installed("torch", torch):
        x = torch.tensor(rounded(np.linspace(-1, 1, 24).reshape(2, 3, 4), "bfloat16"),
                         dtype=torch.bfloat16, device=torch.device("cuda"))
        values, form, like = arrays.values_of(x, "q")
        assert form == "bfloat16" and values.dtype == np.uint16
        back = arrays.to_user(values, form, like)
        assert isinstance(back, torch.Tensor) and back.dtype is torch.bfloat16
        assert back.device.type == "cuda"  # returned where q lives
        np.testing.assert_array_equal(back.float(), x.float())
        with pytest.raises(attnserve.AttnServeError, match="q.dtype"):
            arrays.values_of(torch.tensor(np.zeros(3), dtype=torch.int32), "q")


def torch_attend(client, torch, dtype, rng, layout="bshd"):
    qs, ks = (2, 9, 4, 32), (2, 14, 2, 32)
    if layout == "bhsd":
        qs, ks = (2, 4, 9, 32), (2, 2, 14, 32)
    q, k, v = (rounded(rng.uniform(-1, 1, s), dtype) for s in (qs, ks, ks))
    td = getattr(torch, dtype)
    tq, tk, tv = (torch.tensor(x, dtype=td) for x in (q, k, v))
    o, lse = client.attend(tq, tk, tv, causal=True, return_lse=True, layout=layout)
    assert isinstance(o, torch.Tensor) and o.dtype == td and tuple(o.shape) == qs
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    t = (lambda x: x.transpose(0, 2, 1, 3)) if layout == "bhsd" else (lambda x: x)
    want = attention(t(q), t(k), t(v), causal=True)[0]
    got = o.float().numpy() if hasattr(o.float(), "numpy") else o.float()
    assert_close("o", t(np.asarray(got)), want, TOLERANCE[dtype])
    dq, dk, dv = client.backward(tq, tk, tv, o, o=o, lse=lse, causal=True, layout=layout)
    assert isinstance(dq, torch.Tensor) and dq.dtype == td and tuple(dk.shape) == ks


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_tensors_in_and_out_fake(client, rng, dtype):
    with installed("torch", make_torch()) as torch:
        torch_attend(client, torch, dtype, rng)
        torch_attend(client, torch, dtype, rng, layout="bhsd")
        cu = torch.tensor(np.array([0, 3, 9]), dtype=torch.int32)  # cu_seqlens as a tensor
        q = torch.tensor(rounded(rng.uniform(-1, 1, (9, 2, 16)), "float32"))
        assert tuple(client.attend_varlen(q, q, q, cu, cu).shape) == (9, 2, 16)


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (optional); the fake-torch "
                    "test covers the same calls")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_tensors_in_and_out_real(client, rng, dtype):
    import torch
    torch_attend(client, torch, dtype, rng)
    torch_attend(client, torch, dtype, rng, layout="bhsd")


def ml_dtypes_attend(client, ml_dtypes, rng):
    q, k, v = (bf16_round(rng.uniform(-1, 1, s)) for s in ((1, 11, 2, 32),) + ((1, 16, 1, 32),) * 2)
    as_bf16 = lambda x: (x.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    o, lse = client.attend(as_bf16(q), as_bf16(k), as_bf16(v), causal=True, return_lse=True)
    assert o.dtype == np.dtype(ml_dtypes.bfloat16) and o.shape == q.shape
    assert lse.dtype == np.float32
    widened = (o.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert_close("o", widened, attention(q, k, v, causal=True)[0], TOLERANCE["bfloat16"])


def test_ml_dtypes_bfloat16_in_and_out_fake(client, rng):
    with installed("ml_dtypes", make_ml_dtypes()) as ml_dtypes:
        ml_dtypes_attend(client, ml_dtypes, rng)


@pytest.mark.skipif(not HAVE_ML_DTYPES, reason="ml_dtypes is not installed (Debian 12 has no "
                    "package of it); the fake-ml_dtypes test covers the same calls")
def test_ml_dtypes_bfloat16_in_and_out_real(client, rng):
    import ml_dtypes
    ml_dtypes_attend(client, ml_dtypes, rng)
