"""A real checkpoint's rollout and GRPO training step, split into their parts, against the machine's
limit and against another commit's code, side by side in one run (#49 items 1, 2, 3 and 6).

Each code folder (this checkout, and --before: another checkout, e.g. a `git worktree` of the
commit before a change) runs the phase in a process of its own on the same input. With --parallel
both processes run at once on --threads threads each (one machine, the same neighbour); without
it, one after the other.
  --phase=rollout  `rollout.rollout` of the toy world's first --questions train questions x
                   --group samples, --turns searching turns of at most --cap tokens, 256-token
                   observations, top 3, temperature 1, top_p 0.95, the same seed
  --phase=train    one `grpo.grpo_step` (the KL model's forward, the policy's forward and backward,
                   AdamW) over --questions x --group trajectories made without sampling: each the
                   question's chat prompt, then --turns turns of --cap random tokens (the policy's),
                   each followed by 256 random tokens of "observation", then a 20-token answer turn;
                   micro-batches of --micro_batch trajectories, --checkpointing recomputes each layer
Each reports its wall time, policy tokens a second, and the time and FLOPs of each part, measured
by wrapping the functions every version calls:
  linears     torch.nn.functional.linear on a decoder weight: 2 x rows x in x out FLOPs
  LM head     the same on the (V, d) output weight
  attention   scaled_dot_product_attention: 4 x B x H x T x S x D FLOPs (scores and values)
  sampling    generate.draw (the softmax, top-p, inverse CDF over V = 152k)
  retrieval   the index's batched search
  the rest    the wall time none of these took: Python, masks, KV-cache copies
In the train phase the wrappers see the forward passes only: the backward's time is in "the rest".
Each part's GFLOP/s is printed beside the machine's limit: its best float32 matmul rate at the
model's shapes (common.matmul_rate, measured in this process before the rollouts).
Left out: bfloat16 (run the bench on a CPU with native bfloat16 and --dtype=bfloat16).

    git worktree add ../before 4d9e205
    python bench/bench_side_by_side.py --checkpoint ~/.cache/qwen2.5-coder-0.5b-instruct --before ../before --parallel
    python bench/bench_side_by_side.py --phase=train --questions 2 --turns 2 --cap 150 --checkpointing \
        --threads 2 --checkpoint ~/.cache/qwen2.5-coder-0.5b-instruct --before ../before
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("linears", "LM head", "attention", "sampling", "retrieval")


def child(args):
    """Run one rollout with the code on sys.path[0] and print one JSON line of its numbers."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    import generate
    import rollout as R
    from common import grpo_step, made_trajectories, rollout  # bench/common.py: the same for every code version
    from model import load
    from retriever import load_index
    try:
        from worlds.toyworld import read_jsonl
    except ModuleNotFoundError:  # a checkout from before the worlds/ folder (a0834f6)
        from toyworld import read_jsonl
    model, tok = load(args.checkpoint, "cpu", getattr(torch, args.dtype))
    index = load_index(os.path.join(args.world, "index"))
    questions = [q["question"] for q in read_jsonl(os.path.join(args.world, "train.jsonl"))[:args.questions]]
    spent, flops, depth = dict.fromkeys(PARTS, 0.0), dict.fromkeys(PARTS, 0.0), [0]
    vocab = model.config.vocab_size

    def timed(part, fn, count=lambda *a, **k: 0.0):
        def wrapper(*a, **k):
            if depth[0]:  # a part inside another (sample calls draw): counted once, in the outer
                return fn(*a, **k)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                name = part(*a) if callable(part) else part
                spent[name] += time.perf_counter() - t0
                flops[name] += count(*a, **k)
        return wrapper

    def linear_flops(x, w, b=None):
        return 2.0 * x.numel() / x.shape[-1] * w.shape[0] * w.shape[1]

    def attention_flops(q, k, v, **kw):
        return 4.0 * q.numel() * k.shape[-2]  # (B, H, T, D) queries against S keys, scores and values
    extra = dict(compile=True) if args.compile else {}  # compiled: no parts (the wrappers would not be traced)

    def sampled(seed):
        return rollout(model, tok, index, questions, args.group, max_turns=args.turns, max_turn_tokens=args.cap,
                       max_obs_tokens=256, top_k=3, temperature=1.0, top_p=0.95, rollout_rows=args.rollout_rows,
                       generator=torch.Generator().manual_seed(seed), **extra)
    if args.compile:  # the compiling rollout first, untimed (its shapes are the timed one's)
        sampled(args.seed + 1)
    else:
        F.linear = timed(lambda x, w, b=None: "LM head" if w.shape[0] == vocab else "linears", F.linear, linear_flops)
        F.scaled_dot_product_attention = timed("attention", F.scaled_dot_product_attention, attention_flops)
    for name in ("sample", "draw"):
        if hasattr(generate, name):
            setattr(generate, name, timed("sampling", getattr(generate, name)))
    index.search = timed("retrieval", index.search)
    if args.phase == "train":
        trajs = made_trajectories(tok, questions, args.group, args.turns, args.cap, args.seed, R)
        kl_model = load(args.checkpoint, "cpu", getattr(torch, args.dtype))[0].eval()
        model.train()
        model.checkpoint_layers = args.checkpointing
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
        adv = torch.linspace(-1, 1, len(trajs)).tolist()
    t0 = time.perf_counter()
    if args.phase == "train":
        grpo_step(model, kl_model, optimizer, trajs, adv, micro_batch=args.micro_batch, clip_ratio=0.2,
                  kl_coef=0.001, entropy_coef=0.001, temperature=1.0, max_grad_norm=1.0, pad_id=tok.pad_id)
    else:
        trajs = sampled(args.seed)
    wall = time.perf_counter() - t0
    print(json.dumps(dict(wall=wall, tokens=sum(sum(t.loss_mask) for t in trajs), spent=spent, flops=flops,
                          formatted=sum(t.stop == "answer" for t in trajs),
                          searches=sum(t.n_search for t in trajs))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=os.environ.get("QWEN_CHECKPOINT", ""))
    ap.add_argument("--world", default=os.path.join(HERE, "cache", "toyworld"), help="toy world folder (evolve.py writes it)")
    ap.add_argument("--before", default="", help="another checkout to run side by side")
    ap.add_argument("--parallel", action="store_true", help="run both at once (else one after the other)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--group", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--cap", type=int, default=200)
    ap.add_argument("--rollout_rows", type=int, default=0, help="trajectories decoded at once (rollout); 0 = all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--phase", default="rollout", choices=("rollout", "train"))
    ap.add_argument("--micro_batch", type=int, default=4, help="trajectories per forward/backward (train)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing (train)")
    ap.add_argument("--compile", action="store_true", help="a third row: this checkout, decoding compiled (rollout)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if not args.checkpoint:
        sys.exit("give --checkpoint DIR (a Hugging Face Qwen2.5 folder) or set QWEN_CHECKPOINT")
    import torch
    sys.path.insert(0, HERE)
    from model import Qwen2Config
    from common import matmul_rate
    torch.set_num_threads(args.threads)
    cfg = Qwen2Config.from_json(os.path.join(args.checkpoint, "config.json"))
    limit = max(matmul_rate(r, cfg.hidden_size, cfg.intermediate_size, getattr(torch, args.dtype)) for r in (1024, 80))
    codes = [("before: " + os.path.basename(os.path.abspath(args.before)), args.before)] if args.before else []
    codes.append(("this checkout", HERE))
    if args.compile:
        codes.append(("this checkout, compiled", HERE))
    argv = [f"--{k}={v}" for k, v in vars(args).items()
            if k not in ("before", "parallel", "child", "checkpointing", "compile")]
    argv += ["--checkpointing"] * args.checkpointing
    argv[argv.index(f"--world={args.world}")] = f"--world={os.path.abspath(args.world)}"
    procs = []
    for name, folder in codes:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(folder), OMP_NUM_THREADS=str(args.threads))
        cmd = [sys.executable, os.path.abspath(__file__), "--child", *argv] + ["--compile"] * name.endswith("compiled")
        procs.append((name, subprocess.Popen(cmd, env=env, cwd=folder, stdout=subprocess.PIPE, text=True)))
        if not args.parallel:
            procs[-1] = (name, procs[-1][1].communicate()[0], procs[-1][1].returncode)
    if args.parallel:
        procs = [(name, p.communicate()[0], p.returncode) for name, p in procs]
    rows = []
    for name, out, rc in procs:
        if rc:
            sys.exit(f"{name}: the rollout failed (exit {rc})")
        rows.append((name, json.loads(out.strip().splitlines()[-1])))
    print(f"{os.path.basename(args.checkpoint.rstrip('/'))}, {args.dtype}, {args.threads} thread(s) a process, "
          f"{'both at once' if args.parallel else 'one after the other'}; {args.phase}: {args.questions} toy "
          f"questions x {args.group}, {args.turns} turns of <= {args.cap} tokens, rollout_rows {args.rollout_rows}, "
          f"seed {args.seed}; "
          f"limit {limit / 1e9:.1f} GFLOP/s (best float32 matmul at the model's shapes)\n")
    print("| code | seconds | policy tokens | tokens/s | answered | searches |\n|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['wall']:.1f} | {r['tokens']} | {r['tokens'] / r['wall']:.2f} | "
              f"{r['formatted']} | {r['searches']} |")
    for name, b in rows[1:] if args.before else []:
        a = rows[0][1]
        print(f"\ntokens/s, {name} / before: {b['tokens'] / b['wall'] / (a['tokens'] / a['wall']):.2f}x; "
              f"seconds, before / {name}: {a['wall'] / b['wall']:.2f}x")
    print("\n| code | part | seconds | share | GFLOP/s | of the limit |\n|---|---|---|---|---|---|")
    for name, r in rows:
        for part in PARTS + ("the rest",) if not name.endswith("compiled") else ():
            s = r["wall"] - sum(r["spent"].values()) if part == "the rest" else r["spent"][part]
            f = r["flops"].get(part, 0.0)
            rate = f"{f / s / 1e9:.1f} | {f / s / limit:.2f}" if f and s else " | "
            print(f"| {name} | {part} | {s:.1f} | {s / r['wall']:.2f} | {rate} |")


if __name__ == "__main__":
    main()
