#!/usr/bin/python3
"""`attnserve_client explain` against numpy: the printed O and every traced step.

    explain_check.py ATTNSERVE_CLIENT

For a few block and tile shapes (the default, causal ones with a short last tile, rows that see
no key of a tile, the engine's own 128 x 64), runs `explain --json` and checks, in float64 from
the Q, K and V it printed: that O matches softmax(S) V computed here (the fp32 forward rule of
tests/common: 1e-5 x max(1, max |reference|)) and so does the LSE; that the tiles cover the
visible keys; and that each tile's S, rowmax, m_new, alpha, P, l and acc follow from the state
before it by the online-softmax update. Then the text form: exit 0 and a final line that says
the result matches. Exits 77 (skipped) without numpy.
"""
import json
import math
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("explain_check: numpy is missing (apt install python3-numpy); skipped")
    sys.exit(77)

CASES = [
    [],  # the defaults: d = 64, 32 tokens, a block of 4 over two tiles of 16
    ["--causal", "--seqlen=12", "--kv_tile=4", "--head_dim=4"],
    ["--causal", "--seqlen=13", "--q_block=5", "--kv_tile=3", "--head_dim=17", "--seed=7"],
    ["--causal", "--seqlen=12", "--q_block=6", "--kv_tile=4", "--head_dim=8", "--seed=3"],
    ["--seqlen=9", "--q_block=1", "--kv_tile=4", "--head_dim=2", "--seed=11"],
    ["--causal", "--seqlen=300", "--q_block=128", "--kv_tile=64", "--head_dim=32"],
]


def fail(case, message):
    print(f"explain_check: FAIL {' '.join(case) or '(defaults)'}: {message}")
    sys.exit(1)


def visible(row, n, causal):
    """Keys [begin, end) query row `row` sees (equal lengths: bottom-right is top-left)."""
    return 0, (row + 1 if causal else n)


def check_json(client, case):
    run = subprocess.run([client, "explain", "--json", *case], capture_output=True, text=True)
    if run.returncode == 1:
        out = json.loads(run.stdout)
        fail(case, f"explain found O {out['max_abs_diff']} from its reference (bound {out['bound']})")
    if run.returncode != 0:
        fail(case, f"exit {run.returncode}: {run.stderr.strip()}")
    out = json.loads(run.stdout)
    prob = out["problem"]
    n, d, causal, scale = prob["seqlen"], prob["head_dim"], prob["causal"], prob["scale"]
    q, k, v = (np.array(out[name], dtype=np.float64) for name in ("q", "k", "v"))
    row0, rows = out["row0"], out["rows"]
    if (q.shape, k.shape, v.shape) != ((n, d),) * 3 or row0 + rows != n:
        fail(case, "shapes")

    # The result against softmax(S) V, here.
    o = np.array(out["o"], dtype=np.float64)
    lse = np.array(out["lse"], dtype=np.float64)
    ref = np.zeros((rows, d))
    ref_lse = np.zeros(rows)
    for i in range(rows):
        b, e = visible(row0 + i, n, causal)
        s = scale * k[b:e] @ q[row0 + i]
        p = np.exp(s - s.max())
        ref[i] = p @ v[b:e] / p.sum()
        ref_lse[i] = s.max() + math.log(p.sum())
    bound = 1e-5 * max(1.0, np.abs(ref).max())
    err = np.abs(o - ref).max()
    if err > bound or not out["match"]:
        fail(case, f"O differs from softmax(S) V by {err:.3g} (bound {bound:.3g})")
    if np.abs(lse - ref_lse).max() > 1e-5 * max(1.0, np.abs(ref_lse).max()):
        fail(case, f"LSE differs by {np.abs(lse - ref_lse).max():.3g}")

    # Every step from the state before it.
    m = np.full(rows, -np.inf)
    l = np.zeros(rows)
    acc = np.zeros((rows, d))
    covered = 0
    kv_tile = prob["kv_tile"]
    for tile in out["tiles"]:
        key0, cols = tile["key0"], tile["cols"]
        if key0 != covered or key0 % kv_tile or cols != min(kv_tile, n - key0):
            fail(case, f"tile at {key0} of {cols} keys after {covered} keys")
        covered += cols
        for i, r in enumerate(tile["rows"]):
            b, e = visible(row0 + i, n, causal)
            b, e = max(b - key0, 0), min(e - key0, cols)
            if not r["sees_tile"]:
                if b < e:
                    fail(case, f"row {row0 + i} skipped tile {key0}, whose keys it sees")
            else:
                s = np.array([np.nan if x is None else x for x in r["s"]])
                p = np.array([np.nan if x is None else x for x in r["p"]])
                seen = np.zeros(cols, dtype=bool)
                seen[b:e] = True
                if np.isnan(s[seen]).any() or not np.isnan(s[~seen]).all():
                    fail(case, f"row {row0 + i}, tile {key0}: the masked columns")
                want_s = scale * k[key0 + b:key0 + e] @ q[row0 + i]
                if np.abs(s[b:e] - want_s).max() > 1e-5 * max(1.0, np.abs(want_s).max()):
                    fail(case, f"row {row0 + i}, tile {key0}: S")
                row_max = s[b:e].max()
                m_before = -np.inf if r["m"] is None else r["m"]
                m_new = max(m_before, row_max)
                if m_before != m[i] or r["row_max"] != row_max or r["m_new"] != m_new:
                    fail(case, f"row {row0 + i}, tile {key0}: m {r['m']}, rowmax, m_new")
                alpha = math.exp(m_before - m_new)
                if abs(r["alpha"] - alpha) > 1e-6:
                    fail(case, f"row {row0 + i}, tile {key0}: alpha {r['alpha']}, not {alpha}")
                if np.abs(p[b:e] - np.exp(s[b:e] - m_new)).max() > 1e-6:
                    fail(case, f"row {row0 + i}, tile {key0}: P")
                m[i] = m_new
                l[i] = l[i] * r["alpha"] + p[b:e].sum()
                acc[i] = acc[i] * r["alpha"] + p[b:e] @ v[key0 + b:key0 + e]
            if abs(r["l"] - l[i]) > 1e-5 * max(1.0, l[i]):
                fail(case, f"row {row0 + i}, tile {key0}: l {r['l']}, not {l[i]}")
            if np.abs(np.array(r["acc"]) - acc[i]).max() > 1e-5 * max(1.0, np.abs(acc[i]).max()):
                fail(case, f"row {row0 + i}, tile {key0}: acc")
            l[i], acc[i] = r["l"], np.array(r["acc"])  # go on from the engine's own state
    if covered != n:
        fail(case, f"the tiles cover {covered} of {n} keys")
    if np.abs(acc / l[:, None] - o).max() > 1e-6 * max(1.0, np.abs(o).max()):
        fail(case, "O is not the last tile's acc / l")
    return len(out["tiles"]), err


def check_text(client, case):
    run = subprocess.run([client, "explain", *case], capture_output=True, text=True)
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    if run.returncode != 0 or not last.startswith("largest |O - naive|") or ": match;" not in last:
        fail(case, f"text form: exit {run.returncode}, last line {last!r}")


def main():
    client = sys.argv[1]
    for case in CASES:
        tiles, err = check_json(client, case)
        check_text(client, case)
        print(f"explain_check: ok {' '.join(case) or '(defaults)'}: {tiles} tiles, "
              f"max |O - softmax(S) V| {err:.2g}")
    for flag, named in (("--kv_tile=65", "--kv_tile"), ("--q_block=0", "--q_block"),
                        ("--seqlen=0", "--seqlen"), ("--head_dim=-1", "head_dim")):
        bad = subprocess.run([client, "explain", flag], capture_output=True, text=True)
        if bad.returncode != 2 or named not in bad.stderr:
            fail([flag], f"exit {bad.returncode}, {bad.stderr.strip()!r}")


if __name__ == "__main__":
    main()
