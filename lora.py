"""Hand-written LoRA (Hu et al. 2021) for the Qwen2 model of model.py.

A wrapped projection computes  y = W x + b + (alpha / r) * B A dropout(x),  with A (r, in)
Kaiming-uniform and B (out, r) zero, so attaching an adapter leaves the model unchanged.
`disabled(model)` runs the same weights without the adapter: the OFSD teacher pass is exactly
that. `merge(model)` folds W <- W + (alpha / r) B A and removes the adapter. Adapters are saved
as safetensors with PEFT's tensor names (`base_model.model.<module>.lora_A.weight`) and an
`adapter_config.json`, so `peft.PeftModel.from_pretrained` loads what we save.

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
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    def __init__(self, base, r, alpha, dropout):
        super().__init__()
        self.base = base
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.dropout = nn.Dropout(dropout)
        dev, dt = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=dev, dtype=dt)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=dev, dtype=dt)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's initialisation
        nn.init.zeros_(self.lora_B.weight)
        self.enabled = True

    def forward(self, x):
        y = self.base(x)
        if self.enabled:  # in the adapter's dtype (float32 under bfloat16 mixed precision)
            x = self.dropout(x.to(self.lora_A.weight.dtype))
            y = y + (self.lora_B(self.lora_A(x)) * self.scaling).to(y.dtype)
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


@torch.no_grad()
def merge(model):
    """W <- W + scaling * B @ A for every adapter, then replace each wrapper by its base Linear."""
    for name, m in _wrapped(model):
        dt = torch.promote_types(m.lora_B.weight.dtype, torch.float32)  # float32 at least
        delta = (m.lora_B.weight.to(dt) @ m.lora_A.weight.to(dt)) * m.scaling  # (out, in)
        w = m.base.weight
        if isinstance(w, DTensor):  # a sharded weight (FSDP2): add this rank's rows of delta
            delta = distribute_tensor(delta, w.device_mesh, w.placements, src_data_rank=None)
        w += delta.to(w.dtype)
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
    cfg_file = os.path.join(path, "adapter_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise ValueError(f"{cfg_file}: only plain LoRA adapters are supported")
    targets = cfg["target_modules"]
    attach(model, cfg["r"], cfg["lora_alpha"], cfg.get("lora_dropout", 0.0),
           tuple(targets) if isinstance(targets, list) else (targets,))
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python lora.py ADAPTER_DIR")
    print(open(os.path.join(sys.argv[1], "adapter_config.json")).read())
    with safe_open(os.path.join(sys.argv[1], "adapter_model.safetensors"), framework="pt") as f:
        for k in f.keys():
            print(k, tuple(f.get_slice(k).get_shape()))
