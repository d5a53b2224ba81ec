#!/usr/bin/env python3
"""The kernel_resources checker on made-up ptxas reports: it passes what is within budget and
fails each kind of problem it exists to catch."""

import contextlib
import io
import pathlib
import sys
import tempfile
import unittest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import kernel_resources  # noqa: E402

# Two real kernel names (mangled as nvcc emits them).
BACKWARD = "_ZN4attn4cuda23FusedBackwardSm90KernelINS0_23FusedBackwardSm90TraitsI13__nv_bfloat16Li128EEEEEvNS0_22FusedBackwardTmaParamsE"
PORTABLE = "_ZN4attn4cuda8backward14BackwardKernelI13__nv_bfloat16Li128ELb0EEEvNS0_19FusedBackwardParamsEPKfPfPilbb"


def report(name, arch, stack, stores, loads, registers=168):
    return (f"ptxas info    : Compiling entry function '{name}' for '{arch}'\n"
            f"ptxas info    : Function properties for {name}\n"
            f"    {stack} bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads\n"
            f"ptxas info    : Used {registers} registers, used 16 barriers\n")


BUDGET = """\
# arch stack stores loads pattern
sm_90a  0  0  0  attn::cuda::FusedBackwardSm90Kernel<
sm_90a 16 16 16  attn::cuda::backward::BackwardKernel<
"""


class CheckerTest(unittest.TestCase):
    def run_checker(self, reports, budget=BUDGET):
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            for i, text in enumerate(reports):
                (root / f"object{i}.cu.o.resources").write_text(text)
            (root / "budget.txt").write_text(budget)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = kernel_resources.main(["--build", tmp, "--budget", str(root / "budget.txt")])
            return rc, out.getvalue()

    def test_within_budget_passes(self):
        rc, out = self.run_checker(
            [report(BACKWARD, "sm_90a", 0, 0, 0) + report(PORTABLE, "sm_90a", 16, 16, 16)])
        self.assertEqual(rc, 0, out)
        self.assertIn("0 problems", out)

    def test_spill_over_budget_fails_naming_the_kernel(self):
        rc, out = self.run_checker(
            [report(BACKWARD, "sm_90a", 72, 204, 280) + report(PORTABLE, "sm_90a", 0, 0, 0)])
        self.assertEqual(rc, 1)
        self.assertIn("FusedBackwardSm90Kernel", out)
        self.assertIn("spill stores 204 > 0", out)

    def test_a_ptxas_warning_fails(self):
        warning = (f"ptxas warning : (C7512) Potential Performance Loss: wgmma.mma_async "
                   f"instructions are serialized due to insufficient register resources for the "
                   f"wgmma pipeline in the function '{BACKWARD}'\n")
        rc, out = self.run_checker(
            [report(BACKWARD, "sm_90a", 0, 0, 0) + warning + report(PORTABLE, "sm_90a", 0, 0, 0)])
        self.assertEqual(rc, 1)
        self.assertIn("C7512", out)

    def test_a_kernel_without_a_budget_line_fails(self):
        rc, out = self.run_checker(
            [report(BACKWARD, "sm_90a", 0, 0, 0) + report(PORTABLE, "sm_90a", 0, 0, 0) +
             report("_Z9NewKernelv", "sm_90a", 0, 0, 0)])
        self.assertEqual(rc, 1)
        self.assertIn("NewKernel(): no budget line", out)

    def test_a_stale_budget_line_fails_only_for_a_built_architecture(self):
        rc, out = self.run_checker([report(BACKWARD, "sm_90a", 0, 0, 0)])
        self.assertEqual(rc, 1)
        self.assertIn("matches no kernel", out)
        # sm_80 lines are not stale in a build without sm_80.
        rc, out = self.run_checker(
            [report(BACKWARD, "sm_90a", 0, 0, 0) + report(PORTABLE, "sm_90a", 0, 0, 0)],
            BUDGET + "sm_80 0 0 0 attn::cuda::Gone<\n")
        self.assertEqual(rc, 0, out)

    def test_an_architecture_without_budget_lines_is_not_checked(self):
        rc, out = self.run_checker(
            [report(BACKWARD, "sm_90a", 0, 0, 0) + report(PORTABLE, "sm_90a", 0, 0, 0) +
             report(PORTABLE, "sm_89", 64, 64, 64)])
        self.assertEqual(rc, 0, out)
        self.assertIn("not checked (no budget lines for): sm_89", out)

    def test_the_same_kernel_in_two_objects_counts_once(self):
        both = report(BACKWARD, "sm_90a", 0, 0, 0) + report(PORTABLE, "sm_90a", 0, 0, 0)
        rc, out = self.run_checker([both, both])
        self.assertEqual(rc, 0, out)
        self.assertIn("2 kernels in 2 objects", out)

    def test_no_reports_fails(self):
        rc, out = self.run_checker([])
        self.assertEqual(rc, 1)
        self.assertIn("no *.resources", out)

    def test_a_malformed_budget_line_is_named(self):
        with self.assertRaises(SystemExit) as raised:
            self.run_checker([report(BACKWARD, "sm_90a", 0, 0, 0)], "sm_90a zero 0 0 x\n")
        self.assertIn("budget.txt:1", str(raised.exception))


if __name__ == "__main__":
    unittest.main()
