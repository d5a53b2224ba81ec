#!/usr/bin/env python3
"""attnserve's training layer in PyTorch, for tokens/s side by side with a TrainingService job of
the same shapes: q = x w_q, k = x w_k, v = x w_v, SDPA (causal), y = a w_o, out = LayerNorm(x + y),
logits against fixed answer embeddings, cross-entropy on the answer positions of associative
recall; AdamW (fused, decay on the four matrices), bf16/fp16 autocast with float32 master weights
(a GradScaler for fp16). The task is drawn on the GPU each step, as the server draws its own on
the host. Prints one JSON line; --curve writes step,loss,accuracy.

    python3 bench/training/torch_train.py --model_dim 1024 --num_heads 16 --num_kv_heads 4 \
        --head_dim 64 --seqlen 1024 --batch_size 16 --vocab_size 512 --steps 100
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model_dim", type=int, default=64)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--num_kv_heads", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--vocab_size", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10, help="steps before the clock starts")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curve", default="")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    dev = torch.device("cuda")
    D, H, HKV, d, T, B, V = (a.model_dim, a.num_heads, a.num_kv_heads, a.head_dim, a.seqlen,
                             a.batch_size, a.vocab_size)
    P = T // 2
    assert P <= V, "recall needs vocab_size >= seqlen / 2"
    dtype = getattr(torch, a.dtype)

    def matrix(rows, cols):
        return torch.nn.Parameter(torch.randn(rows, cols, device=dev) / math.sqrt(rows))
    wq, wk, wv, wo = matrix(D, H * d), matrix(D, HKV * d), matrix(D, HKV * d), matrix(H * d, D)
    gain = torch.nn.Parameter(torch.ones(D, device=dev))
    bias = torch.nn.Parameter(torch.zeros(D, device=dev))
    e_key, e_val, e_query = (torch.randn(V, D, device=dev) / math.sqrt(D) for _ in range(3))
    opt = torch.optim.AdamW([{"params": [wq, wk, wv, wo], "weight_decay": 0.0},
                             {"params": [gain, bias], "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.999), eps=1e-8, fused=True)
    scaler = torch.cuda.amp.GradScaler(enabled=a.dtype == "float16")
    gqa = {"enable_gqa": True} if HKV != H else {}

    def batch():
        keys = torch.rand(B, V, device=dev).argsort(dim=1)[:, :P]
        values = torch.randint(V, (B, P), device=dev)
        which = torch.randint(P, (B, T - P), device=dev)
        x = torch.cat([e_key[keys] + e_val[values], e_query[keys.gather(1, which)]], dim=1)
        labels = torch.cat([torch.full((B, P), -100, device=dev), values.gather(1, which)], dim=1)
        return x, labels

    def step():
        x, labels = batch()
        with torch.autocast("cuda", dtype=dtype, enabled=a.dtype != "float32"):
            q = (x @ wq).view(B, T, H, d).transpose(1, 2)
            k = (x @ wk).view(B, T, HKV, d).transpose(1, 2)
            v = (x @ wv).view(B, T, HKV, d).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
            y = attn.transpose(1, 2).reshape(B, T, H * d) @ wo
        out = F.layer_norm(x + y.float(), (D,), gain, bias, 1e-5)
        logits = out @ e_val.T
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scored = labels >= 0
        accuracy = (logits.argmax(-1)[scored] == labels[scored]).float().mean()
        return loss, accuracy

    curve = []
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(a.steps):
        loss, accuracy = step()
        curve.append((loss, accuracy))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    curve = [(float(l), float(acc)) for l, acc in curve]
    if a.curve:
        with open(a.curve, "w") as f:
            f.write("step,loss,accuracy\n")
            for i, (l, acc) in enumerate(curve):
                f.write(f"{a.warmup + i + 1},{l},{acc}\n")
    print(json.dumps({
        "engine": "torch_sdpa", "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
        "dtype": a.dtype, "model_dim": D, "num_heads": H, "num_kv_heads": HKV, "head_dim": d,
        "seqlen": T, "batch_size": B, "vocab_size": V, "steps": a.steps, "warmup": a.warmup,
        "seconds": elapsed, "tokens_per_second": a.steps * B * T / elapsed,
        "loss_first": curve[0][0], "loss_last": curve[-1][0], "accuracy_last": curve[-1][1]}))


if __name__ == "__main__":
    main()
