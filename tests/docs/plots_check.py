#!/usr/bin/python3
"""bench/plot.py on the committed raw files, so that the figures in docs/images cannot rot.

    plots_check.py REPO_ROOT

Runs bench/plot.py on docs/results/ into a temporary folder and checks that it draws exactly
the PNGs committed in docs/images/, each a PNG of the committed one's size, and that every
committed figure is shown by README.md or a page of docs/. Exits 77 (skipped) when matplotlib
is missing (plot.py's own exit code).
"""
import glob
import os
import struct
import subprocess
import sys
import tempfile


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", head[16:24])


def main():
    root = sys.argv[1]
    images = os.path.join(root, "docs", "images")
    with tempfile.TemporaryDirectory(prefix="plots_check-") as out:
        run = subprocess.run([sys.executable, os.path.join(root, "bench", "plot.py"),
                              "--results", os.path.join(root, "docs", "results"), "--out", out],
                             capture_output=True, text=True)
        print(run.stdout, end="")
        if run.returncode == 77:
            print(run.stderr, end="")
            return 77
        if run.returncode != 0:
            print(f"plots_check: FAIL: plot.py exited {run.returncode}\n{run.stderr}")
            return 1
        drawn = {os.path.basename(p): png_size(p) for p in glob.glob(os.path.join(out, "*.png"))}
    committed = {os.path.basename(p): png_size(p)
                 for p in glob.glob(os.path.join(images, "*.png"))}
    errors = []
    for name in sorted(set(drawn) | set(committed)):
        if name not in committed:
            errors.append(f"{name}: plot.py draws it, docs/images/ lacks it (run bench/plot.py)")
        elif name not in drawn:
            errors.append(f"{name}: in docs/images/, plot.py no longer draws it")
        elif drawn[name] is None or drawn[name] != committed[name]:
            errors.append(f"{name}: drawn {drawn[name]}, committed {committed[name]} (px)")
    pages = [os.path.join(root, "README.md")] + glob.glob(os.path.join(root, "docs", "*.md"))
    text = "".join(open(p).read() for p in pages)
    for name in sorted(committed):
        if f"images/{name}" not in text:
            errors.append(f"{name}: no page of README.md or docs/ shows it")
    for e in errors:
        print(f"plots_check: FAIL: {e}")
    if not errors:
        print(f"plots_check: ok: {len(drawn)} figures drawn from docs/results, as committed")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
