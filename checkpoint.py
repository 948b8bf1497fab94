"""A run's directory on disk: who owns it, its checkpoints, and resuming from them.

A run directory (evolve.py's out_dir) belongs to the run: a fresh run writes RUN_MARKER into it
first, and only refuses or (with --overwrite=true) replaces an earlier run's own files
(RUN_FILES); a directory without the marker that is not empty is never touched. A checkpoint
is written as checkpoint.tmp, then swapped in by two renames (checkpoint -> checkpoint.old,
checkpoint.tmp -> checkpoint), so a kill at any instant leaves a whole checkpoint or
checkpoint.old; `recover` takes whichever is there. It holds the model (Hugging Face format,
gathered on rank 0 when sharded; or, for a run that trains through LoRA adapters, the policy folder
of lora.save_policy: the base's name and hash and the adapters, megabytes), the optimizer (optimizer.pt, or when sharded an optimizer/
folder of torch.distributed.checkpoint with each rank's slices), state.json (loop position,
results, configuration, Python RNG) and one RNG file per rank, so a resumed run continues exactly
where the killed one stopped (on the same number of ranks).

`Run` holds all of it for evolve.py: the directory's checks, the loop's state, metrics.jsonl, the
LoRA chain of a run that trains through adapters, and the checkpoint at the end of each round.
`save_pairs` / `load_pairs` keep an OFSD round's mined pairs (an experiment resumed on the same pairs).

Left out: sharded model files (a 7B model is gathered on rank 0: 30 GB of host memory),
keeping more than the last checkpoint.
"""

import dataclasses
import json
import os
import shutil
import time

import torch
import torch.distributed as dist

import fsdp
import lora
from model import save
from ofsd import Pair
from rollout import Trajectory


def barrier():
    """Wait for every rank (a no-op in one process)."""
    if dist.is_initialized():
        dist.barrier()


RUN_MARKER = "evolve-run.json"  # written first into a fresh out_dir: the directory holds a run of ours
RUN_FILES = (RUN_MARKER, "adapters", "checkpoint", "checkpoint.tmp", "checkpoint.old", "metrics.jsonl", "results.md",
             "results.md.tmp", "curves.svg", "curves.svg.tmp")


def check_run_dir(out_dir, overwrite):
    """A fresh run needs an out_dir that is new, empty, or (with --overwrite=true) an earlier run's."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SystemExit(f"--out_dir={out_dir}: is a file, not a directory")
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    if not os.path.isfile(os.path.join(out_dir, RUN_MARKER)):
        raise SystemExit(f"--out_dir={out_dir}: exists, is not empty and holds no run of evolve.py "
                         f"(no {RUN_MARKER}); nothing was changed: name a new or empty directory")
    if not overwrite:
        raise SystemExit(f"--out_dir={out_dir}: holds an earlier run; --resume continues it, "
                         "--overwrite=true replaces its files (and only those)")


def claim_run_dir(out_dir):
    """Remove an earlier run's own files (RUN_FILES, nothing else), then write the marker first."""
    for name in RUN_FILES:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    os.makedirs(out_dir, exist_ok=True)
    write_atomic(os.path.join(out_dir, RUN_MARKER), json.dumps(dict(created=time.strftime("%Y-%m-%d %H:%M:%S"))))


def check_resume(ckpt_dir, config, world_size, may_change):
    """--resume needs a checkpoint written with the same settings (`may_change` aside) and ranks."""
    state_file = next((os.path.join(d, "state.json") for d in (ckpt_dir, ckpt_dir + ".old")
                       if os.path.isfile(os.path.join(d, "state.json"))), None)
    if state_file is None:
        raise SystemExit(f"--resume: no checkpoint in {os.path.dirname(ckpt_dir) or '.'} "
                         f"({ckpt_dir}/state.json missing); run without --resume to start")
    with open(state_file) as f:
        state = json.load(f)
    stored = state.get("config", {})
    changed = sorted(k for k in set(stored) | set(config)
                     if k not in may_change and stored.get(k, "<missing>") != config.get(k, "<missing>"))
    if changed:
        raise SystemExit(f"--resume: {state_file} was written with other settings: " +
                         ", ".join(f"{k}={stored.get(k, '<missing>')!r} (now {config.get(k, '<missing>')!r})"
                                   for k in changed) +
                         f"; only {', '.join(may_change)} may change on resume")
    if state.get("world_size", 1) != world_size:
        raise SystemExit(f"--resume: {state_file} was written by {state.get('world_size', 1)} ranks, "
                         f"this run has {world_size}")


def keep_first_lines(path, n):
    """Cut a JSON-lines file to its first n lines (temp file, then rename)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()[:n]
    write_atomic(path, "".join(lines))


def write_atomic(path, text):
    """Write `text` to `path` under a temporary name, then rename: a reader never sees half a file."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def save_checkpoint(ckpt_dir, policy, tokenizer, optimizer, rng, gen, state, rank, chain=None):
    """Write checkpoint.tmp (the model in Hugging Face format, or with `chain` the policy folder it
    names, and state.json from rank 0; the optimizer, per rank when sharded, unless None; each
    rank's RNG state), then swap it in with two renames. A kill at any instant leaves checkpoint or
    checkpoint.old whole. Every rank must call it."""
    tmp = ckpt_dir + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    weights = fsdp.full_state_dict(policy) if chain is None else None  # gathered on rank 0 when sharded
    if rank == 0:
        if chain is None:
            save(policy, tokenizer, os.path.join(tmp, "model"), weights)
        else:
            lora.save_policy(os.path.join(tmp, "model"), chain)
        py = rng.getstate()
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump(dict(state, py_rng=[py[0], list(py[1]), py[2]]), f)
    if optimizer is not None:
        fsdp.save_optimizer(policy, optimizer, os.path.join(tmp, "optimizer"))
    torch.save(dict(gen=gen.get_state(), torch=torch.get_rng_state()), os.path.join(tmp, f"rng{rank}.pt"))
    barrier()
    if rank == 0:
        if os.path.exists(ckpt_dir):
            shutil.rmtree(ckpt_dir + ".old", ignore_errors=True)  # what a kill left of the last swap's cleanup
            os.replace(ckpt_dir, ckpt_dir + ".old")
        os.replace(tmp, ckpt_dir)
        shutil.rmtree(ckpt_dir + ".old", ignore_errors=True)
    barrier()


def fork_run(src, dst, config):
    """Copy the run in `src` to `dst` with `config`'s settings written into its checkpoint's
    configuration, so that `evolve.py --resume` continues it as that variant: the run the variant
    makes from scratch, as long as nothing before src's checkpoint reads the changed settings (an
    ablation forks a GRPO-only first round into OFSD variants: no OFSD setting is read before the
    first OFSD round, and a resume restores every random state)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    if os.path.exists(os.path.join(dst, "results.md")):
        os.remove(os.path.join(dst, "results.md"))  # written when the variant's run ends
    state_file = os.path.join(dst, "checkpoint", "state.json")
    with open(state_file) as f:
        state = json.load(f)
    state["config"].update(config)
    write_atomic(state_file, json.dumps(state))


def recover(ckpt_dir, rank):
    """The last checkpoint's model folder, after finishing a swap a kill interrupted."""
    if rank == 0 and not os.path.exists(ckpt_dir) and os.path.exists(ckpt_dir + ".old"):
        os.replace(ckpt_dir + ".old", ckpt_dir)  # killed between the checkpoint's two renames
    barrier()
    return os.path.join(ckpt_dir, "model")


def load_checkpoint(ckpt_dir, policy, optimizer, rank, rng, gen):
    """Restore the optimizer (onto the policy as laid out now; None: none was saved), rng, gen;
    returns the run state."""
    with open(os.path.join(ckpt_dir, "state.json")) as f:
        state = json.load(f)
    if optimizer is not None:
        fsdp.load_optimizer(policy, optimizer, os.path.join(ckpt_dir, "optimizer"))
    rng_state = torch.load(os.path.join(ckpt_dir, f"rng{rank}.pt"), weights_only=True)
    gen.set_state(rng_state["gen"])
    torch.set_rng_state(rng_state["torch"])
    rng.setstate((state["py_rng"][0], tuple(state["py_rng"][1]), state["py_rng"][2]))
    if rank == 0:
        print(f"resumed from {ckpt_dir}: {state['done']} rounds done")
    return state


class Run:
    """evolve.py's out_dir, one object: checked when made (a fresh run's directory, or --resume's
    checkpoint and settings), claimed before the first write, the loop's state (rounds done, GRPO
    steps, evaluation rows, lines in metrics.jsonl), one record a line, and, for a run that trains
    through LoRA adapters, the chain of them (lora.save_policy) that its checkpoint is."""

    def __init__(self, out_dir, config, rank, world_size, may_change):
        self.out_dir, self.config, self.rank, self.resume = out_dir, config, rank, config["resume"]
        self.ckpt_dir, self.metrics_path = os.path.join(out_dir, "checkpoint"), os.path.join(out_dir, "metrics.jsonl")
        if self.resume:
            check_resume(self.ckpt_dir, config, world_size, may_change)
        else:
            check_run_dir(out_dir, config["overwrite"])
        self.state = dict(done=0, step=0, results=[], metrics_lines=0, world_size=world_size)
        self.chain = None  # a LoRA run's base and adapters, in merge order

    def load_policy(self, start_model, device, dtype, lora_chain):
        """The policy in `dtype`: the start model, or the last checkpoint's when resuming (a fresh
        run claims its directory first). With `lora_chain` the run keeps its policy as a chain."""
        if not self.resume and self.rank == 0:
            claim_run_dir(self.out_dir)
        barrier()
        path = recover(self.ckpt_dir, self.rank) if self.resume else start_model
        self.chain = lora.read_chain(path) if lora_chain else None
        return lora.load_policy(path, device, dtype)[0]

    def restore(self, policy, optimizer, rng, gen):
        """When resuming: the optimizer, the random states and the loop's state from the checkpoint;
        metrics.jsonl loses the lines a killed round wrote after it (they are written again)."""
        if self.resume:
            self.state = load_checkpoint(self.ckpt_dir, policy, optimizer, self.rank, rng, gen)
            if self.rank == 0:
                keep_first_lines(self.metrics_path, self.state["metrics_lines"])

    def record(self, row, line):
        """One JSON line in metrics.jsonl (none when row is None) and one printed line, on rank 0."""
        if self.rank == 0:
            if row is not None:
                with open(self.metrics_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                self.state["metrics_lines"] += 1
            print(line, flush=True)

    def adapter_dir(self, name):
        """Where a LoRA run saves the adapter `name` (None for a run that keeps whole weights)."""
        return os.path.join(self.out_dir, "adapters", name) if self.chain is not None else None

    def merge(self, policy, params, name):
        """The end of a round that trained the adapter `params`: merged into the policy; a LoRA run
        first saves it as `name` in its chain, and a policy it holds in bfloat16 (fsdp.wrap) takes
        the chain merged in float32 (lora.rebase)."""
        lora.merge_trained(policy, params, self.adapter_dir(name))
        if self.chain is not None:
            self.chain["adapters"].append(self.adapter_dir(name))
            if policy.lm_head_weight.dtype.itemsize < 4:
                lora.rebase(policy, self.chain)

    def save(self, policy, tokenizer, optimizer, rng, gen):
        """One more round done: the checkpoint (the chain's base hashed once, on the first)."""
        self.state["done"] += 1
        if self.chain is not None and self.rank == 0:
            self.chain["base_sha256"] = self.chain["base_sha256"] or lora.weights_sha256(self.chain["base"])
        save_checkpoint(self.ckpt_dir, policy, tokenizer, optimizer, rng, gen, dict(self.state, config=self.config),
                        self.rank, self.chain)
        fsdp.trim_host_memory()  # the checkpoint's serialized copies (gigabytes for a real model)


# ---------------------------------------------------------------------------------------------
# mined OFSD pairs on disk (an experiment resumed on the same pairs)

def save_pairs(path, pairs, extra):
    """Write mined pairs (and a dict of what else the caller keeps with them) as JSON, atomically."""
    write_atomic(path, json.dumps(dict(extra=extra, pairs=[
        dict(ref=dataclasses.asdict(p.ref), stu=dataclasses.asdict(p.stu), incorrect=p.incorrect,
             golds=list(p.golds), group=[[list(qs), r] for qs, r in p.group]) for p in pairs])))


def load_pairs(path):
    """(pairs, extra) as save_pairs wrote them (a file without "extra": its other keys)."""
    with open(path) as f:
        saved = json.load(f)
    extra = saved.get("extra", {k: v for k, v in saved.items() if k != "pairs"})
    return [Pair(Trajectory(**p["ref"]), Trajectory(**p["stu"]), p["incorrect"], tuple(p["golds"]),
                 tuple((tuple(qs), r) for qs, r in p.get("group", ()))) for p in saved["pairs"]], extra
