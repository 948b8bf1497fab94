"""Hand-written LoRA (Hu et al. 2021) for the Qwen2 model of model.py.

A wrapped projection computes  y = W x + b + (alpha / r) * B A dropout(x),  with A (r, in)
Kaiming-uniform and B (out, r) zero, so attaching an adapter leaves the model unchanged.
`disabled(model)` runs the same weights without the adapter: the OFSD teacher pass is exactly
that. `merge(model)` folds W <- W + (alpha / r) B A and removes the adapter. Adapters are saved
as safetensors with PEFT's tensor names (`base_model.model.<module>.lora_A.weight`) and an
`adapter_config.json`, so `peft.PeftModel.from_pretrained` loads what we save.

A policy trained through adapters is its base checkpoint and the ordered adapters merged into it
(`save_policy`): a folder with policy.json (the base's path and the SHA-256 of its weights, the
adapters in order, each with the SHA-256 of its files) and a copy of each adapter, a few megabytes
where the weights are gigabytes. `load_policy` reads either that or a plain checkpoint folder, and
refuses a base or an adapter whose bytes are not the ones policy.json names; merging the same
float32 adapters into the same float32 base in the same order gives the same weights, bit for bit.

Left out: DoRA, rsLoRA, bias training, several named adapters at once, quantized bases.

    python lora.py ADAPTER_DIR          # print the adapter's config and tensor shapes
"""

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

import fsdp
from model import load, read_tensors

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    def __init__(self, base, r, alpha, dropout):
        super().__init__()
        self.base = base
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.dropout = nn.Dropout(dropout)
        dev, dt = base.weight.device, torch.promote_types(base.weight.dtype, torch.float32)  # float32 at least
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=dev, dtype=dt)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=dev, dtype=dt)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's initialisation
        nn.init.zeros_(self.lora_B.weight)
        self.enabled = True

    def forward(self, x):
        y = self.base(x)
        if self.enabled:  # float32 weights, their matmuls in x's dtype (mixed precision, as FSDP2 runs every
            # weight): a bfloat16 step makes no float32 copy of x; the update added in place
            a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)  # (r, in), (out, r)
            z = F.linear(F.linear(self.dropout(x), a), b)  # (..., out)
            y.add_(z.mul_(self.scaling))
        return y


def _wrapped(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def attach(model, r, alpha, dropout=0.0, targets=TARGETS):
    """Wrap every nn.Linear whose name ends in one of `targets`; freeze all base weights."""
    if _wrapped(model):
        raise ValueError("model already has a LoRA adapter")
    for p in model.parameters():
        p.requires_grad_(False)
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets]
    if not names:
        raise ValueError(f"no nn.Linear named any of {targets}")
    for name in names:
        parent_name, child = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), r, alpha, dropout))
    params = [p for _, m in _wrapped(model) for p in (m.lora_A.weight, m.lora_B.weight)]
    fsdp.replicate(params)  # a sharded base: every rank starts from rank 0's adapter
    return params


@contextlib.contextmanager
def disabled(model):
    """Run `model` with its adapter switched off (the base weights alone)."""
    mods = [m for _, m in _wrapped(model)]
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, e in zip(mods, before):
            m.enabled = e


def _delta(a, b, scaling):
    """An adapter's update scaling * B @ A, (out, in), in float32 at least."""
    dt = torch.promote_types(b.dtype, torch.float32)
    return (b.to(dt) @ a.to(dt)) * scaling


@torch.no_grad()
def merge(model):
    """W <- W + scaling * B @ A for every adapter, then replace each wrapper by its base Linear."""
    for name, m in _wrapped(model):
        delta = _delta(m.lora_A.weight, m.lora_B.weight, m.scaling)  # (out, in)
        w = m.base.weight
        if isinstance(w, DTensor):  # a sharded weight (FSDP2): add this rank's rows of delta
            delta = distribute_tensor(delta, w.device_mesh, w.placements, src_data_rank=None)
        w += delta.to(w.dtype)
        parent_name, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), child, m.base)
    return model


def merge_trained(model, params, adapter_dir=None):
    """End of a round that trained the adapter `params`: the same adapter on every rank (rank 0's),
    saved to `adapter_dir` in PEFT's format when given, merged into the base weights, which train again."""
    fsdp.replicate(params)  # guard against non-deterministic kernels: rank 0's adapter for all
    if adapter_dir is not None and fsdp.rank() == 0:
        save_adapter(model, adapter_dir)
    fsdp.reshard(model)  # a sharded base takes each rank's slice of the merged update
    merge(model)
    for p in model.parameters():
        p.requires_grad_(True)


def save_adapter(model, path):
    """Write adapter_model.safetensors + adapter_config.json in PEFT's format (temp folder, rename)."""
    mods = _wrapped(model)
    if not mods:
        raise ValueError("model has no LoRA adapter to save")
    m0 = mods[0][1]
    state = {}
    for name, m in mods:
        state[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.weight.detach().contiguous().cpu()
        state[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.weight.detach().contiguous().cpu()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": m0.r, "lora_alpha": m0.alpha,
              "lora_dropout": m0.dropout.p, "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted({n.rsplit(".", 1)[-1] for n, _ in mods}),
              "init_lora_weights": True, "inference_mode": True, "use_rslora": False,
              "use_dora": False, "modules_to_save": None, "base_model_name_or_path": None}
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(state, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def load_adapter(model, path):
    """Attach the adapter saved at `path` (ours or PEFT's) to `model`; every tensor must fit."""
    cfg = _adapter_config(path)
    attach(model, cfg["r"], cfg["lora_alpha"], cfg.get("lora_dropout", 0.0), cfg["target_modules"])
    params = {f"base_model.model.{n}.{ab}.weight": getattr(m, ab).weight
              for n, m in _wrapped(model) for ab in ("lora_A", "lora_B")}
    file = os.path.join(path, "adapter_model.safetensors")
    with safe_open(file, framework="pt", device="cpu") as f, torch.no_grad():
        keys = set(f.keys())
        if keys != set(params):
            raise ValueError(f"{file}: tensors do not match the model: "
                             f"{sorted(keys ^ set(params))[:4]}")
        for k in keys:
            t = f.get_tensor(k)
            if t.shape != params[k].shape:
                raise ValueError(f"{file}: tensor {k!r} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(params[k].shape)}")
            params[k].copy_(t)
    return model


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
    adapters = [_adapter_tensors(a) for a in chain["adapters"]]
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
                w += _delta(a, b, scaling).to(w.dtype)
        p.copy_(w)
    fsdp.trim_host_memory()


def _adapter_config(path):
    """The adapter_config.json at `path`, refused unless plain LoRA; target_modules as a tuple."""
    cfg_file = os.path.join(path, "adapter_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise ValueError(f"{cfg_file}: only plain LoRA adapters are supported")
    targets = cfg["target_modules"]
    return dict(cfg, target_modules=tuple(targets) if isinstance(targets, list) else (targets,))


def _adapter_tensors(path):
    """(file, {module name: (A, B)}, scaling, target module names) of the adapter saved at `path`."""
    cfg = _adapter_config(path)
    file, ab = os.path.join(path, "adapter_model.safetensors"), {}
    with safe_open(file, framework="pt", device="cpu") as f:
        for k in f.keys():  # base_model.model.<module>.lora_A.weight
            name, part, _ = k.removeprefix("base_model.model.").rsplit(".", 2)
            ab.setdefault(name, {})[part] = f.get_tensor(k)
    if any(set(t) != {"lora_A", "lora_B"} for t in ab.values()):
        raise ValueError(f"{file}: every module needs lora_A.weight and lora_B.weight")
    return file, {n: (t["lora_A"], t["lora_B"]) for n, t in ab.items()}, cfg["lora_alpha"] / cfg["r"], cfg["target_modules"]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python lora.py ADAPTER_DIR")
    print(open(os.path.join(sys.argv[1], "adapter_config.json")).read())
    with safe_open(os.path.join(sys.argv[1], "adapter_model.safetensors"), framework="pt") as f:
        for k in f.keys():
            print(k, tuple(f.get_slice(k).get_shape()))
