"""What the experiments share: the rollout settings a mining run takes, a policy loaded as evolve.py
loads it, mined pairs and their diagnostics kept on disk for a resumed run, and the mean [lowest, highest] cell of a table.

The experiments ask questions of the method (docs/ablation.md declares each before its runs); the
speed and memory benches are in bench/. Each experiment is a script:

    python experiments/ablation.py        # the toy world: GRPO alone against GRPO + OFSD variants
    python experiments/real_ofsd.py ...   # one OFSD round of a real checkpoint, each arm on the same pairs
    python experiments/context.py ...     # what each teacher context gives, before any training
    python experiments/verdict.py ROWS    # the declared paired rule and cause test over real_ofsd's rows
    python experiments/teacher.py ...     # a checkpoint's headroom: teacher view against student view
    python experiments/backbone.py        # the toy backbone's targets
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoint  # noqa: E402
import fsdp  # noqa: E402
import lora  # noqa: E402
import ofsd  # noqa: E402

PROTOCOL = ("max_turns", "max_turn_tokens", "max_obs_tokens", "top_k", "temperature", "top_p", "rollout_rows")


def policy(folder, dev, dt, checkpoint_layers=False):
    """A checkpoint or a policy folder (a base and its adapters, lora.py) in float32, sharded for
    bfloat16 compute when a process group is up (fsdp.setup), as evolve.py holds its policy."""
    model, tok = lora.load_policy(folder, dev, torch.float32)
    if dist.is_initialized():
        fsdp.shard(model, dt)
    model.checkpoint_layers = checkpoint_layers
    return model, tok


def mined_pairs(path, mine_them):
    """(pairs, diagnostics, seconds) read from `path` when a run before this one wrote it, else
    `mine_them()`'s, written there before they are used (ofsd.save_pairs: temporary name, rename)."""
    if path and os.path.exists(path):
        pairs, extra = ofsd.load_pairs(path)
        return pairs, extra["before"], extra["seconds"]
    t0 = time.time()
    pairs, before = mine_them()
    seconds = time.time() - t0
    if path:
        ofsd.save_pairs(path, pairs, dict(before=before, seconds=seconds))
    return pairs, before, seconds


def saved_json(path, compute):
    """compute()'s JSON value, read from `path` when a run before this one wrote it, else written
    there before it is used (temporary name, rename): a resumed run does not compute it again."""
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    value = compute()
    if path:
        checkpoint.write_atomic(path, json.dumps(value))
    return value


def stats(vals):
    vals = [v for v in vals if v is not None]
    return (sum(vals) / len(vals), min(vals), max(vals)) if vals else None


def cell(vals, digits=3):
    s = stats(vals)
    return "-" if s is None else f"{s[0]:.{digits}f} [{s[1]:.{min(digits, 2)}f}, {s[2]:.{min(digits, 2)}f}]"
