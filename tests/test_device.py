"""The one place that picks device and dtype (fsdp.device_and_dtype, fsdp.setup), checked on CPU
against the contract torch enforces on CUDA device strings (torch.cuda.set_device's
_get_device_index), with CUDA's presence and the CPU's bfloat16 flags patched."""

import os
import sys

import pytest
import torch
from torch.cuda._utils import _get_device_index

import eval as evaluation
import fsdp


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine that reports one CUDA device, whose set_device checks its argument as torch does."""
    seen = []

    def set_device(dev):
        seen.append(_get_device_index(dev))  # raises for "cuda" without an index, as torch 2.13 does

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    return seen


@pytest.mark.parametrize("device,local_rank,want", [("auto", None, "cuda:0"), ("cuda", None, "cuda:0"),
                                                     ("cuda", "3", "cuda:3"), ("cuda:1", "3", "cuda:1")])
def test_cuda_device_strings_carry_an_index(one_gpu, monkeypatch, device, local_rank, want):
    """Every CUDA device string device_and_dtype builds names its index and passes torch's check."""
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    dev, dt = fsdp.device_and_dtype(device, "auto", 896)
    assert dev == want and dt == torch.bfloat16
    assert _get_device_index(dev) == int(want.split(":")[1])


def test_setup_on_one_gpu_without_torchrun(one_gpu):
    """fsdp.setup (evolve.py's) on a one-GPU machine sets cuda:0 instead of raising on a bare "cuda"."""
    rank, world_size, dev, dt = fsdp.setup("auto", "float32", 896)  # float32: no process group to start
    assert (rank, world_size, dev, dt) == (0, 1, "cuda:0", torch.float32)
    assert one_gpu == [0]


@pytest.mark.parametrize("native,width,want", [(True, 896, torch.bfloat16), (True, 128, torch.float32),
                                               (False, 896, torch.float32), (False, 128, torch.float32)])
def test_auto_dtype_on_cpu(monkeypatch, native, width, want):
    """On CPU "auto" is bfloat16 only for a real checkpoint's width on a CPU with native bfloat16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(fsdp, "cpu_has_native_bf16", lambda: native)
    assert fsdp.device_and_dtype("auto", "auto", width) == ("cpu", want)
    assert fsdp.device_and_dtype("cpu", "float32", width) == ("cpu", torch.float32)  # asked for: kept


def test_eval_uses_the_auto_dtype(monkeypatch, tiny_checkpoint, search_index, tmp_path):
    """eval.py with no --dtype loads a real-width checkpoint in bfloat16 on a native-bfloat16 CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(fsdp, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(fsdp, "BF16_MIN_HIDDEN", 64)  # the tiny checkpoint's width counts as real here
    loaded, real_load = [], evaluation.load_policy

    def load(path, device, dtype):
        loaded.append((device, dtype))
        return real_load(path, device, dtype)

    monkeypatch.setattr(evaluation, "load_policy", load)
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "which river flows through Paris", "golden_answers": ["Seine"]}\n')
    index_dir = search_index.doc_offsets.filename.rsplit("/", 1)[0]
    monkeypatch.setattr(sys, "argv", ["eval.py", f"--model_dir={tiny_checkpoint}", f"--index_dir={index_dir}",
                                      f"--data={data}", f"--out_file={tmp_path / 'out.jsonl'}", "--max_turns=1",
                                      "--max_turn_tokens=4", "--max_obs_tokens=8"])
    evaluation.main()
    assert loaded == [("cpu", torch.bfloat16)]


def test_a_cpu_bounds_the_matmul_kernel_caches_and_keeps_a_users_bound(monkeypatch):
    """On a CPU, oneDNN's and ideep's per-shape caches are bounded, unless the user set a bound."""
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    fsdp.device_and_dtype("cpu", "auto", 896)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == fsdp.MATMUL_SHAPES and os.environ["LRU_CACHE_CAPACITY"] == "7"
