#!/usr/bin/python3
"""Trains one attention layer on associative recall through an attnserve server, watches it, and
plots its loss curve to a PNG.

    python3 clients/python/examples/train_recall.py --target 127.0.0.1:50051 --out recall.png

The task: the first half of each sequence holds (key, value) pairs, the second half queries the
keys; the layer must answer each query with its key's value, which only attention can look up.
Chance is a loss of ln(vocab_size); the default job gets below 0.1 in ~100 steps on a CPU.
Needs the attnserve package (pip install ./clients/python) and matplotlib (python3-matplotlib).
"""
import argparse
import sys

import attnserve


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--token", default=None, help="bearer token, when the server wants one")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--vocab_size", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=32)
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--out", default="recall_loss.png", help="the PNG to write")
    args = parser.parse_args()

    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    with attnserve.Client(args.target, token=args.token) as client:
        job = client.train(task="associative_recall", vocab_size=args.vocab_size,
                           seqlen=args.seqlen, steps=args.steps, dtype=args.dtype,
                           learning_rate=args.learning_rate, schedule="cosine", warmup_steps=10,
                           name="train_recall example")
        if job.submitted.state == "failed":
            print(f"{job.job_id} failed: {job.submitted.error}", file=sys.stderr)
            return 1
        for s in job.watch():
            eta = f"ETA {s.eta_seconds:.0f}s" if s.state == "running" else s.state
            print(f"\r{job.job_id} step {s.step}/{s.total_steps}  loss {s.loss:.4f}  "
                  f"{s.eval_metric_name} {s.eval_metric:.3f}  "
                  f"{s.tokens_per_second / 1e3:.1f}k tokens/s  {eta}   ", end="", flush=True)
        print()
        try:
            result = job.result()
        except attnserve.AttnServeError as e:
            print(e, file=sys.stderr)
            return 1

    figure, loss_axis = plt.subplots(figsize=(7, 4))
    loss_axis.plot(result.steps, result.loss, color="tab:blue", label="loss")
    loss_axis.set_yscale("log")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("cross-entropy loss")
    metric_axis = loss_axis.twinx()
    metric_axis.plot(result.steps, result.metric, color="tab:orange", label="accuracy")
    metric_axis.set_ylabel("answer accuracy")
    metric_axis.set_ylim(0, 1.05)
    status = result.status
    loss_axis.set_title(f"associative recall, {status.forward_engine} engine: final loss "
                        f"{result.loss[-1]:.4f}")
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    shapes = ", ".join(f"{name}{list(w.shape)}" for name, w in result.weights.items())
    print(f"{result.state}: {len(result.steps)} steps, loss {result.loss[0]:.3f} -> "
          f"{result.loss[-1]:.4f}; weights {shapes}; plot in {args.out}")
    return 0 if result.state == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
