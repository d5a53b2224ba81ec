#!/usr/bin/env python3
"""PyTorch SDPA anchors next to attn_kernel_bench, on the same GPU in the same run.

Measures torch.nn.functional.scaled_dot_product_attention with each backend forced through
torch.nn.attention.sdpa_kernel (FLASH, cuDNN, EFFICIENT, MATH) on the anchor grid of
shared/anchors/README.md: 16k tokens per batch (batch = 16384 / N), heads = 2048 / d, inputs
from randn, the median of triton.testing.do_bench (25 ms warm-up, 100 ms of repeats),
FLOPs = 4 * batch * heads * N^2 * d, halved when causal.

Our engines take packed [batch * N, heads, d] tensors; SDPA takes [batch, heads, N, d]. The
inputs are allocated in our layout and handed to SDPA as transposed views: the same math on
the same memory.

Reads the JSON lines of `attn_kernel_bench --json` (--ours FILE) and prints the ratio table:
fused / FLASH, fused / cuDNN, naive / MATH. Writes the anchor rows as JSON lines (--out FILE).

--pass bwd times the backward alone (torch.autograd.grad of one forward's output, kept with
retain_graph) against `attn_kernel_bench --pass=bwd`; FLOPs are 2.5x the forward's.

--pass decode times decode steps against `attn_decode_bench --json` (--ours FILE): `batch`
sequences of one query token over `context` cached keys, 32 query / 8 KV heads, d 128, SDPA
with dense K/V [batch, kv_heads, context, d] and enable_gqa=True (every backend that runs it;
is_causal stays False, since one query row at the end of its keys sees them all and SDPA's
causal mask is top-left aligned). It reports KV bytes read per second (batch * context *
kv_heads * d * 2 * element size) and their fraction of the device-to-device copy bandwidth it
measures itself (bytes read plus written), the same JSON fields as attn_decode_bench.
"""
import argparse
import json
import math
import sys

BACKENDS = ("FLASH", "CUDNN", "EFFICIENT", "MATH")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", help="JSON lines from attn_kernel_bench --json")
    ap.add_argument("--out", help="write the anchor measurements here as JSON lines")
    ap.add_argument("--dtype", help="default bf16,fp16 (decode: bf16)")
    ap.add_argument("--d", help="default 64,128 (decode: 128)")
    ap.add_argument("--n", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--backends", default="FLASH,CUDNN,MATH",
                    help="comma list of " + ",".join(BACKENDS))
    ap.add_argument("--math-max-n", type=int, default=4096,
                    help="skip MATH above this N (it materialises batch*heads*N^2 scores)")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--sustained-s", type=float, default=0,
                    help="fwd/bwd: instead of do_bench, run calls back to back for 1.5 s, then "
                         "time each call of this many seconds more (CUDA events, "
                         "no cache flush between calls, as attn_kernel_bench with a long "
                         "--min_ms): the clocks a power-capped GPU holds under sustained load")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--head-width", type=int, default=2048)
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "decode"), default="fwd")
    ap.add_argument("--batch", default="1,4,16,64,256", help="decode: sessions per step")
    ap.add_argument("--context", default="1024,2048,4096,8192,16384,32768",
                    help="decode: cached keys per session")
    ap.add_argument("--heads", type=int, default=32, help="decode: query heads")
    ap.add_argument("--kv-heads", type=int, default=8, help="decode: KV heads")
    ap.add_argument("--math-max-bytes", type=float, default=16e9,
                    help="decode: skip MATH when its expanded K/V would exceed this")
    args = ap.parse_args()
    decode = args.pass_ == "decode"
    args.dtype = args.dtype or ("bf16" if decode else "bf16,fp16")
    args.d = args.d or ("128" if decode else "64,128")
    if decode and args.backends == "FLASH,CUDNN,MATH":
        args.backends = ",".join(BACKENDS)
    return args


def ints(s):
    return [int(x) for x in s.split(",") if x]


def load_ours(path, pass_):
    rows = {}
    if not path:
        return rows
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("bench") != "attn_kernel_bench" or r.get("pass", "fwd") != pass_:
                continue
            key = (r["dtype"], r["d"], bool(r["causal"]), r["N"])
            rows.setdefault(key, {})[r["engine"]] = r
    return rows


def measure(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    backend_enum = {
        "FLASH": SDPBackend.FLASH_ATTENTION,
        "CUDNN": SDPBackend.CUDNN_ATTENTION,
        "EFFICIENT": SDPBackend.EFFICIENT_ATTENTION,
        "MATH": SDPBackend.MATH,
    }
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    backends = [b.strip().upper() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in backend_enum:
            sys.exit(f"sdpa_anchor: unknown backend {b} (expected {','.join(BACKENDS)})")
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}", flush=True)
    results = {}
    for dname in [x for x in args.dtype.split(",") if x]:
        dtype = dtypes[dname]
        for d in ints(args.d):
            heads = args.head_width // d
            for causal in [bool(c) for c in ints(args.causal)]:
                for n in ints(args.n):
                    batch = args.tokens // n
                    backward = args.pass_ == "bwd"
                    flops = 4.0 * batch * heads * n * n * d * (0.5 if causal else 1.0)
                    flops *= 2.5 if backward else 1.0
                    # Our packed layout [batch * N, heads, d], seen as [batch, heads, N, d].
                    q, k, v = (torch.randn(batch * n, heads, d, device="cuda", dtype=dtype,
                                           requires_grad=backward)
                               .view(batch, n, heads, d).transpose(1, 2) for _ in range(3))
                    for b in backends:
                        key = (dname, d, causal, n)
                        row = {"bench": "sdpa_anchor", "backend": b, "dtype": dname, "d": d,
                               "causal": causal, "N": n, "batch": batch, "heads": heads}
                        if b == "MATH" and n > args.math_max_n:
                            row["status"] = f"skipped (N > --math-max-n {args.math_max_n})"
                        else:
                            try:
                                with sdpa_kernel([backend_enum[b]]):
                                    if backward:
                                        out = F.scaled_dot_product_attention(
                                            q, k, v, is_causal=causal)
                                        d_o = torch.randn_like(out)
                                        fn = lambda: torch.autograd.grad(
                                            out, (q, k, v), d_o, retain_graph=True)
                                    else:
                                        fn = lambda: F.scaled_dot_product_attention(
                                            q, k, v, is_causal=causal)
                                    fn()
                                    torch.cuda.synchronize()
                                    if args.sustained_s > 0:
                                        ms, window = sustained_ms(fn, args.sustained_s)
                                        row.update(mode="sustained", timed_from=window[0],
                                                   timed_to=window[1])
                                    else:
                                        ms = do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms,
                                                      return_mode="median")
                                row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, status="ok")
                            except (RuntimeError, torch.OutOfMemoryError) as e:
                                row["status"] = f"error: {str(e).splitlines()[0][:120]}"
                            out = d_o = None
                            torch.cuda.empty_cache()
                        row["pass"] = args.pass_
                        results.setdefault(key, {})[b] = row
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps(row) + "\n")
                    del q, k, v
                    torch.cuda.empty_cache()
    return results


def sustained_ms(fn, seconds):
    """The median ms of fn over `seconds` of back-to-back calls after 1.5 s of them (long enough
    for a power-capped GPU to settle its clock), and the wall-clock window (Unix seconds) of the
    timed calls."""
    import statistics
    import time

    import torch
    end = time.time() + 1.5
    while time.time() < end:
        fn()
    torch.cuda.synchronize()
    pairs = []
    start = time.time()
    while time.time() < start + seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    stop = time.time()
    ms = statistics.median(a.elapsed_time(b) for a, b in pairs)
    return ms, (round(start, 3), round(stop, 3))


def load_ours_decode(path):
    rows, copy = {}, None
    if not path:
        return rows, copy
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("bench") != "attn_decode_bench":
                continue
            if r.get("pass") == "copy":
                copy = r["copy_tbps"]
            elif r.get("pass") == "decode":
                rows.setdefault((r["dtype"], r["d"], r["batch"], r["context"]), r)
    return rows, copy


def measure_decode(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    backend_enum = {
        "FLASH": SDPBackend.FLASH_ATTENTION,
        "CUDNN": SDPBackend.CUDNN_ATTENTION,
        "EFFICIENT": SDPBackend.EFFICIENT_ATTENTION,
        "MATH": SDPBackend.MATH,
    }
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    backends = [b.strip().upper() for b in args.backends.split(",") if b.strip()]
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}", flush=True)
    # Device-to-device copy, bytes read plus written per second.
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=args.warmup_ms, rep=args.rep_ms,
                       return_mode="median")
    copy_tbps = 2 * src.numel() / (copy_ms * 1e-3) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    copy_row = {"bench": "sdpa_anchor", "pass": "copy", "copy_bytes": 2 << 30,
                "copy_tbps": copy_tbps}
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(copy_row) + "\n")
    print(f"# copy {copy_tbps:.3f} TB/s (read + written)", flush=True)
    results = {}
    heads, kv_heads = args.heads, args.kv_heads
    for dname in [x for x in args.dtype.split(",") if x]:
        dtype = dtypes[dname]
        esize = torch.tensor([], dtype=dtype).element_size()
        for d in ints(args.d):
            for batch in ints(args.batch):
                for context in ints(args.context):
                    kv_bytes = 2.0 * batch * context * kv_heads * d * esize
                    key = (dname, d, batch, context)
                    try:
                        q = torch.randn(batch, heads, 1, d, device="cuda", dtype=dtype)
                        k = torch.randn(batch, kv_heads, context, d, device="cuda", dtype=dtype)
                        v = torch.randn(batch, kv_heads, context, d, device="cuda", dtype=dtype)
                    except torch.OutOfMemoryError as e:
                        q = k = v = None
                        torch.cuda.empty_cache()
                        alloc_error = f"error: {str(e).splitlines()[0][:120]}"
                    else:
                        alloc_error = None
                    for b in backends:
                        row = {"bench": "sdpa_anchor", "pass": "decode", "backend": b,
                               "dtype": dname, "d": d, "heads": heads, "kv_heads": kv_heads,
                               "batch": batch, "context": context, "q_tokens": 1,
                               "kv_bytes": kv_bytes, "copy_tbps": copy_tbps}
                        if alloc_error:
                            row["status"] = alloc_error
                        elif b == "MATH" and kv_bytes * heads / kv_heads > args.math_max_bytes:
                            row["status"] = "skipped (expanded K/V > --math-max-bytes)"
                        else:
                            try:
                                with sdpa_kernel([backend_enum[b]]):
                                    fn = lambda: F.scaled_dot_product_attention(
                                        q, k, v, enable_gqa=True)
                                    fn()
                                    torch.cuda.synchronize()
                                    ms = do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms,
                                                  return_mode="median")
                                tbps = kv_bytes / (ms * 1e-3) / 1e12
                                row.update(ms=ms, tbps=tbps, fraction=tbps / copy_tbps,
                                           status="ok")
                            except (RuntimeError, torch.OutOfMemoryError) as e:
                                row["status"] = f"error: {str(e).splitlines()[0][:120]}"
                            torch.cuda.empty_cache()
                        results.setdefault(key, {})[b] = row
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps(row) + "\n")
                    del q, k, v
                    torch.cuda.empty_cache()
    return results, copy_tbps


def main_decode(args):
    ours, ours_copy = load_ours_decode(args.ours)
    anchors, copy_tbps = measure_decode(args)
    backends = [b.strip().upper() for b in args.backends.split(",") if b.strip()]
    keys = sorted(set(anchors) | set(ours))
    print()
    print("decode: KV bytes read per second, TB/s (fraction of copy bandwidth), same GPU, "
          "same run")
    copies = f"copy {copy_tbps:.2f} TB/s (anchor)"
    if ours_copy:
        copies += f", {ours_copy:.2f} TB/s (attn_decode_bench)"
    print("# " + copies)
    header = ("dtype", "d", "batch", "context", "splits", "ours") + tuple(backends) + (
        "ours/best",)
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key in keys:
        o = ours.get(key)
        a = anchors.get(key, {})
        ours_tb = o["tbps"] if o and o.get("status") == "ok" else None
        cells = [key[0], str(key[1]), str(key[2]), str(key[3]),
                 str(o["splits"]) if o else "—",
                 f"{ours_tb:.2f} ({o['fraction']:.2f})" if ours_tb else "—"]
        best = None
        for b in backends:
            r = a.get(b)
            if r and r.get("status") == "ok":
                cells.append(f"{r['tbps']:.2f} ({r['fraction']:.2f})")
                best = r["tbps"] if best is None else max(best, r["tbps"])
            else:
                cells.append("—")
        cells.append(fmt(ratio(ours_tb, best), 2))
        print("| " + " | ".join(cells) + " |")
    for key, r in sorted(ours.items()):
        if r.get("status") != "ok":
            print(f"note: ours {key}: {r['status']}")


def tf(row):
    if not row or row.get("status") != "ok":
        return None
    return row["tflops"]


def fmt(x, digits=0):
    return "—" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def main():
    args = parse_args()
    if args.pass_ == "decode":
        main_decode(args)
        return
    ours = load_ours(args.ours, args.pass_)
    anchors = measure(args)
    keys = sorted(set(anchors) | set(ours), key=lambda k: (k[0], k[1], k[2], k[3]))
    print()
    print(("backward" if args.pass_ == "bwd" else "forward") +
          " TFLOP/s, same GPU, same run (ratios: ours / anchor)")
    header = ("dtype", "d", "causal", "N", "fused", "naive", "FLASH", "cuDNN", "MATH",
              "fused/FLASH", "fused/cuDNN", "naive/MATH")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key in keys:
        a = anchors.get(key, {})
        o = ours.get(key, {})
        fused, naive = tf(o.get("fused")), tf(o.get("naive"))
        flash, cudnn, mth = tf(a.get("FLASH")), tf(a.get("CUDNN")), tf(a.get("MATH"))
        cells = (key[0], str(key[1]), "yes" if key[2] else "no", str(key[3]), fmt(fused),
                 fmt(naive), fmt(flash), fmt(cudnn), fmt(mth), fmt(ratio(fused, flash), 2),
                 fmt(ratio(fused, cudnn), 2), fmt(ratio(naive, mth), 2))
        print("| " + " | ".join(cells) + " |")
    # Fused rows with a pinned kernel (attn_kernel_bench --kernel / --block_n: engine fused_*),
    # each against cuDNN.
    pinned = sorted({e for r in ours.values() for e in r if e.startswith("fused_")})
    if pinned:
        print()
        print("pinned fused kernels, TFLOP/s (ratio to cuDNN), same GPU, same run")
        header = ("dtype", "d", "causal", "N", "fused") + tuple(pinned) + ("FLASH", "cuDNN")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for key in keys:
            a = anchors.get(key, {})
            o = ours.get(key, {})
            cudnn = tf(a.get("CUDNN"))
            cells = [key[0], str(key[1]), "yes" if key[2] else "no", str(key[3])]
            for engine in ("fused",) + tuple(pinned):
                t = tf(o.get(engine))
                r = ratio(t, cudnn)
                cells.append("—" if t is None else f"{t:.0f} ({fmt(r, 2)})")
            cells += [fmt(tf(a.get("FLASH"))), fmt(cudnn)]
            print("| " + " | ".join(cells) + " |")
    largest = max((k[3] for k in ours), default=None)
    if largest is not None:
        print()
        print(f"device memory each engine held beyond its inputs at N = {largest} (MiB)")
        for key in [k for k in keys if k[3] == largest and k in ours]:
            mem = {e: r.get("workspace_bytes", -1) for e, r in ours[key].items()}
            cells = ", ".join(f"{e} {m / 2**20:.0f}" for e, m in sorted(mem.items()) if m >= 0)
            print(f"  {key[0]} d={key[1]} causal={'yes' if key[2] else 'no'}: {cells}")
    failed = [(k, e) for k, r in ours.items() for e, row in r.items() if row["status"] != "ok"]
    for k, e in failed:
        print(f"note: ours {e} {k}: {ours[k][e]['status']}")


if __name__ == "__main__":
    main()
