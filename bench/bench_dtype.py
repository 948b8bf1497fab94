"""float32 against bfloat16 for a real Qwen2.5 checkpoint, on this machine: what the "auto" dtype is for.

For the checkpoint given (--checkpoint or QWEN_CHECKPOINT), each dtype in turn, in one run:
  prefill    generate.extend of B prompts of T tokens into an empty KV cache: prompt tokens/s
  decode     generate.generate steps at each batch size after a 256-token prefill, sampling as the
             loop does (temperature 1, top-p 0.95), every row generating: new tokens/s
  GRPO pass  model.token_logprobs (log-probs and entropy at the policy's tokens) forward + backward
             over a batch of trajectories, a sixth of each the policy's tokens: seconds. float32 is a
             plain float32 model; bfloat16 is evolve.py's mixed precision (fsdp.shard on one rank:
             float32 master weights, bfloat16 compute)
Inference runs on weights loaded in the dtype (as eval.py does). Each figure is the second of two
identical calls: the first pays for first-touch of the weights and oneDNN's kernel selection (a cold
bfloat16 prefill here ran at half its warm speed). The last lines say whether this CPU computes
bfloat16 natively (fsdp.cpu_has_native_bf16) and what "auto" picks for the checkpoint. Without native
bfloat16 (AVX2, or AVX-512 without BF16) PyTorch converts each bfloat16 matmul through float32, 5-7x
slower than float32 itself: the bfloat16 row is then skipped, with the reason, unless --dtypes asks.

    python bench/bench_dtype.py --checkpoint ~/.cache/qwen2.5-coder-0.5b-instruct [--threads 2]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fsdp  # noqa: E402
from common import decode, grpo_pass, prefill, warm  # noqa: E402  (bench/common.py)
from model import Qwen2Config, load  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=os.environ.get("QWEN_CHECKPOINT", ""))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--prefill", default="4x256", help="BxT prompt tokens of the prefill")
    ap.add_argument("--batches", default="16,64", help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    ap.add_argument("--train", default="4x512", help="BxT tokens of the GRPO pass")
    ap.add_argument("--dtypes", default="", help="comma-separated; default float32 and, where this CPU "
                    "computes it natively, bfloat16")
    args = ap.parse_args()
    if not args.checkpoint:
        sys.exit("give --checkpoint DIR (a Hugging Face Qwen2.5 folder) or set QWEN_CHECKPOINT")
    if args.threads:
        torch.set_num_threads(args.threads)
    pb, pt = map(int, args.prefill.split("x"))
    tb, tt = map(int, args.train.split("x"))
    batches = [int(b) for b in args.batches.split(",")]
    native = fsdp.cpu_has_native_bf16()
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32"] + ["bfloat16"] * native
    rows = {}
    for name in dtypes:
        dt = getattr(torch, name)
        model, tok = load(args.checkpoint, "cpu", dt)
        r = rows[name] = dict(prefill=warm(lambda: prefill(model, pb, pt)))
        for b in batches:
            r[f"decode {b}"] = warm(lambda: decode(model, tok, b, args.steps))
        del model
        policy = load(args.checkpoint, "cpu", torch.float32)[0].train()
        if dt != torch.float32:  # evolve.py's path: a one-rank group, FSDP2 mixed precision
            fsdp.setup("cpu", name, policy.config.hidden_size)
            fsdp.shard(policy, dt)
        r["grpo"] = warm(lambda: grpo_pass(policy, tb, tt))
        del policy
        print(f"  {name}: {r}", file=sys.stderr, flush=True)
    cols = [f"prefill {pb}x{pt} tok/s"] + [f"decode batch {b} tok/s" for b in batches] + [f"GRPO pass {tb}x{tt} s"]
    keys = ["prefill"] + [f"decode {b}" for b in batches] + ["grpo"]
    print(f"\n{os.path.basename(args.checkpoint.rstrip('/'))}, CPU, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}\n")
    print("| dtype | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[k]:.1f}" if k != "grpo" else f"{r[k]:.2f}" for k in keys) + " |")
    if {"float32", "bfloat16"} <= rows.keys():
        speed = [rows["bfloat16"][k] / rows["float32"][k] if k != "grpo" else rows["float32"][k] / rows["bfloat16"][k]
                 for k in keys]
        print("| bfloat16 / float32 speed | " + " | ".join(f"{s:.2f}x" for s in speed) + " |")
    elif not native:
        print("\nbfloat16 skipped: this CPU has no native bfloat16 (no avx512_bf16 / amx_bf16 in /proc/cpuinfo); "
              "--dtypes=float32,bfloat16 runs it anyway")
    width = Qwen2Config.from_json(os.path.join(args.checkpoint, "config.json")).hidden_size
    print(f"\nnative bfloat16 on this CPU: {native}; "
          f"dtype 'auto' picks {fsdp.device_and_dtype('cpu', 'auto', width)[1]} for this checkpoint")


if __name__ == "__main__":
    main()
