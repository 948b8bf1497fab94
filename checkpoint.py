"""A run's directory on disk: who owns it, its checkpoints, and resuming from them.

A run directory (evolve.py's out_dir) belongs to the run: a fresh run writes RUN_MARKER into it
first, and only refuses or (with --overwrite=true) replaces an earlier run's own files
(RUN_FILES); a directory without the marker that is not empty is never touched. A checkpoint
is written as checkpoint.tmp, then swapped in by two renames (checkpoint -> checkpoint.old,
checkpoint.tmp -> checkpoint), so a kill at any instant leaves a whole checkpoint or
checkpoint.old; `recover` takes whichever is there. It holds the model (Hugging Face format,
gathered on rank 0 when sharded; or, for a run that trains through LoRA adapters, its policy
folder), the optimizer (optimizer.pt, or when sharded an optimizer/ folder of
torch.distributed.checkpoint with each rank's slices), state.json (loop position, results,
configuration, Python RNG) and one RNG file per rank, so a resumed run continues exactly where the
killed one stopped (on the same number of ranks).

A policy trained through adapters is its base checkpoint and the ordered adapters merged into it
(`save_policy`): a folder with policy.json (the base's path and the SHA-256 of its weights, the
adapters in order, each with the SHA-256 of its two files) and a copy of each adapter, megabytes
where the weights are gigabytes. `load_policy` reads either that or a plain checkpoint folder and
refuses a base or an adapter whose bytes are not the ones policy.json names; the same float32
adapters merged into the same base in the same order give the same weights, bit for bit.

`Run` holds it all for evolve.py: the directory's checks, the loop's state, metrics.jsonl, a LoRA
run's chain, the checkpoint at the end of each round. `save_pairs` / `load_pairs` keep mined pairs.

Left out: sharded model files (a 7B model is gathered on rank 0: 30 GB of host memory),
keeping more than the last checkpoint.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import time

import torch
import torch.nn as nn
import torch.distributed as dist

import fsdp
import lora
from model import load, read_tensors, save
from ofsd import Pair
from rollout import Trajectory


def barrier():
    """Wait for every rank (a no-op in one process)."""
    if dist.is_initialized():
        dist.barrier()


RUN_MARKER = "evolve-run.json"  # written first into a fresh out_dir: the directory holds a run of ours
RUN_FILES = (RUN_MARKER, "adapters", "checkpoint", "checkpoint.tmp", "checkpoint.old", "metrics.jsonl", "results.md",
             "results.md.tmp", "curves.svg", "curves.svg.tmp", "tokens.html", "tokens.html.tmp")


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
            save_policy(os.path.join(tmp, "model"), chain)
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
    through LoRA adapters, the chain of them (save_policy) that its checkpoint is."""

    def __init__(self, out_dir, config, rank, world_size, may_change):
        self.out_dir, self.config, self.rank, self.resume = out_dir, config, rank, config["resume"]
        self.ckpt_dir, self.metrics_path = os.path.join(out_dir, "checkpoint"), os.path.join(out_dir, "metrics.jsonl")
        if self.resume:
            check_resume(self.ckpt_dir, config, world_size, may_change)
        else:
            check_run_dir(out_dir, config["overwrite"])
        self.state = dict(done=0, step=0, results=[], metrics_lines=0, world_size=world_size, pages=[])  # pages: tokens.html
        self.chain = None  # a LoRA run's base and adapters, in merge order

    def load_policy(self, start_model, device, dtype, lora_chain):
        """The policy in `dtype`: the start model, or the last checkpoint's when resuming (a fresh
        run claims its directory first). With `lora_chain` the run keeps its policy as a chain."""
        if not self.resume and self.rank == 0:
            claim_run_dir(self.out_dir)
        barrier()
        path = recover(self.ckpt_dir, self.rank) if self.resume else start_model
        self.chain = read_chain(path) if lora_chain else None
        return load_policy(path, device, dtype)[0]

    def restore(self, policy, optimizer, rng, gen):
        """When resuming: the optimizer, the random states and the loop's state from the checkpoint;
        metrics.jsonl loses the lines a killed round wrote after it (they are written again). The run
        keeps the optimizer (None: a LoRA run's), to park it (`parked`)."""
        self.optimizer = optimizer
        if self.resume:
            self.state = dict(dict(pages=[]), **load_checkpoint(self.ckpt_dir, policy, optimizer, self.rank, rng, gen))
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

    def parked(self):
        """A round that does not step the run's optimizer (OFSD): its state waits on disk meanwhile."""
        return fsdp.parked(self.optimizer, os.path.join(self.ckpt_dir, f"parked-optimizer{self.rank}.pt"))

    def adapter_dir(self, name):
        """Where a LoRA run saves the adapter `name` (None for a run that keeps whole weights)."""
        return os.path.join(self.out_dir, "adapters", name) if self.chain is not None else None

    def merge(self, policy, params, name):
        """The end of a round that trained the adapter `params`: merged into the policy; a LoRA run
        first saves it as `name` in its chain, and a policy it holds in bfloat16 (fsdp.wrap) takes
        the chain merged in float32 (rebase). Returns how far the ranks' replicas had drifted apart."""
        drift = merge_adapter(policy, params, self.adapter_dir(name))
        if self.chain is not None:
            self.chain["adapters"].append(self.adapter_dir(name))
            if policy.lm_head_weight.dtype.itemsize < 4:
                rebase(policy, self.chain)
        return drift

    def save(self, policy, tokenizer, optimizer, rng, gen):
        """One more round done: the checkpoint (the chain's base hashed once, on the first)."""
        self.state["done"] += 1
        if self.chain is not None and self.rank == 0:
            self.chain["base_sha256"] = self.chain["base_sha256"] or weights_sha256(self.chain["base"])
        save_checkpoint(self.ckpt_dir, policy, tokenizer, optimizer, rng, gen, dict(self.state, config=self.config),
                        self.rank, self.chain)
        fsdp.trim_host_memory()  # the checkpoint's serialized copies (gigabytes for a real model)


def merge_adapter(policy, params, adapter_dir=None):
    """The end of a round that trained the adapter `params`: the same adapter on every rank (rank 0's,
    a guard against non-deterministic kernels), saved to `adapter_dir` in PEFT's format when given,
    merged into the base weights (a sharded weight takes its slice), which train again. Returns how far
    the ranks' replicas had drifted apart (0.0 when every rank held the same adapter)."""
    drift = fsdp.replicate(params)
    if adapter_dir is not None and fsdp.rank() == 0:
        lora.save_adapter(policy, adapter_dir)
    fsdp.reshard(policy)
    lora.merge(policy, part=fsdp.shard_like if fsdp.is_sharded(policy) else None)
    for p in policy.parameters():
        p.requires_grad_(True)
    return drift


# ---------------------------------------------------------------------------------------------
# a policy folder: a base checkpoint and the adapters merged into it, each named by its SHA-256

POLICY_FILE = "policy.json"  # a policy folder: a base checkpoint and the adapters merged into it


def weights_sha256(model_dir):
    """SHA-256 over a checkpoint's weight files (*.safetensors, in name order): the base's identity."""
    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        with open(os.path.join(model_dir, name), "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_sha256(adapter_dir):
    """SHA-256 over an adapter's two files (config, then weights): the adapter's identity."""
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        with open(os.path.join(adapter_dir, name), "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()


def read_chain(path):
    """A policy folder as {"base", "base_sha256", "adapters": [absolute adapter dirs, in merge order],
    "adapters_sha256": [each adapter's adapter_sha256]}; a plain checkpoint folder is its own base with
    no adapters (its hash taken when first needed: None)."""
    file = os.path.join(path, POLICY_FILE)
    if not os.path.isfile(file):
        return dict(base=os.path.abspath(path), base_sha256=None, adapters=[], adapters_sha256=[])
    with open(file) as f:
        cfg = json.load(f)
    if not {"base", "base_sha256", "adapters", "adapters_sha256"} <= set(cfg):
        raise ValueError(f"{file}: needs base, base_sha256, adapters and adapters_sha256")
    if len(cfg["adapters"]) != len(cfg["adapters_sha256"]):
        raise ValueError(f"{file}: {len(cfg['adapters'])} adapters but {len(cfg['adapters_sha256'])} hashes")
    return dict(base=os.path.expanduser(cfg["base"]), base_sha256=cfg["base_sha256"],
                adapters=[os.path.join(path, a) for a in cfg["adapters"]], adapters_sha256=list(cfg["adapters_sha256"]))


def check_chain(path, chain):
    """Refuse a policy folder whose base weights or any adapter's files are not the bytes policy.json names."""
    file = os.path.join(path, POLICY_FILE)
    if not os.path.isdir(chain["base"]):
        raise FileNotFoundError(f"{file}: base checkpoint {chain['base']} not found")
    if weights_sha256(chain["base"]) != chain["base_sha256"]:
        raise ValueError(f"{file}: the weights in {chain['base']} are not the base it "
                         f"was trained from (SHA-256 {chain['base_sha256'][:12]}...)")
    for adapter, sha in zip(chain["adapters"], chain["adapters_sha256"]):
        if not all(os.path.isfile(os.path.join(adapter, n)) for n in ADAPTER_FILES):
            raise FileNotFoundError(f"{file}: adapter {adapter} not found")
        if adapter_sha256(adapter) != sha:
            raise ValueError(f"{file}: adapter {adapter} is not the one it was trained with "
                             f"(SHA-256 {sha[:12]}...)")


def policy_sha256(path):
    """One SHA-256 for what a folder loads as: a plain checkpoint's weights, or a policy's base and
    adapters in order (the hashes policy.json records, checked first)."""
    chain = read_chain(path)
    if chain["base_sha256"] is None:
        return weights_sha256(path)
    check_chain(path, chain)
    return hashlib.sha256(" ".join([chain["base_sha256"]] + chain["adapters_sha256"]).encode()).hexdigest()


def base_dir(path):
    """The folder holding the weights' config.json and tokenizer.json: a policy folder's base, else `path`."""
    return read_chain(path)["base"]


def save_policy(path, chain, base_name=None):
    """Write `chain` (read_chain's form) as a policy folder at `path`: policy.json and a copy of each
    adapter as adapters/NN-name (temporary folder, then rename). base_name: the base as policy.json
    names it (default: its path), e.g. "~/.cache/qwen2.5-coder-0.5b-instruct" for a committed policy."""
    sha = chain["base_sha256"] or weights_sha256(chain["base"])
    adapter_shas = [adapter_sha256(a) for a in chain["adapters"]]
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "adapters"))
    names = []
    for i, src in enumerate(chain["adapters"]):
        names.append(os.path.join("adapters", f"{i:02d}-{os.path.basename(src.rstrip('/')).split('-', 1)[-1]}"))
        shutil.copytree(src, os.path.join(tmp, names[-1]))
    with open(os.path.join(tmp, POLICY_FILE), "w") as f:
        json.dump(dict(base=base_name or chain["base"], base_sha256=sha, adapters=names,
                       adapters_sha256=adapter_shas), f, indent=2)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)
    return dict(chain, base_sha256=sha, adapters_sha256=adapter_shas)


def load_policy(path, device="cpu", dtype=torch.float32):
    """(model, tokenizer) from a checkpoint folder or a policy folder: the base with each adapter merged
    in order, in float32, then cast to `dtype` (`merged`). A base or an adapter whose bytes are not the
    ones policy.json names is refused, by name."""
    chain = read_chain(path)
    if chain["base_sha256"] is None:  # a plain checkpoint folder
        return load(path, device, dtype)
    check_chain(path, chain)
    model, tokenizer = merged(chain, device, dtype)
    for p in model.parameters():
        p.requires_grad_(True)
    return model, tokenizer


def merged(chain, device="cpu", dtype=torch.float32):
    """(model, tokenizer): the chain's base in `dtype`, then `rebase`d: never a float32 model."""
    model, tokenizer = load(chain["base"], device, dtype)
    rebase(model, chain)
    return model, tokenizer


@torch.no_grad()
def rebase(model, chain):
    """Every weight of `model` (the chain's base, in any dtype, with the chain's adapters merged or
    not) that an adapter touches becomes the base's weight read in float32, every adapter's update
    added in order (merge's arithmetic), then cast: one weight at a time, in place. A policy held in
    bfloat16 merges so: an update added to bfloat16 weights would be rounded away."""
    adapters = [lora.adapter_tensors(a) for a in chain["adapters"]]
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for file, ab, _, targets in adapters:
        want = {n for n in linears if n.rsplit(".", 1)[-1] in targets}
        if set(ab) != want:
            raise ValueError(f"{file}: tensors do not match the model: {sorted(set(ab) ^ want)[:4]}")
    params = dict(model.named_parameters())
    for _, name, w in read_tensors(chain["base"], {f"{n}.weight" for _, ab, _, _ in adapters for n in ab}):
        p = params[name]
        w = w.to(torch.promote_types(p.dtype, torch.float32))  # (out, in)
        for file, ab, scaling, _ in adapters:
            a, b = ab.get(name.removesuffix(".weight"), (None, None))  # (r, in), (out, r)
            if a is not None:
                if (b.shape[0], a.shape[1]) != tuple(w.shape):
                    raise ValueError(f"{file}: the update of {name!r} is {(b.shape[0], a.shape[1])}, the weight {tuple(w.shape)}")
                w += lora.delta(a, b, scaling).to(w.dtype)
        p.copy_(w)
    fsdp.trim_host_memory()  # the float32 copies just let go


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
