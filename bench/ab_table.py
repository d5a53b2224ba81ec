#!/usr/bin/env python3
"""The table of an A/B run (bench/ab_builds.sh): per shape, the best of each build's rounds in
TFLOP/s, each build against the first (the reference), and each against the anchor backends
(bench/sdpa_anchor.py's rows of the same call) where given; then, per build, the ratios' minimum,
median and maximum, and how far its own rounds spread (the noise that bounds a ratio)."""
import argparse
import json
import statistics
import sys


def shape_of(row):
    return (row["pass"], row["dtype"], int(row["d"]), bool(row["causal"]), int(row["N"]))


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"ab_table: {path}:{number}: not JSON ({e})")
    return rows


def collect(ab_rows):
    """{build: {shape: [tflops of each round]}} in the order the builds first appear."""
    runs = {}
    for row in ab_rows:
        if row.get("status") != "ok" or "build" not in row:
            continue
        runs.setdefault(row["build"], {}).setdefault(shape_of(row), []).append(row["tflops"])
    return runs


def anchors_of(anchor_rows):
    """{backend: {shape: tflops}}."""
    out = {}
    for row in anchor_rows:
        if row.get("status") == "ok" and "tflops" in row:
            out.setdefault(row["backend"], {})[shape_of(row)] = row["tflops"]
    return out


def spread(values):
    return max(values) / min(values) - 1 if len(values) > 1 and min(values) > 0 else 0.0


def render(runs, anchors):
    if not runs:
        return "ab_table: no rows with a build and status ok\n"
    builds = list(runs)
    reference = builds[0]
    backends = sorted(anchors)
    lines = []
    head = ["pass", "dtype", "d", "causal", "N"] + [f"{b} TF/s" for b in builds]
    head += [f"{b}/{reference}" for b in builds[1:]]
    head += [f"{be} TF/s" for be in backends]
    head += [f"{b}/{be}" for be in backends for b in builds]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    ratios = {b: [] for b in builds[1:]}
    versus = {(b, be): [] for be in backends for b in builds}
    for shape in sorted(runs[reference]):
        best = {b: max(runs[b][shape]) for b in builds if shape in runs[b]}
        cells = [shape[0], shape[1], str(shape[2]), "yes" if shape[3] else "no", str(shape[4])]
        cells += [f"{best[b]:.0f}" if b in best else "-" for b in builds]
        for b in builds[1:]:
            if b in best:
                ratios[b].append(best[b] / best[reference])
                cells.append(f"{best[b] / best[reference]:.3f}")
            else:
                cells.append("-")
        cells += [f"{anchors[be][shape]:.0f}" if shape in anchors[be] else "-" for be in backends]
        for be in backends:
            for b in builds:
                if b in best and shape in anchors[be]:
                    versus[(b, be)].append(best[b] / anchors[be][shape])
                    cells.append(f"{best[b] / anchors[be][shape]:.2f}")
                else:
                    cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")

    def summary(values):
        return (f"min {min(values):.3f}, median {statistics.median(values):.3f}, "
                f"max {max(values):.3f} over {len(values)} shapes")

    for b in builds[1:]:
        if ratios[b]:
            lines.append(f"{b}/{reference}: {summary(ratios[b])}")
    for (b, be), values in versus.items():
        if values:
            lines.append(f"{b}/{be}: {summary(values)}")
    for b in builds:
        spreads = [spread(v) for v in runs[b].values()]
        rounds = max(len(v) for v in runs[b].values())
        lines.append(f"{b}: {rounds} round(s), rounds differ by up to {100 * max(spreads):.1f}%")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("ab", help="attn_kernel_bench rows tagged with build and round")
    parser.add_argument("--anchor", action="append", default=[],
                        help="sdpa_anchor.py --out rows of the same call (repeatable)")
    args = parser.parse_args(argv)
    anchor_rows = []
    for path in args.anchor:
        anchor_rows += read_jsonl(path)
    sys.stdout.write(render(collect(read_jsonl(args.ab)), anchors_of(anchor_rows)))


if __name__ == "__main__":
    main()
