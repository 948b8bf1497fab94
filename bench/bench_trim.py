"""What trimming glibc's heap between decoder layers buys and costs (#70; docs/benchmarks.md, "The heap
trimmed before each layer with gradients"). One micro-batch of bench_lora_step.py's made trajectories
(--group trajectories of one question, 2 turns of 200 + 256 tokens) through the real 0.5B with a rank-4
adapter and activation checkpointing, in bfloat16, one process, one thread: the KL pass (no gradients,
adapter off), the forward and the backward of the log-probs and entropy, as grpo_step runs them. The
variants run in turn, --repeats times, each from a trimmed heap, so drift on a shared host falls on all:
    none      no trim inside the micro-batch
    layer     fsdp.trim_each_layer: a trim before each layer with gradients, forward and backward (kept)
    grown     the same hooks, trimming only when the resident set grew 256 MB since the last trim
Each row: seconds, the peak resident set (VmHWM, reset at the start), trims. With --passes, first the
heap after each pass with no trim: glibc's bytes in use (mallinfo2), its heap (arena) and the heap's
resident pages (/proc/self/smaps).

    python3 bench/bench_trim.py --checkpoint ~/.cache/qwen2.5-coder-0.5b-instruct --passes
"""

import argparse
import ctypes
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [HERE, os.path.join(HERE, "bench")]
import fsdp  # noqa: E402
import lora  # noqa: E402
import rollout as R  # noqa: E402
from common import made_trajectories  # noqa: E402
from model import load, token_logprobs  # noqa: E402
from worlds.toyworld import read_jsonl  # noqa: E402


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                              "fordblks keepcost".split()]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def heap_line(name):
    """glibc's bytes in use, its heap and the heap's resident pages, in GB."""
    m, rss, in_heap = LIBC.mallinfo2(), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                in_heap = fields[-1] == "[heap]"
            elif in_heap and fields[0] == "Rss:":
                rss += int(fields[1]) * 1024
    return f"| {name} | {(m.uordblks + m.hblkhd) / 1e9:.2f} | {m.arena / 1e9:.2f} | {rss / 1e9:.2f} | {peak() / 1e9:.2f} |"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--world", default=os.path.join(HERE, "cache", "toyworld"))
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--passes", action="store_true", help="first the heap after each pass, no trim")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _, _, dev, dt = fsdp.setup("cpu", "bfloat16", 896, masters=False)
    policy, tok = load(args.checkpoint, dev, dt)
    lora.attach(policy, 4, 8)
    policy.checkpoint_layers = True
    question = read_jsonl(os.path.join(args.world, "train.jsonl"))[0]["question"]
    ids, valid, mask, _ = R.pad_batch(made_trajectories(tok, [question], args.group, 2, 200, 0, R), tok.pad_id, dev)
    trims, last = [0], [0]

    def trim():
        trims[0] += 1
        fsdp.trim_host_memory()
        last[0] = resident()

    def trim_if_grown():
        if resident() > last[0] + (256 << 20):
            trim()
    rule = {}

    def before(block, a):
        if torch.is_grad_enabled() and rule["fn"]:
            rule["fn"]()

    def after(block, a, out):
        if out.requires_grad and rule["fn"]:
            out.register_hook(lambda grad: rule["fn"]())
    for block in policy.model.layers:  # fsdp.trim_each_layer's two hooks, the rule switchable
        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)

    def micro_batch(report=None):
        with torch.no_grad(), lora.disabled(policy):
            token_logprobs(policy, ids, valid, mask, 1.0)
        report and print(report("the KL pass (no gradients)"))
        logp, entropy = token_logprobs(policy, ids, valid, mask, 1.0, entropy=True)
        report and print(report("the forward"))
        (logp.sum() / 1000 + entropy.sum() / 1000).backward()
        report and print(report("the backward"))

    def fresh():
        fsdp.trim_host_memory()
        last[0], trims[0] = resident(), 0
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak starts again from what is resident now
    print(f"{ids.shape[0]} x {ids.shape[1]} tokens, rank 4, checkpointing, bfloat16, 1 thread")
    if args.passes:
        rule["fn"] = None
        fresh()
        print("\n| after | in use GB | glibc's heap GB | heap resident GB | peak resident GB |\n|---|---|---|---|---|")
        print(heap_line("the start (trimmed)"))
        micro_batch(heap_line)
    print("\n| trim | seconds | peak resident GB | trims |\n|---|---|---|---|")
    for _ in range(args.repeats):
        for name, fn in (("none", None), ("layer", trim), ("grown", trim_if_grown)):
            rule["fn"] = fn
            fresh()
            t0 = time.perf_counter()
            micro_batch()
            print(f"| {name} | {time.perf_counter() - t0:.1f} | {peak() / 1e9:.2f} | {trims[0]} |", flush=True)


if __name__ == "__main__":
    main()
