"""One GRPO step of the same trajectories with full fine-tuning and through a LoRA adapter, side by
side: training time, peak memory and the state each holds (#57 item 3; evolve.py --grpo_lora_rank).

Each variant runs in a process of its own, one after the other, as evolve.py runs it, in the compute
dtype `fsdp.setup` picks (--dtype auto: bfloat16 on a CPU with native bfloat16): `grpo.grpo_step` over
--questions x --group trajectories in micro-batches of --micro_batch, activation checkpointing with
--checkpointing. Full fine-tuning: float32 masters under FSDP2, AdamW on every weight, the KL model a
second copy. LoRA rank r: the frozen base held in the compute dtype (`fsdp.wrap`), a fresh float32
adapter on every linear, AdamW on it alone, the KL model the policy with the adapter off. The trajectories are made, not sampled, the same for
both (the cost of a step depends on lengths only): the toy world's first train questions' chat
prompts, then --turns turns of --cap random policy tokens each followed by 256 random observation
tokens, then a 20-token answer. The peak resident set (VmHWM) is reset when the step starts
(/proc/self/clear_refs), so it is the step's own; the step is timed twice (the first warms the
allocator and creates AdamW's moments), the second is reported.

--profile adds each phase's peak resident set and glibc's bytes in use (what is live) to the table.

    python3 bench/bench_lora_step.py --checkpoint ~/.cache/qwen2.5-coder-0.5b-instruct --ranks 0,4,16
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(args):
    import torch
    torch.set_num_threads(args.threads)
    sys.path[:0] = [HERE, os.path.join(HERE, "bench")]
    from common import grpo_step, made_trajectories, peak
    import fsdp
    import lora
    import rollout as R
    from model import Qwen2Config, load
    from worlds.toyworld import read_jsonl
    width = Qwen2Config.from_json(os.path.join(args.checkpoint, "config.json")).hidden_size
    _, _, dev, dt = fsdp.setup("cpu", args.dtype, width, masters=not args.rank)
    held = fsdp.held_dtype(dt) if hasattr(fsdp, "held_dtype") else torch.float32  # as evolve.py loads it (#70 on)
    policy, tok = load(args.checkpoint, dev, held)
    policy = fsdp.wrap(policy, dt)  # as evolve.py holds it: FSDP2 with float32 masters, or LoRA's base in dt
    kl_model = None if args.rank else fsdp.wrap(load(args.checkpoint, dev, torch.float32)[0].eval(), dt)
    if args.rank:
        params = lora.attach(policy, args.rank, 2 * args.rank)
        if hasattr(fsdp, "sum_grads"):  # from #69 on; before, grpo_step summed them
            fsdp.sum_grads(params)
    else:
        params = list(policy.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)
    policy.train()
    policy.checkpoint_layers = args.checkpointing
    questions = [q["question"] for q in read_jsonl(os.path.join(args.world, "train.jsonl"))[:args.questions]]
    trajs = made_trajectories(tok, questions, args.group, args.turns, args.cap, 0, R)
    adv = torch.linspace(-1, 1, len(trajs)).tolist()
    out = dict(rank=args.rank, dtype=str(dt).removeprefix("torch."), tokens=sum(len(t.tokens) for t in trajs),
               policy_tokens=sum(sum(t.loss_mask) for t in trajs))
    phases = profile_phases(policy.model.layers[0].__class__, optimizer) if args.profile else None
    for attempt in ("warm", "timed"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak starts again from what is resident now
        resident = peak()
        t0 = time.perf_counter()
        grpo_step(policy, kl_model, optimizer, trajs, adv, micro_batch=args.micro_batch, clip_ratio=0.2,
                  kl_coef=0.001, entropy_coef=0.001, temperature=1.0, max_grad_norm=1.0, pad_id=tok.pad_id)
        out[attempt] = dict(seconds=time.perf_counter() - t0, resident_gb=resident / 1e9, peak_gb=peak() / 1e9)
        if phases is not None:
            out[attempt]["phases"] = phases()
    held = fsdp.state_bytes(policy, optimizer, kl_model)[0]
    out["state_gb"] = {k: v / 1e9 for k, v in held.items()}
    print(json.dumps(out))


def profile_phases(block_class, optimizer):
    """--profile: sample the resident set and glibc's bytes in use (mallinfo2: live tensors and
    Python objects, not the freed memory glibc keeps) every 5 ms, each sample labelled with the phase
    running: the KL pass (no grad, adapter off), the forward, the backward's LM-head chunks and decoder
    layers (each recomputed, then differentiated), AdamW. Returns a function giving, since its last call,
    each phase's largest (resident GB, in-use GB), in the order the phases first ran."""
    import ctypes
    import threading
    import torch
    import grpo
    import model

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                                  "fordblks keepcost".split()]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    phase, samples = ["idle"], []

    def sample():
        while True:
            with open("/proc/self/statm") as f:
                resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            m = libc.mallinfo2()
            samples.append((phase[0], resident, m.uordblks + m.hblkhd))
            time.sleep(0.005)

    logprobs_fn, head, layer, step = grpo.token_logprobs, model._head, block_class.layer, optimizer.step

    def token_logprobs(*a, **k):
        phase[0] = "forward" if torch.is_grad_enabled() else "KL pass"
        out = logprobs_fn(*a, **k)
        phase[0] = "backward" if torch.is_grad_enabled() else phase[0]
        return out

    def head_chunk(*a):
        phase[0] = "backward: LM head" if phase[0].startswith("backward") else phase[0]
        return head(*a)

    def decoder_layer(self, *a):
        phase[0] = "backward: layers" if phase[0].startswith("backward") else phase[0]
        return layer(self, *a)

    def adamw(*a, **k):
        phase[0] = "AdamW"
        return step(*a, **k)
    grpo.token_logprobs, model._head, block_class.layer, optimizer.step = token_logprobs, head_chunk, decoder_layer, adamw
    threading.Thread(target=sample, daemon=True).start()

    def report():
        by = {}
        for name, resident, live in samples:
            r, l = by.get(name, (0, 0))
            by[name] = (max(r, resident / 1e9), max(l, live / 1e9))
        samples.clear()
        return by
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--world", default=os.path.join(HERE, "cache", "toyworld"))
    ap.add_argument("--ranks", default="0,4", help="0 = full fine-tuning; r > 0 = LoRA of rank r")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--group", type=int, default=5)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--cap", type=int, default=200)
    ap.add_argument("--micro_batch", type=int, default=4)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="each phase's peak resident and in-use memory (Linux, glibc)")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # set in the child process
    args = ap.parse_args()
    if args.rank is not None:
        return child(args)
    if not os.path.isfile(os.path.join(args.world, "train.jsonl")):
        sys.exit(f"{args.world}: no toy world (python3 evolve.py writes it, or pass --world)")
    with open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        f.seek(0)
        flags = set(f.read().split())
    print(f"{cpu}; avx512_bf16={'avx512_bf16' in flags}, amx_bf16={'amx_bf16' in flags}; {args.threads} threads; "
          f"{args.questions} questions x {args.group}, {args.turns} turns of {args.cap} + 256, micro-batch "
          f"{args.micro_batch}, activation checkpointing {args.checkpointing}")
    rows = []
    for r in (int(x) for x in args.ranks.split(",")):
        cmd = [sys.executable, __file__, *sys.argv[1:], f"--rank={r}"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        if p.returncode:
            sys.exit(p.stderr[-3000:])
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    full = next((x for x in rows if x["rank"] == 0), None)
    print("\n| training | dtype | tokens (policy) | step s | vs full | resident GB | peak GB | params / grads / AdamW / "
          "KL model GB |\n|---|---|---|---|---|---|---|---|")
    for x in rows:
        t, s = x["timed"], x["state_gb"]
        ratio = f"{t['seconds'] / full['timed']['seconds']:.2f}x" if full else "-"
        print(f"| {'full fine-tuning' if x['rank'] == 0 else 'LoRA rank ' + str(x['rank'])} | {x['dtype']} | "
              f"{x['tokens']:,} ({x['policy_tokens']:,}) | {t['seconds']:.1f} | {ratio} | {t['resident_gb']:.2f} | "
              f"{t['peak_gb']:.2f} | {s['params']:.2f} / {s['grads']:.2f} / {s['optimizer']:.2f} / {s['reference']:.2f} |")
    for x in rows if args.profile else ():
        print(f"\n{'full fine-tuning' if x['rank'] == 0 else 'LoRA rank ' + str(x['rank'])}, the timed step, by phase:\n"
              "| phase | peak resident GB | peak in use (glibc) GB |\n|---|---|---|")
        for name, (resident, live) in x["timed"]["phases"].items():
            print(f"| {name} | {resident:.2f} | {live:.2f} |")


if __name__ == "__main__":
    main()
