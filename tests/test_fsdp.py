"""FSDP2 sharding and mixed precision (fsdp.py), on CPU with gloo: 2 ranks against 1 process.

The step tests run tests/sharded_steps.py (3 GRPO steps and an OFSD round on fixed trajectories
and pairs) once per layout and compare what rank 0 saved. Tolerances are the measured gaps with
some room: float32 on 2 ranks vs 1 process, losses and gradient norms within 1e-5 relative,
weights 2e-5 after GRPO and 5e-5 after OFSD (measured 8e-8 to 5e-7 on losses, 3.5e-6 relative on
a gradient norm of 18, 7.6e-7 and 5.9e-6 on weights, depending on the session's tiny agent: the
sum over ranks changes the float order); bfloat16 compute vs float32, losses 0.05, weights
after GRPO 0.01 (measured 0.044, 0.0059: three AdamW steps of lr 1e-3 each move a weight by at
most ~1e-3, so a gap of a few lr means a few gradient signs differ).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import model as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def run(cmd):
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def steps(micro, tmp_path_factory):
    """{layout: what rank 0 saved} for 1 process and 2 ranks, float32 and bfloat16 compute."""
    d = tmp_path_factory.mktemp("fsdp")
    model_dir = micro[0].split("=", 1)[1]
    out = {}
    for name, launcher, mode in (("one", [sys.executable], "float32"), ("two", TORCHRUN, "float32"),
                                 ("one_bf16", [sys.executable], "bfloat16"), ("two_bf16", TORCHRUN, "bfloat16"),
                                 ("one_recompute", [sys.executable], "checkpointing")):
        run(launcher + ["tests/sharded_steps.py", model_dir, str(d / f"{name}.pt"), mode])
        out[name] = torch.load(d / f"{name}.pt", weights_only=True)
    return out


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_ranks_grpo_matches_one_process(steps):
    """GRPO steps split over 2 ranks give 1 process's losses, gradient norms and weights (float32)."""
    one, two = steps["one"], steps["two"]
    for a, b in zip(one["steps"], two["steps"]):
        assert a["tokens"] == b["tokens"] and a["clip_frac"] == b["clip_frac"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"]))
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * max(1.0, a["grad_norm"])
    assert one["steps"][2]["clip_frac"] > 0  # the later updates are clipped: the ratio path is exercised
    assert max_diff(one["after_grpo"], two["after_grpo"]) < 2e-5


def test_two_ranks_ofsd_matches_one_process(steps):
    """An OFSD round (LoRA on the sharded base, teacher pass with it off, merge) matches 1 process."""
    one, two = steps["one"], steps["two"]
    assert max(abs(a - b) for a, b in zip(one["ofsd"]["losses"], two["ofsd"]["losses"])) < 1e-5
    assert max_diff(one["after_ofsd"], two["after_ofsd"]) < 5e-5
    assert max_diff(one["after_grpo"], one["after_ofsd"]) > 1e-3  # the merge changed the weights


def test_two_ranks_hold_half_the_state(steps):
    """Each of 2 ranks holds half the parameters, gradients, AdamW state and reference of 1 process."""
    (one,), two = steps["one"]["state_bytes"], steps["two"]["state_bytes"]
    assert len(two) == 2
    for held in two:
        for key in ("params", "grads", "optimizer", "reference"):
            assert abs(held[key] - one[key] / 2) <= 0.01 * one[key], key
    assert one["optimizer"] >= 2 * one["params"]  # AdamW: two float32 moments per parameter


def test_bfloat16_compute_tracks_float32(steps):
    """bfloat16 compute with float32 master weights stays near float32, on 1 process and 2 ranks."""
    for name in ("one_bf16", "two_bf16"):
        got = steps[name]
        assert all(t.dtype == torch.float32 for t in got["after_grpo"].values())  # float32 masters
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(steps["one"]["steps"], got["steps"])) < 0.05
        assert max_diff(steps["one"]["after_grpo"], got["after_grpo"]) < 0.01
        assert max_diff(steps["one"]["after_grpo"], got["after_grpo"]) > 0  # it did compute in bfloat16


def test_activation_checkpointing_changes_nothing(steps):
    """Recomputing each decoder layer in backward gives bit-identical steps and weights."""
    assert steps["one_recompute"]["steps"] == steps["one"]["steps"]
    assert max_diff(steps["one"]["after_ofsd"], steps["one_recompute"]["after_ofsd"]) == 0


@pytest.fixture(scope="module")
def two_rank_runs(micro, tmp_path_factory):
    """(uninterrupted 2-rank evolve.py run, a 2-rank run of 1 iteration resumed to 2): out_dirs."""
    d = tmp_path_factory.mktemp("fsdp_runs")
    args = [*micro, "--grpo_steps=1"]
    full, cut = str(d / "full"), str(d / "cut")
    p = run(TORCHRUN + ["evolve.py", *args, "--iterations=2", f"--out_dir={full}"])
    run(TORCHRUN + ["evolve.py", *args, "--iterations=1", f"--out_dir={cut}"])
    r = run(TORCHRUN + ["evolve.py", *args, "--iterations=2", f"--out_dir={cut}", "--resume"])
    assert "resumed from" in r.stdout
    return full, cut, p.stdout


def test_two_rank_run_completes(two_rank_runs):
    """A whole evolve.py run on 2 ranks evaluates every round, checkpoints, prints on rank 0 only."""
    full, _, stdout = two_rank_runs
    rows = [json.loads(line) for line in open(os.path.join(full, "metrics.jsonl"))]
    assert [r["kind"] for r in rows if r["kind"] != "grpo_step"] == ["eval", "eval", "ofsd_round", "eval", "eval",
                                                                        "ofsd_round", "eval"]
    assert all(len(r["state_bytes"]) == 2 for r in rows if r["kind"] == "grpo_step")
    assert stdout.count("grpo | it 0 | step") == 1
    assert os.listdir(os.path.join(full, "checkpoint", "optimizer"))  # each rank's optimizer slices
    M.load(os.path.join(full, "checkpoint", "model"))


def test_two_rank_checkpoint_loads_in_transformers(two_rank_runs):
    """The model a 2-rank run saves (gathered on rank 0) is a Hugging Face checkpoint."""
    transformers = pytest.importorskip("transformers")
    path = os.path.join(two_rank_runs[0], "checkpoint", "model")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ours = M.load(path)[0]
    ids = torch.tensor([[5, 17, 99, 3, 250, 42]])
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids), atol=1e-4)


def test_two_rank_resume_gives_the_uninterrupted_result(two_rank_runs):
    """A 2-rank run checkpointed after 1 iteration and resumed to 2 ends with the same weights."""
    full, cut, _ = two_rank_runs
    a = load_file(os.path.join(full, "checkpoint", "model", "model.safetensors"))
    b = load_file(os.path.join(cut, "checkpoint", "model", "model.safetensors"))
    assert max_diff(a, b) == 0
    results = [json.load(open(os.path.join(d, "checkpoint", "state.json")))["results"] for d in (full, cut)]
    assert [r["summary"] for r in results[0]] == [r["summary"] for r in results[1]]
