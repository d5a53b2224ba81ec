#!/usr/bin/env python3
"""bench/ab_table.py on made-up rows: best of rounds, ratios to the first build and to the
anchors, the rounds' spread, and the rows it must leave out."""

import contextlib
import io
import json
import pathlib
import sys
import tempfile
import unittest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import ab_table  # noqa: E402


def ours(build, rnd, tflops, n=4096, causal=False, status="ok"):
    return {"build": build, "round": rnd, "bench": "attn_kernel_bench", "pass": "bwd",
            "engine": "fused", "dtype": "bf16", "d": 128, "causal": causal, "N": n,
            "tflops": tflops, "status": status}


def anchor(tflops, n=4096, causal=False, backend="CUDNN"):
    return {"bench": "sdpa_anchor", "backend": backend, "pass": "bwd", "dtype": "bf16", "d": 128,
            "causal": causal, "N": n, "tflops": tflops, "status": "ok"}


class AbTableTest(unittest.TestCase):
    def table(self, ab_rows, anchor_rows=None):
        with tempfile.TemporaryDirectory() as tmp:
            ab = pathlib.Path(tmp) / "ab.jsonl"
            ab.write_text("".join(json.dumps(r) + "\n" for r in ab_rows) + "not json, skipped\n")
            argv = [str(ab)]
            if anchor_rows is not None:
                sd = pathlib.Path(tmp) / "sdpa.jsonl"
                sd.write_text("".join(json.dumps(r) + "\n" for r in anchor_rows))
                argv += ["--anchor", str(sd)]
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                ab_table.main(argv)
            return out.getvalue()

    def test_best_of_rounds_and_ratios(self):
        rows = [ours("base", 1, 400.0), ours("base", 2, 420.0), ours("new", 1, 441.0),
                ours("new", 2, 430.0), ours("base", 1, 200.0, n=1024),
                ours("base", 2, 190.0, n=1024), ours("new", 1, 180.0, n=1024),
                ours("new", 2, 150.0, n=1024, status="error: out of memory")]
        text = self.table(rows, [anchor(490.0), anchor(250.0, n=1024)])
        lines = text.splitlines()
        row_4096 = next(l for l in lines if l.startswith("| bwd | bf16 | 128 | no | 4096 |"))
        cells = [c.strip() for c in row_4096.strip("|").split("|")]
        # base best 420, new best 441: 1.050; against cuDNN 490: 0.86 and 0.90.
        self.assertEqual(cells[5:], ["420", "441", "1.050", "490", "0.86", "0.90"])
        row_1024 = next(l for l in lines if "| 1024 |" in l)
        self.assertIn("| 200 | 180 | 0.900 | 250 | 0.80 | 0.72 |", row_1024)
        self.assertIn("new/base: min 0.900, median 0.975, max 1.050 over 2 shapes", text)
        self.assertIn("new/CUDNN: min 0.720, median 0.810, max 0.900 over 2 shapes", text)
        # base's rounds: 400 and 420 (5.0%), 200 and 190 (5.3%); new's failed row left out.
        self.assertIn("base: 2 round(s), rounds differ by up to 5.3%", text)
        self.assertIn("new: 2 round(s), rounds differ by up to 2.6%", text)

    def test_shapes_a_build_lacks_and_no_anchor(self):
        rows = [ours("base", 1, 300.0), ours("base", 1, 100.0, n=1024, causal=True),
                ours("new", 1, 330.0)]
        text = self.table(rows)
        causal = next(l for l in text.splitlines() if "| yes | 1024 |" in l)
        self.assertIn("| 100 | - | - |", causal)
        self.assertIn("new/base: min 1.100, median 1.100, max 1.100 over 1 shapes", text)
        self.assertNotIn("CUDNN", text)

    def test_no_rows(self):
        self.assertIn("no rows", self.table([ours("base", 1, 1.0, status="error: x")]))


if __name__ == "__main__":
    unittest.main()
