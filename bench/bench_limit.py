"""How far each phase of a real checkpoint runs from this machine's own limit (#49 item 1).

In one run, for the checkpoint given (--checkpoint or QWEN_CHECKPOINT):
  the limit   this machine's matrix-multiply throughput (FLOP/s) per dtype, at the checkpoint's own
              shapes (x @ W for the MLP's up projection, d -> I, at 2048, 1024, 512, 80, 16 and 1
              rows: the GRPO pass's, the prefill's and the decode batches' row counts), and its
              memory bandwidth (GB/s of a large tensor copy, read + write)
  the phases  bench_dtype.py's measurements (each the second of two identical calls): a prefill,
              sampled decode steps at 1, 16 and 80 rows, a GRPO pass (forward + backward of
              model.token_logprobs); each as achieved FLOP/s and as a fraction of the dtype's limit
              (its best matmul rate); decode also as a fraction of the bandwidth limit (every step
              reads every weight once)
FLOPs counted from the model's shape (a multiply-add is 2 FLOPs):
  P_lin = L (d (d + 2 kv hd) + d d + 3 d I)          the decoder's linear weights (q, k, v, o, MLP)
  forward of one token at context c:  2 P_lin + 2 V d (LM head) + 4 L d c   (scores and values)
  prefill B x T:  B (T 2 P_lin + 2 V d + 2 L d T (T + 1))   (logits at each prompt's last token only)
  decode step at context c, b rows:  b (2 P_lin + 2 V d + 4 L d c)
  GRPO pass B x T with n policy tokens: 3 (B (T 2 P_lin + 2 L d T (T + 1)) + n 2 V d)   (backward = 2 forwards;
              the LM head runs only at the policy's tokens)
Each section has a time limit (--limit seconds, checked between calls): one that would pass it is
skipped and says so, so the bench finishes on any CPU. bfloat16 runs only where this CPU computes it
natively (fsdp.cpu_has_native_bf16; without it a bfloat16 matmul goes through float32 conversions at
a small fraction of float32's rate), unless --dtypes asks.
The sampled rollout split into its linears, attention, LM head, sampling and retrieval, each against
the same limit, is bench_side_by_side.py's (it runs a whole rollout, minutes to an hour).

    python bench/bench_limit.py --checkpoint ~/.cache/qwen2.5-coder-0.5b-instruct --threads 2
"""

import argparse
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import decode, grpo_pass, matmul_rate, prefill, warm  # noqa: E402
import fsdp  # noqa: E402
from model import load  # noqa: E402

ROWS = (2048, 1024, 512, 80, 16, 1)


class OverLimit(Exception):
    pass


def limited(seconds, measure):
    """measure()'s value, or None when it runs past `seconds` (an alarm, checked between Python calls)."""
    def stop(*_):
        raise OverLimit
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(max(1, int(seconds)))
    try:
        return measure()
    except OverLimit:
        return None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def bandwidth(mb=512, repeats=5):
    """Bytes/s of copying an `mb` MB float32 tensor (read + write)."""
    a = torch.empty(mb * 2 ** 18)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(repeats):
        b.copy_(a)
    return 2 * a.numel() * 4 * repeats / (time.perf_counter() - t0)


def shape(cfg):
    """(P_lin, V d, L d): the counts the FLOP formulas above use."""
    d, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    p_lin = cfg.num_hidden_layers * (d * (d + 2 * cfg.num_key_value_heads * hd) + d * d + 3 * d * cfg.intermediate_size)
    return p_lin, cfg.vocab_size * d, cfg.num_hidden_layers * d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=os.environ.get("QWEN_CHECKPOINT", ""))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--limit", type=float, default=240, help="seconds a section may take")
    ap.add_argument("--prefill", default="4x256")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per row count")
    ap.add_argument("--train", default="4x512")
    ap.add_argument("--dtypes", default="")
    args = ap.parse_args()
    if not args.checkpoint:
        sys.exit("give --checkpoint DIR (a Hugging Face Qwen2.5 folder) or set QWEN_CHECKPOINT")
    if args.threads:
        torch.set_num_threads(args.threads)
    native = fsdp.cpu_has_native_bf16()
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32"] + ["bfloat16"] * native
    pb, pt = map(int, args.prefill.split("x"))
    tb, tt = map(int, args.train.split("x"))
    bw = bandwidth()
    print(f"{os.path.basename(args.checkpoint.rstrip('/'))}, CPU, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; memory bandwidth {bw / 1e9:.1f} GB/s (copy, read + write)\n")
    print("| dtype | phase | FLOPs | seconds | GFLOP/s | of the limit | of the bandwidth limit |\n|---|---|---|---|---|---|---|")
    for name in dtypes:
        dt = getattr(torch, name)
        model, tok = load(args.checkpoint, "cpu", dt)
        cfg = model.config
        p_lin, vd, ld = shape(cfg)
        rates = {r: matmul_rate(r, cfg.hidden_size, cfg.intermediate_size, dt) for r in ROWS}
        peak = max(rates.values())
        for r, v in rates.items():
            print(f"| {name} | matmul {r} x {cfg.hidden_size} x {cfg.intermediate_size} | | | {v / 1e9:.1f} | "
                  f"{v / peak:.2f} | |", flush=True)

        def row(phase, flops, seconds, weight_reads=0):
            if seconds is None:
                print(f"| {name} | {phase} | {flops:.3g} | skipped: over its {args.limit:.0f} s limit | | | |", flush=True)
                return
            of_bw = f"{weight_reads * dt.itemsize * (p_lin + vd) / seconds / bw:.2f}" if weight_reads else ""
            print(f"| {name} | {phase} | {flops:.3g} | {seconds:.2f} | {flops / seconds / 1e9:.1f} | "
                  f"{flops / seconds / peak:.2f} | {of_bw} |", flush=True)

        tps = limited(args.limit, lambda: warm(lambda: prefill(model, pb, pt)))  # prompt tokens / s
        flops = pb * (pt * 2 * p_lin + 2 * vd + 2 * ld * pt * (pt + 1))
        row(f"prefill {pb} x {pt}", flops, None if tps is None else pb * pt / tps)
        for b in (1, 16, 80):
            tps = limited(args.limit, lambda: warm(lambda: decode(model, tok, b, args.steps)))  # new tokens / s
            c = 256 + args.steps / 2  # the mean context of a timed step (after a 256-token prefill)
            flops = b * args.steps * (2 * p_lin + 2 * vd + 4 * ld * c)
            row(f"decode {b} rows x {args.steps} steps", flops, None if tps is None else b * args.steps / tps,
                weight_reads=args.steps)
        del model
        policy = load(args.checkpoint, "cpu", torch.float32)[0].train()
        if dt != torch.float32:  # evolve.py's path: a one-rank group, FSDP2 mixed precision
            fsdp.setup("cpu", name, cfg.hidden_size)
            fsdp.shard(policy, dt)
        seconds = limited(args.limit, lambda: warm(lambda: grpo_pass(policy, tb, tt)))
        n_policy = tb * -(-tt // 6)  # bench_dtype.grpo_pass: the last sixth (rounded up) are the policy's tokens
        flops = 3 * (tb * (tt * 2 * p_lin + 2 * ld * tt * (tt + 1)) + n_policy * 2 * vd)
        row(f"GRPO pass {tb} x {tt}", flops, seconds)
        del policy
    if not native and not args.dtypes:
        print("\nbfloat16 skipped: this CPU has no native bfloat16 (no avx512_bf16 / amx_bf16 in /proc/cpuinfo); "
              "--dtypes=float32,bfloat16 runs it anyway")


if __name__ == "__main__":
    main()
