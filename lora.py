"""Hand-written LoRA (Hu et al. 2021) for the Qwen2 model of model.py.

A wrapped projection computes  y = W x + b + (alpha / r) * B A dropout(x),  with A (r, in)
Kaiming-uniform and B (out, r) zero, so attaching an adapter leaves the model unchanged.
`disabled(model)` runs the same weights without the adapter: the OFSD teacher pass is exactly
that. `merge(model)` folds W <- W + (alpha / r) B A and removes the adapter. Adapters are saved
as safetensors with PEFT's tensor names (`base_model.model.<module>.lora_A.weight`) and an
`adapter_config.json`, so `peft.PeftModel.from_pretrained` loads what we save. A policy kept as a
base and a chain of adapters (hashes, rebase) is checkpoint.py's; ranks are fsdp.py's (a sharded
weight takes its slice of an update through merge's `part`).

Left out: DoRA, rsLoRA, bias training, several named adapters at once, quantized bases.

    python lora.py ADAPTER_DIR          # print the adapter's config and tensor shapes
"""

import contextlib
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
    return [p for _, m in _wrapped(model) for p in (m.lora_A.weight, m.lora_B.weight)]


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


def delta(a, b, scaling):
    """An adapter's update scaling * B @ A, (out, in), in float32 at least."""
    dt = torch.promote_types(b.dtype, torch.float32)
    return (b.to(dt) @ a.to(dt)) * scaling


@torch.no_grad()
def merge(model, part=None):
    """W <- W + scaling * B @ A for every adapter, then replace each wrapper by its base Linear.
    part(update, W): the share of a whole (out, in) update that this process's W takes (a sharded
    weight: its rows, fsdp.shard_like); None: all of it."""
    for name, m in _wrapped(model):
        update = delta(m.lora_A.weight, m.lora_B.weight, m.scaling)  # (out, in)
        w = m.base.weight
        w += (update if part is None else part(update, w)).to(w.dtype)
        parent_name, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), child, m.base)
    return model


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
    cfg = adapter_config(path)
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


def adapter_config(path):
    """The adapter_config.json at `path`, refused unless plain LoRA; target_modules as a tuple."""
    cfg_file = os.path.join(path, "adapter_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise ValueError(f"{cfg_file}: only plain LoRA adapters are supported")
    targets = cfg["target_modules"]
    return dict(cfg, target_modules=tuple(targets) if isinstance(targets, list) else (targets,))


def adapter_tensors(path):
    """(file, {module name: (A, B)}, scaling, target module names) of the adapter saved at `path`."""
    cfg = adapter_config(path)
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
