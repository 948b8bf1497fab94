"""The OFSD round's peak memory on a real checkpoint: with GRPO's state resident, and let go as the loop does.

After a GRPO step the loop holds the policy, its gradients, AdamW's two moments and the KL term's
model (for the real 0.5B in float32: 2 + 2 + 4 + 2 GB). The OFSD round needs only the policy.
Since #49 `evolve.py` lets the rest go for the round's length (the KL model dropped, the
gradients set to None, the moments parked in a file: `fsdp.park`); before it (4d9e205) all of it
stayed. Each regime runs in a process of its own, one after the other, on the same made inputs:

1. setup: the policy and the KL model loaded, one `grpo.grpo_step` on --trajectories made
   trajectories (common.made_trajectories: chat prompt, 2 turns of 200 random policy
   tokens each followed by 256 of observation, a 20-token answer; micro-batches of 4, activation
   checkpointing: the P' command's settings), so gradients and moments exist;
2. the regime applied ("resident": nothing goes; "released": what evolve.py's OFSD branch lets
   go), then the peak reset (/proc/self/clear_refs) to what is resident at the round's start;
3. the round's two big parts, each on made inputs: the mining rollout's KV cache (--rows rows of
   the length the protocol bounds, 4 turns of 200 tokens and 256-token observations, with the
   toy questions' prompts prefilled) and `ofsd.distill` (LoRA rank 16, `ofsd_clip=none`, 2
   epochs) on --pairs pairs made the same way (tau_ref's whole response in the teacher's prompt:
   about 1,000 student and 1,800 teacher tokens), 4 pairs a step, activation checkpointing.
The peak resident set (VmHWM) is read after each part.

    python3 bench/bench_ofsd_memory.py --checkpoint ~/.cache/qwen2.5-coder-0.5b-instruct [--threads 2]

Left out: the round's greedy diagnostics (their KV caches are the mined pairs' few rows).
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


def child(args):
    import torch
    torch.set_num_threads(args.threads)
    sys.path[:0] = [HERE, os.path.join(HERE, "bench")]
    import fsdp
    import generate
    import ofsd
    import rollout as R
    from common import distill, grpo_step, made_trajectories, max_response_tokens, peak
    from model import load
    from worlds.toyworld import read_jsonl
    t0 = time.time()
    policy, tok = load(args.checkpoint, "cpu", torch.float32)
    kl_model = load(args.checkpoint, "cpu", torch.float32)[0].eval()
    policy.checkpoint_layers = True
    questions = [q["question"] for q in read_jsonl(os.path.join(args.world, "train.jsonl"))]
    trajs = made_trajectories(tok, questions[:args.trajectories], 1, 2, 200, 0, R)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
    policy.train()
    grpo_step(policy, kl_model, optimizer, trajs, [1.0, -1.0] * (len(trajs) // 2) + [0.0] * (len(trajs) % 2),
              micro_batch=4, clip_ratio=0.2, kl_coef=0.001, entropy_coef=0.001, temperature=1.0,
              max_grad_norm=1.0, pad_id=tok.pad_id)
    policy.eval()
    setup_peak = peak()
    if args.regime == "released":  # evolve.py's OFSD branch
        kl_model = None
        gc.collect()
        fsdp.park(optimizer, os.path.join(args.tmp, "parked.pt"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from what is resident now
    resident = peak()
    # the mining rollout's KV cache: --rows rows as long as the protocol allows, the prompts prefilled
    prompts = [tok.encode(tok.chat_prompt(R.make_prompt(q))) for q in questions[:args.rows // 5]]
    max_len = max(map(len, prompts)) + max_response_tokens(tok, max_turns=4, max_turn_tokens=200, max_obs_tokens=256)
    with torch.no_grad():
        cache = generate.new_cache(policy, args.rows, max_len)
        sub = generate.new_cache(policy, len(prompts), max(map(len, prompts)))
        generate.extend(policy, sub, prompts)
        cache.put(list(range(len(prompts) * 5)), sub, [j // 5 for j in range(len(prompts) * 5)])
    mining_peak = peak()
    del cache, sub
    gc.collect()
    pair_trajs = made_trajectories(tok, questions[:2 * args.pairs], 1, 2, 200, 0, R)
    pairs = [ofsd.Pair(ref, stu, True, golds=("x",)) for ref, stu in zip(pair_trajs[::2], pair_trajs[1::2])]
    with torch.enable_grad():
        distill(policy, tok, pairs, 0, ofsd_loss="kl", kl_weight=1.0, ofsd_lora_rank=16, ofsd_lora_alpha=32, ofsd_lora_lr=2e-4,
                ofsd_epochs=2, ofsd_pairs_per_step=4, tau_clip=0.05, ofsd_clip="none", ofsd_context="full",
                ofsd_positions="policy", max_grad_norm=1.0, kl_chunk=256)
    print(json.dumps(dict(regime=args.regime, setup=setup_peak, resident=resident, mining=mining_peak, round=peak(),
                          seconds=time.time() - t0, student=len(pairs[0].stu.tokens),
                          teacher=len(ofsd.pair_sequences(tok, pairs[0].stu, ofsd.privileged(tok, pairs[0], "full")).teacher))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=os.environ.get("QWEN_CHECKPOINT", ""))
    ap.add_argument("--world", default=os.path.join(HERE, "cache", "toyworld"), help="toy world folder (evolve.py writes it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trajectories", type=int, default=2, help="made trajectories of the GRPO step")
    ap.add_argument("--rows", type=int, default=80, help="KV-cache rows of the mining rollout (rollout_rows)")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--regime", choices=("resident", "released"), help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.regime:
        return child(args)
    if not args.checkpoint:
        sys.exit("give --checkpoint DIR (a Hugging Face Qwen2.5 folder) or set QWEN_CHECKPOINT")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for regime in ("resident", "released"):
            cmd = [sys.executable, os.path.abspath(__file__), f"--regime={regime}", f"--tmp={tmp}",
                   *(f"--{k}={v}" for k, v in vars(args).items() if k not in ("regime", "tmp"))]
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
            if p.returncode:
                sys.exit(f"{regime}: failed (exit {p.returncode})\n{p.stderr[-3000:]}")
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    r = rows[0]
    print(f"{os.path.basename(args.checkpoint.rstrip('/'))}, float32, {args.threads} threads; GRPO step on "
          f"{args.trajectories} made trajectories; mining KV cache of {args.rows} rows; distill on {args.pairs} pairs "
          f"({r['student']} student / {r['teacher']} teacher tokens)\n")
    print("| regime | setup peak GB | resident at the round's start GB | round: mining peak GB | round: peak GB | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['regime']} | {r['setup'] / GB:.2f} | {r['resident'] / GB:.2f} | {r['mining'] / GB:.2f} | "
              f"{r['round'] / GB:.2f} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
