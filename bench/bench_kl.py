"""The clipped forward-KL loss, forward + backward: ours against naive autograd and torch.compile.

Input: T positions x V vocabulary (default 2048 x 151,936, float32, Qwen2.5's vocabulary), random
student and teacher logits (spread 2), tau_clip = 0.01. Each variant runs in its own process; the
table gives the best of `--repeats` wall times and the peak resident memory above the inputs.
  naive          clipped_kl.clipped_forward_kl_spec + autograd (materialises several (T, V) tensors)
  compiled       torch.compile of the spec applied to row chunks of 256 (autograd)
  ours-chunked   clipped_kl.clipped_forward_kl off CUDA: analytic gradient, 8 rows at a time; its (T, V)
                 gradient buffer is part of the extra memory
  ours-fused     clipped_kl.fused_linear_clipped_kl from hidden states (T, 896) + LM head (V, 896): the
                 training path; logits never exist beyond one chunk (input = hidden states, so it
                 also pays the two LM-head matmuls per chunk that the others get for free)
  naive-fused    the same hidden-state input through two full matmuls and the naive loss
On CUDA (--device cuda, bf16 by default there) ours-chunked is the Triton kernel.

    python bench/bench_kl.py [--T 2048] [--V 151936] [--variants naive,compiled,ours-chunked,ours-fused]
"""

import argparse
import multiprocessing as mp
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import clipped_kl  # noqa: E402


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(variant, T, V, dtype, device, repeats, q):
    torch.manual_seed(0)
    d = 896
    if variant in ("ours-fused", "naive-fused"):
        hs = torch.randn(T, d, device=device, dtype=dtype)
        ht = torch.randn(T, d, device=device, dtype=dtype)
        w = torch.randn(V, d, device=device, dtype=dtype) * 0.07
    else:
        s = torch.randn(T, V, device=device, dtype=dtype) * 2
        t = torch.randn(T, V, device=device, dtype=dtype) * 2
    if variant == "compiled":
        comp = torch.compile(clipped_kl.clipped_forward_kl_spec)

        def fn(x):
            return sum(comp(x[c:c + 256], t[c:c + 256], 0.01) * x[c:c + 256].shape[0]
                       for c in range(0, T, 256)) / T
    elif variant == "naive":
        def fn(x):
            return clipped_kl.clipped_forward_kl_spec(x, t, 0.01)
    elif variant == "naive-fused":
        def fn(x):
            return clipped_kl.clipped_forward_kl_spec(x @ w.T, ht @ w.T, 0.01)
    elif variant == "ours-chunked":
        def fn(x):
            return clipped_kl.clipped_forward_kl(x, t, 0.01)
    else:
        def fn(x):
            return clipped_kl.fused_linear_clipped_kl(x, ht, w, 0.01, chunk=256)
    x = (hs if variant.endswith("fused") else s).clone().requires_grad_(True)
    base = rss_mb()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated() / 2**20
    times = []
    for _ in range(repeats):
        x.grad = None
        t0 = time.perf_counter()
        loss = fn(x)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del loss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20 - base_cuda
    q.put((variant, min(times), peak))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="naive,compiled,ours-chunked,naive-fused,ours-fused")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    ctx = mp.get_context("spawn")
    rows = []
    for v in args.variants.split(","):
        q = ctx.Queue()
        p = ctx.Process(target=run, args=(v, args.T, args.V, dtype, args.device, args.repeats, q))
        p.start()
        rows.append(q.get())
        p.join()
        print(f"  {v}: {rows[-1][1]:.2f}s", file=sys.stderr)
    print(f"\nT={args.T}, V={args.V:,}, {dtype}, {args.device}, {torch.get_num_threads()} threads, "
          f"forward + backward, best of {args.repeats}\n")
    print("| variant | time s | peak extra memory MB |")
    print("|---|---|---|")
    for v, t, m in rows:
        print(f"| {v} | {t:.2f} | {m:,.0f} |")


if __name__ == "__main__":
    main()
