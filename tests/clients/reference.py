"""A float64 numpy reference of attention and its gradients, bottom-right aligned as the server."""
import numpy as np

# Largest max-abs error accepted against the float64 reference, per dtype, for |O| <= 1 (and for
# gradients, times max(1, max |reference|)): a few units of the dtype's last place after the
# inputs' own rounding, which the reference sees too.
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}
GRAD_TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def visible(lq, lk, causal=False, window=(-1, -1)):
    """[lq, lk] mask of the keys each query row sees, bottom-right aligned: query i's diagonal
    is key i + lk - lq (flash_attn >= 2.1)."""
    left, right = window
    if causal:
        right = 0
    diagonal = np.arange(lq)[:, None] + (lk - lq)
    cols = np.arange(lk)[None, :]
    mask = np.ones((lq, lk), dtype=bool)
    if right >= 0:
        mask &= cols <= diagonal + right
    if left >= 0:
        mask &= cols >= diagonal - left
    return mask


def _sequences(q, k, cu_q, cu_k):
    if cu_q is None:
        b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
        return [(slice(i * lq, (i + 1) * lq), slice(i * lk, (i + 1) * lk)) for i in range(b)]
    return [(slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1]))
            for i in range(len(cu_q) - 1)]


def _packed(x):
    x = np.asarray(x, dtype=np.float64)
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def attention(q, k, v, d_o=None, *, causal=False, window=(-1, -1), cu_q=None, cu_k=None,
              scale=None):
    """O and the LSE [heads, total_q] (and dQ, dK, dV when d_o is given) of bshd or packed
    inputs, in float64."""
    Q, K, V = _packed(q), _packed(k), _packed(v)
    dO = None if d_o is None else _packed(d_o)
    h, hk, d = Q.shape[1], K.shape[1], Q.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    O = np.zeros_like(Q)
    lse = np.full((h, Q.shape[0]), -np.inf)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    for rq, rk in _sequences(q, k, cu_q, cu_k):
        mask = visible(rq.stop - rq.start, rk.stop - rk.start, causal, window)
        for i in range(h):
            j = i // (h // hk)
            s = np.where(mask, scale * Q[rq, i] @ K[rk, j].T, -np.inf)
            m = s.max(axis=1, initial=-np.inf)
            seen = np.isfinite(m)
            p = np.where(mask, np.exp(s - np.where(seen, m, 0)[:, None]), 0.0)
            l = p.sum(axis=1)
            p = np.divide(p, l[:, None], out=np.zeros_like(p), where=seen[:, None])
            O[rq, i] = p @ V[rk, j]
            lse[i, rq] = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)
            if dO is not None:
                dV[rk, j] += p.T @ dO[rq, i]
                dp = dO[rq, i] @ V[rk, j].T
                ds = p * (dp - (dO[rq, i] * O[rq, i]).sum(axis=1)[:, None])
                dQ[rq, i] = scale * ds @ K[rk, j]
                dK[rk, j] += scale * ds.T @ Q[rq, i]
    out = (O.reshape(np.shape(q)), lse)
    if dO is not None:
        out += (dQ.reshape(np.shape(q)), dK.reshape(np.shape(k)), dV.reshape(np.shape(v)))
    return out


def bf16_round(x):
    """float32 values rounded to bfloat16 (nearest even), still float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


def rounded(x, dtype):
    """x as the server sees it in `dtype`, as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_round(x)
    return x


def max_error(got, want):
    got = np.asarray(got, dtype=np.float64)
    return float(np.max(np.abs(got - want))) if want.size else 0.0


def assert_close(name, got, want, tol):
    """got within tol * max(1, max |want|) of want, everywhere (NaN fails)."""
    assert np.shape(got) == np.shape(want), f"{name}: shape {np.shape(got)} != {np.shape(want)}"
    bound = tol * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    err = max_error(got, want)
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"
