#!/usr/bin/python3
"""Draws the published benchmark figures from the raw JSON lines in docs/results/.

    bench/plot.py [--results docs/results] [--out docs/images]

One PNG per figure, in the manner of the FlashAttention papers' figures, from the raw files
behind the tables of docs/performance.md and docs/server-performance.md (RAW below names
them; a new run's files replace those names):

  forward-tflops-<dtype>.png   forward TFLOP/s vs sequence length, one panel per (head dim,
                               mask): fused, naive, PyTorch FLASH / cuDNN / MATH
  backward-tflops-<dtype>.png  the same for the backward pass
  memory.png                   device memory each engine allocates beyond its inputs
                               (attn_kernel_bench's workspace_bytes) vs sequence length; the
                               files hold no peak-memory measurement, and the figure says so
  io-bytes.png                 device-memory bytes the forward must move by the IO model
                               (server/metrics.cc: FusedIoBytes, NaiveIoBytes), and those bytes
                               over the measured times
  serving-throughput.png       requests/s vs requests in flight (bench/server/server_bench.sh)

Nothing is measured or invented here: every plotted value is a field of a raw file or, for
io-bytes.png, the IO model's formula applied to a raw row's shape. Needs Debian's
python3-matplotlib (deploy/install-deps.sh); exits 77 when matplotlib is missing (the CTest
docs_plots then counts as skipped).
"""
import argparse
import json
import os
import statistics
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("plot.py: matplotlib is missing (apt install python3-matplotlib)")
    sys.exit(77)

# The raw files behind the published tables, by what they hold.
RAW = {
    "forward": "2026-12-03-h200-forward-attn_kernel_bench.jsonl",
    "forward_sdpa": "2026-12-03-h200-forward-sdpa.jsonl",
    "backward": "2026-12-04-h200-backward-attn_kernel_bench.jsonl",
    "backward_sdpa": "2026-12-04-h200-backward-sdpa.jsonl",
    "server_small_shm_stream": "2026-11-30-h200-server-small-shm-stream.jsonl",
    "server_small_inline_unary": "2026-11-30-h200-server-small-inline-unary.jsonl",
    "server_large_shm": "2026-11-30-h200-server-large-shm.jsonl",
    "server_large_inline": "2026-11-30-h200-server-large-inline.jsonl",
    "server_cpu": "2026-11-30-cpu-server-small-shm-stream.jsonl",
}
GPU = "one NVIDIA H200"

# Line style per engine: ours solid, PyTorch's dashed.
ENGINES = [  # (key, label, color, hatch)
    ("fused", "attnserve fused", "#1f4e9c", ""),
    ("naive", "attnserve naive", "#8fb3e8", ""),
    ("FLASH", "PyTorch FLASH (FlashAttention-2)", "#d9480f", "//"),
    ("CUDNN", "PyTorch cuDNN", "#f08c00", "//"),
    ("MATH", "PyTorch MATH", "#adb5bd", "//"),
]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def kernel_rows(results, name, sdpa_name):
    """{(engine, dtype, d, causal, N): row} of our engines and PyTorch's, status ok only."""
    rows = {}
    for r in read_jsonl(os.path.join(results, RAW[name])):
        if r["status"] == "ok":
            rows[(r["engine"], r["dtype"], r["d"], r["causal"], r["N"])] = r
    for r in read_jsonl(os.path.join(results, RAW[sdpa_name])):
        if r["status"] == "ok":
            rows[(r["backend"], r["dtype"], r["d"], r["causal"], r["N"])] = r
    return rows


def length_label(n):
    return f"{n // 1024}k" if n >= 1024 else str(n)


def log2_axis(ax, values, label=str):
    """A log2 x axis ticked at the measured values only."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values)
    ax.set_xticklabels([label(v) for v in values])
    ax.minorticks_off()


def grouped_bars(ax, lengths, series, label_values):
    """Bars per sequence length, one per series [(label, color, hatch, values)]."""
    width = 0.8 / len(series)
    for i, (label, color, hatch, values) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(lengths))]
        present = [(x, v) for x, v in zip(xs, values) if v is not None]
        if not present:
            continue
        bars = ax.bar([x for x, _ in present], [v for _, v in present], width, label=label,
                      color=color, hatch=hatch, edgecolor="white", linewidth=0.3)
        if label_values:
            ax.bar_label(bars, labels=[f"{v:.0f}" for _, v in present], fontsize=5, padding=1,
                         rotation=90)
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([length_label(n) for n in lengths])


def plot_tflops(results, out, pass_name):
    rows = kernel_rows(results, pass_name, pass_name + "_sdpa")
    figures = []
    for dtype in sorted({k[1] for k in rows}):
        dims = sorted({k[2] for k in rows if k[1] == dtype})
        lengths = sorted({k[4] for k in rows if k[1] == dtype})
        fig, axes = plt.subplots(len(dims), 2, figsize=(11, 3.3 * len(dims)), squeeze=False,
                                 sharey=True)
        for row, d in enumerate(dims):
            for col, causal in enumerate((False, True)):
                ax = axes[row][col]
                series = []
                for key, label, color, hatch in ENGINES:
                    values = [rows.get((key, dtype, d, causal, n), {}).get("tflops")
                              for n in lengths]
                    series.append((label, color, hatch, values))
                grouped_bars(ax, lengths, series, label_values=True)
                ax.set_title(f"head dim {d}, {'causal' if causal else 'no mask'}", fontsize=10)
                ax.grid(axis="y", alpha=0.3)
                ax.set_axisbelow(True)
                if col == 0:
                    ax.set_ylabel("TFLOP/s")
                if row == len(dims) - 1:
                    ax.set_xlabel("sequence length N (batch = 16k / N, heads = 2048 / d)")
        top = max(r["tflops"] for k, r in rows.items() if k[1] == dtype)
        axes[0][0].set_ylim(0, top * 1.12)  # room for the labels over the tallest bar
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8,
                   frameon=False)
        what = "Forward" if pass_name == "forward" else "Backward (dQ, dK, dV; 2.5x the forward's FLOPs)"
        fig.suptitle(f"{what}, {dtype}, {GPU}: attnserve's kernels and PyTorch SDPA "
                     f"(MATH stops at N = 4096)", fontsize=11)
        fig.tight_layout(rect=(0, 0.05, 1, 0.97))
        path = os.path.join(out, f"{pass_name}-tflops-{dtype}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        figures.append(path)
    return figures


def plot_memory(results, out):
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, pass_name in zip(axes, ("forward", "backward")):
        rows = [r for r in read_jsonl(os.path.join(results, RAW[pass_name]))
                if r["status"] == "ok" and r["dtype"] == "bf16" and not r["causal"]]
        for engine, color in (("fused", "#1f4e9c"), ("naive", "#8fb3e8")):
            for d, marker in ((64, "o"), (128, "s")):
                pts = sorted((r["N"], r["workspace_bytes"] / 2**20) for r in rows
                             if r["engine"] == engine and r["d"] == d)
                if pts:
                    ax.plot([n for n, _ in pts], [m for _, m in pts], marker=marker,
                            color=color, label=f"{engine}, head dim {d}")
        log2_axis(ax, sorted({r["N"] for r in rows}), length_label)
        ax.set_title(f"{pass_name}, bf16, no mask", fontsize=10)
        ax.set_xlabel("sequence length N (batch = 16k / N: 16k tokens at every N)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MiB allocated beyond Q, K, V, O")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"Device memory the engine allocates beyond its inputs and outputs (workspace_bytes), "
        f"{GPU}.\nPeak device memory was not recorded. Q, K, V, O are 4 x 64 MiB at every N of "
        f"this grid; the naive path works through the heads in chunks of its 8 GiB workspace "
        f"limit.", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    path = os.path.join(out, "memory.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def io_bytes(r, naive):
    """server/metrics.cc's IO model for an attn_kernel_bench row (dense self-attention, no LSE)."""
    es = 4 if r["dtype"] == "fp32" else 2
    q_rows = r["batch"] * r["N"] * r["heads"] * r["d"]  # Q read, O written; K and V the same
    fused = 4 * q_rows * es
    if not naive:
        return fused
    return fused + r["heads"] * r["batch"] * r["N"] * r["N"] * (2 * 4 + 2 * es)


def plot_io(results, out):
    rows = [r for r in read_jsonl(os.path.join(results, RAW["forward"]))
            if r["status"] == "ok" and r["dtype"] == "bf16" and not r["causal"] and r["d"] == 64]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for engine, color in (("fused", "#1f4e9c"), ("naive", "#8fb3e8")):
        pts = sorted((r["N"], io_bytes(r, engine == "naive"), r["ms"]) for r in rows
                     if r["engine"] == engine)
        axes[0].plot([n for n, _, _ in pts], [b / 1e9 for _, b, _ in pts], marker="o",
                     color=color, label=f"{engine}")
        axes[1].plot([n for n, _, _ in pts], [b / (ms * 1e-3) / 1e12 for _, b, ms in pts],
                     marker="o", color=color, label=f"{engine}")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("GB moved per call (IO model)")
    axes[0].set_title("fused: Q, K, V read, O written;  naive: + S (fp32) and P (bf16),\n"
                      "each written once and read once", fontsize=9)
    axes[1].set_ylabel("TB/s = IO-model bytes / measured time")
    axes[1].set_title("the same bytes over the measured kernel time\n"
                      "(the naive path is bound by them; the fused one is not)", fontsize=9)
    for ax in axes:
        log2_axis(ax, sorted({r["N"] for r in rows}), length_label)
        ax.set_xlabel("sequence length N (batch = 16k / N, 32 heads, d = 64)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Device-memory traffic of the forward, bf16, no mask, {GPU}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    path = os.path.join(out, "io-bytes.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def print_io_table(results):
    """io-bytes.png's numbers, every head dim: what docs/algorithm.md quotes."""
    rows = [r for r in read_jsonl(os.path.join(results, RAW["forward"]))
            if r["status"] == "ok" and r["dtype"] == "bf16" and not r["causal"]]
    print("| d | N | fused GB | fused ms | fused TB/s | naive GB | naive ms | naive TB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for d in sorted({r["d"] for r in rows}):
        for n in sorted({r["N"] for r in rows}):
            cells = []
            for engine in ("fused", "naive"):
                r = next(r for r in rows if r["d"] == d and r["N"] == n and r["engine"] == engine)
                b = io_bytes(r, engine == "naive")
                cells += [f"{b / 1e9:.2f}", f"{r['ms']:.2f}", f"{b / (r['ms'] * 1e-3) / 1e12:.2f}"]
            print(f"| {d} | {n} | " + " | ".join(cells) + " |")


def levels(rows, **match):
    """{batching: [(level, [req/s of each round])]} of the rows matching every field."""
    by = {}
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            by.setdefault(r["batching"], {}).setdefault(r["level"], []).append(
                r["requests_per_s"])
    return {b: sorted(v.items()) for b, v in by.items()}


def plot_series(ax, series, label, color):
    for batching, style in (("on", "-"), ("off", ":")):
        pts = series.get(batching, [])
        if not pts:
            continue
        xs = [level for level, _ in pts]
        ax.plot(xs, [statistics.median(v) for _, v in pts], style, marker="o", color=color,
                label=f"{label}, batching {batching}")
        for level, values in pts:  # every round
            ax.scatter([level] * len(values), values, s=8, color=color, alpha=0.5)


def final_rows(rows):
    """Rows of the code the tables publish ('final-N' turns; files without turns are all)."""
    return [r for r in rows if "prev" not in r.get("turn", "")]


def plot_serving(results, out):
    load = lambda name: final_rows(read_jsonl(os.path.join(results, RAW[name])))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    ax = axes[0]
    plot_series(ax, levels(load("server_small_shm_stream")), "shm, unix, AttendStream",
                "#1f4e9c")
    small = load("server_small_inline_unary")
    plot_series(ax, levels(small, rpc="stream"), "inline, TCP, AttendStream", "#d9480f")
    plot_series(ax, levels(small, rpc="unary"), "shm, unix, unary", "#2b8a3e")
    ax.set_title(f"small requests (N = 64, 8 heads, d = 64, fp16), {GPU}", fontsize=9)
    ax = axes[1]
    plot_series(ax, levels(load("server_large_shm"), rpc="stream"), "shm, TCP, AttendStream",
                "#1f4e9c")
    plot_series(ax, levels(load("server_large_inline"), rpc="stream"),
                "inline, TCP, AttendStream", "#d9480f")
    ax.set_title(f"large requests (N = 4096, 32 heads, d = 128, bf16), {GPU}", fontsize=9)
    ax = axes[2]
    plot_series(ax, levels(load("server_cpu")), "shm, unix, AttendStream", "#1f4e9c")
    ax.set_title("small requests, 2-core build machine (CPU engine)", fontsize=9)
    for ax in axes:
        in_flight = sorted({int(x) for line in ax.get_lines() for x in line.get_xdata()})
        log2_axis(ax, in_flight)
        ax.set_yscale("log")
        ax.set_xlabel("requests in flight (closed loop)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("requests/s (line: median of rounds; dots: each round)")
    fig.suptitle("attnserve end to end: throughput vs concurrency (bench/server/server_bench.sh)",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    path = os.path.join(out, "serving-throughput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=os.path.join(root, "docs", "results"))
    parser.add_argument("--out", default=os.path.join(root, "docs", "images"))
    parser.add_argument("--io-table", action="store_true",
                        help="print io-bytes.png's numbers as a markdown table instead")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.io_table:
        print_io_table(args.results)
        return
    plt.rcParams.update({"font.size": 9})
    written = []
    written += plot_tflops(args.results, args.out, "forward")
    written += plot_tflops(args.results, args.out, "backward")
    written += plot_memory(args.results, args.out)
    written += plot_io(args.results, args.out)
    written += plot_serving(args.results, args.out)
    for path in written:
        print(f"plot.py: wrote {path}")


if __name__ == "__main__":
    main()
