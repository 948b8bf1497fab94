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

import hashlib
import json
import os
import platform
import subprocess
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoint  # noqa: E402
import evolve  # noqa: E402
import fsdp  # noqa: E402

def machine():
    """This CPU as a row records it: its model name and which native bfloat16 paths it has."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = set(value.split())
    except OSError:
        pass
    return dict(cpu=name, avx512_bf16="avx512_bf16" in flags, amx_bf16="amx_bf16" in flags)


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def commit():
    """The checkout's commit, with "+changes" when tracked files differ from it (None outside git)."""
    def git(*a):
        return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True)
    head = git("rev-parse", "HEAD")
    if head.returncode:
        return None
    return head.stdout.strip() + ("+changes" if git("status", "--porcelain", "--untracked-files=no").stdout.strip() else "")


def provenance(policy_dir, pairs_file, training, threads=None):
    """What made a row, for every row `experiments/` writes: this machine (CPU, bfloat16 / AMX flags),
    torch and its threads (this process's, or `threads` for the runs it starts), the commit, the SHA-256
    of the policy (checkpoint.policy_sha256) and of the pairs file, and the training settings (`training`:
    rank, alpha, lr, epochs, steps, ...)."""
    return dict(machine(), torch=torch.__version__, threads=threads or torch.get_num_threads(), commit=commit(),
                policy_sha256=checkpoint.policy_sha256(policy_dir),
                pairs_sha256=file_sha256(pairs_file) if pairs_file and os.path.exists(pairs_file) else None,
                training=training)


PROTOCOL = ("max_turns", "max_turn_tokens", "max_obs_tokens", "top_k", "temperature", "top_p", "rollout_rows")


def policy(folder, dev, dt, checkpoint_layers=False):
    """A checkpoint or a policy folder (a base and its adapters, lora.py) in float32, sharded for
    bfloat16 compute when a process group is up (fsdp.setup), as evolve.py holds its policy."""
    model, tok = checkpoint.load_policy(folder, dev, torch.float32)
    if dist.is_initialized():
        fsdp.shard(model, dt)
    model.checkpoint_layers = checkpoint_layers
    return model, tok


def mined_pairs(path, mine_them):
    """(pairs, diagnostics, seconds) read from `path` when a run before this one wrote it, else
    `mine_them()`'s, written there before they are used (checkpoint.save_pairs: temporary name, rename)."""
    if path and os.path.exists(path):
        pairs, extra = checkpoint.load_pairs(path)
        return pairs, extra["before"], extra["seconds"]
    t0 = time.time()
    pairs, before = mine_them()
    seconds = time.time() - t0
    if path:
        checkpoint.save_pairs(path, pairs, dict(before=before, seconds=seconds))
    return pairs, before, seconds


def saved_diagnostics(path, compute, recompute_elsewhere=False):
    """compute()'s JSON value, read from `path` when a run before this one wrote it, else written there
    before it is used (temporary name, rename), for diagnostics whose floats depend on the CPU: the
    file carries the machine that computed it ("machine"); one from another CPU is recomputed when `recompute_elsewhere`, else read
    with a printed line that says where it came from (the value keeps its "machine")."""
    here = machine()
    if path and os.path.exists(path):
        with open(path) as f:
            value = json.load(f)
        if value.get("machine") == here:
            return value
        if not recompute_elsewhere:
            print(f"{path}: computed on {value.get('machine') or 'an unrecorded machine'}, not on this one "
                  f"({here['cpu']}); read as it is (--recompute_diagnostics computes it here)", flush=True)
            return value
    value = dict(compute(), machine=here)
    if path:
        checkpoint.write_atomic(path, json.dumps(value))
    return value


def stats(vals):
    vals = [v for v in vals if v is not None]
    return (sum(vals) / len(vals), min(vals), max(vals)) if vals else None


def cell(vals, digits=3):
    s = stats(vals)
    return "-" if s is None else f"{s[0]:.{digits}f} [{s[1]:.{min(digits, 2)}f}, {s[2]:.{min(digits, 2)}f}]"


def distill_round(model, tok, pairs, cfg, seed, log=None):
    """An OFSD round's distillation as evolve.py runs it (evolve.distill_round); log(epoch, step, loss)
    after it for each step."""
    m = evolve.distill_round(model, tok, pairs, cfg, seed)
    for n, (epoch, loss) in enumerate(zip(m.pop("epochs", []), m["losses"]), 1):
        if log:
            log(epoch, n, loss)
    return m
