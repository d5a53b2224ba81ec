#!/usr/bin/env python3
"""Joins bench/sustained.sh's rows with its nvidia-smi log: per row the median SM clock and board
power over the row's timed window, the share of its samples under the software power cap, (timed_from + 0.5 s, for the queue ahead of the GPU and the
power reading's averaging, to timed_to), and the ratio of ours to cuDNN per shape."""
import argparse
import datetime
import json
import statistics


def read_smi(path):
    samples = []
    with open(path) as f:
        for line in f:
            fields = [x.strip() for x in line.split(",")]
            try:
                t = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((t, float(fields[1]), float(fields[2]), fields[4]))
            except (ValueError, IndexError):
                continue
    return samples


def window_stats(samples, row):
    lo, hi = row["timed_from"] + 0.5, row["timed_to"]
    inside = [s for s in samples if lo <= s[0] <= hi]
    if not inside:
        return None
    # Bit 2 (0x4) of the event reasons is the software power cap.
    capped = sum(1 for s in inside if int(s[3], 16) & 0x4) / len(inside)
    return (statistics.median(s[1] for s in inside), statistics.median(s[2] for s in inside),
            capped)


def read_rows(path):
    rows = {}
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("{"):
                    r = json.loads(line)
                    if r.get("status") == "ok":
                        key = (r.get("pass", "fwd"), r["dtype"], r["d"], bool(r["causal"]), r["N"])
                        rows[key] = r
    except OSError:
        pass
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="bench/sustained.sh's output folder")
    args = ap.parse_args()
    samples = read_smi(f"{args.dir}/smi.csv")
    ours, cudnn = read_rows(f"{args.dir}/ours.jsonl"), read_rows(f"{args.dir}/sdpa.jsonl")
    print("| pass | dtype | d | causal | N | ours TFLOP/s | MHz | W | cuDNN TFLOP/s | MHz | W "
          "| ours/cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(set(ours) | set(cudnn)):
        cells = []
        for rows in (ours, cudnn):
            r = rows.get(key)
            stats = window_stats(samples, r) if r and "timed_from" in r else None
            cells.append(f"{r['tflops']:.0f}" if r else "-")
            cells += ([f"{stats[0]:.0f}", f"{stats[1]:.0f} ({stats[2]:.0%} capped)"] if stats
                      else ["-", "-"])
        ratio = (f"{ours[key]['tflops'] / cudnn[key]['tflops']:.2f}"
                 if key in ours and key in cudnn else "-")
        p, dtype, d, causal, n = key
        print(f"| {p} | {dtype} | {d} | {'yes' if causal else 'no'} | {n} | "
              + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
