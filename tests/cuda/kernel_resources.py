#!/usr/bin/env python3
"""Checks what ptxas gave each CUDA kernel against the budget in kernel_resources.txt.

The build keeps ptxas's report of every object of attn_cuda in `<object>.resources`
(kernels/cuda/record_resources.sh, nvcc --resource-usage). This reads them all and fails when
  - a kernel spills or uses more stack than its budget line allows,
  - a kernel has no budget line (a new kernel gets one on purpose; architectures the table
    has no line for are listed, not checked),
  - a budget line of a built architecture matches no kernel (a stale line),
  - ptxas warned at all (for instance C7512: wgmma serialised for want of registers, which
    costs the Hopper kernels their overlap without any other sign).
A register regression in the hand-tuned kernels then fails CI, which has no GPU.

  kernel_resources.py --budget tests/cuda/kernel_resources.txt --build build
  kernel_resources.py --build build --print-budget    # a budget table of what the build has
"""

import argparse
import pathlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

COMPILING = re.compile(r"Compiling entry function '(\S+)' for '(sm_\w+)'")
PROPERTIES = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")
WARNING = re.compile(r"ptxas\s+warning", re.IGNORECASE)


@dataclass
class Kernel:
    arch: str
    mangled: str
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    registers: int = 0
    source: str = ""
    name: str = ""  # demangled


@dataclass
class Budget:
    arch: str
    stack: int
    spill_stores: int
    spill_loads: int
    pattern: re.Pattern
    line: int
    text: str
    used: bool = False


def parse_reports(paths):
    """Kernels (one per architecture and name) and ptxas warnings of the .resources files."""
    kernels, warnings = {}, []
    for path in paths:
        current = None
        for line in pathlib.Path(path).read_text(errors="replace").splitlines():
            if m := COMPILING.search(line):
                arch, mangled = m.group(2), m.group(1)
                current = kernels.setdefault((arch, mangled),
                                             Kernel(arch, mangled, source=str(path)))
            elif current and (m := PROPERTIES.search(line)):
                current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
            elif current and (m := REGISTERS.search(line)):
                current.registers = int(m.group(1))
            if WARNING.search(line):
                warnings.append(f"{path}: {line.strip()}")
    return list(kernels.values()), warnings


def demangle(kernels):
    names = [k.mangled for k in kernels]
    tool = shutil.which("c++filt")
    if tool and names:
        out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.splitlines()
        if len(out) == len(names):
            names = out
    for k, name in zip(kernels, names):
        k.name = name.removeprefix("void ")  # every kernel returns void


def parse_budget(path):
    budgets = []
    for number, raw in enumerate(pathlib.Path(path).read_text().splitlines(), start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        fields = text.split(None, 4)
        if len(fields) != 5 or not all(f.isdigit() for f in fields[1:4]):
            raise SystemExit(f"{path}:{number}: expected 'arch stack spill-stores spill-loads "
                             f"kernel-pattern', got: {raw.strip()}")
        budgets.append(Budget(fields[0], int(fields[1]), int(fields[2]), int(fields[3]),
                              re.compile(fields[4]), number, fields[4]))
    return budgets


def check(kernels, warnings, budgets):
    """The problems found, one line each (empty: all within budget)."""
    problems = [f"ptxas warned: {w}" for w in warnings]
    budgeted = {b.arch for b in budgets}
    for k in sorted(kernels, key=lambda k: (k.arch, k.name)):
        if k.arch not in budgeted:
            continue  # an architecture the table does not cover (main() says which)
        budget = next((b for b in budgets if b.arch == k.arch and b.pattern.match(k.name)), None)
        if budget is None:
            problems.append(f"{k.arch} {k.name}: no budget line (stack {k.stack}, spills "
                            f"{k.spill_stores}/{k.spill_loads} bytes); add one")
            continue
        budget.used = True
        over = [f"{what} {have} > {allowed}" for what, have, allowed in (
            ("stack", k.stack, budget.stack),
            ("spill stores", k.spill_stores, budget.spill_stores),
            ("spill loads", k.spill_loads, budget.spill_loads)) if have > allowed]
        if over:
            problems.append(f"{k.arch} {k.name}: {', '.join(over)} bytes (budget line "
                            f"{budget.line}: {budget.text})")
    built = {k.arch for k in kernels}
    for b in budgets:
        if b.arch in built and not b.used:
            problems.append(f"budget line {b.line} ({b.arch} {b.text}) matches no kernel")
    return problems


def print_table(kernels):
    print(f"{'arch':7s} {'regs':>4s} {'stack':>5s} {'spills':>9s}  kernel")
    for k in sorted(kernels, key=lambda k: (k.arch, k.name)):
        spills = f"{k.spill_stores}/{k.spill_loads}"
        print(f"{k.arch:7s} {k.registers:4d} {k.stack:5d} {spills:>9s}  {k.name[:150]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--build", required=True, help="build directory to search for *.resources")
    parser.add_argument("--budget", help="the budget table (kernel_resources.txt)")
    parser.add_argument("--print-budget", action="store_true",
                        help="print one budget line per kernel of the build, then exit")
    args = parser.parse_args(argv)

    reports = sorted(pathlib.Path(args.build).rglob("*.resources"))
    if not reports:
        print(f"kernel_resources: no *.resources under {args.build}: attn_cuda is built with "
              "kernels/cuda/record_resources.sh as its CUDA launcher (kernels/cuda/CMakeLists.txt)")
        return 1
    kernels, warnings = parse_reports(reports)
    demangle(kernels)
    if args.print_budget:
        for k in sorted(kernels, key=lambda k: (k.arch, k.name)):
            print(f"{k.arch:7s} {k.stack:3d} {k.spill_stores:3d} {k.spill_loads:3d}  "
                  f"{re.escape(k.name)}")
        return 0
    if not args.budget:
        parser.error("--budget is required unless --print-budget")
    print_table(kernels)
    budgets = parse_budget(args.budget)
    problems = check(kernels, warnings, budgets)
    print(f"\n{len(kernels)} kernels in {len(reports)} objects, {len(problems)} problems")
    unchecked = sorted({k.arch for k in kernels} - {b.arch for b in budgets})
    if unchecked:
        print(f"  not checked (no budget lines for): {', '.join(unchecked)}")
    for p in problems:
        print(f"  {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
