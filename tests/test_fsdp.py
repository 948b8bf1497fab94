"""FSDP2 sharding and mixed precision (fsdp.py), on CPU with gloo: 2 ranks against 1 process.

The step tests run tests/sharded_steps.py (3 GRPO steps and an OFSD round per clip mode on fixed
trajectories and pairs) once per layout and compare what rank 0 saved. Exactness is checked in
float64: 2 ranks give 1 process's losses, gradients and weights to 1e-10 (measured 4e-14 on an Intel
Xeon with AMX, 2026-12-04). In float32 the sum over ranks runs in another order, and AdamW turns
that into updates ~lr apart wherever a gradient is near zero (2.5e-4 apart after an OFSD round on
AVX-512, where AVX2 happened to stay under 5e-5), so float32 is compared at the first step only,
against the float64 result, with this CPU's own float32 rounding as the unit.

bfloat16 compute is checked at the first step, where every layout starts from the same weights
(later steps are not compared: AdamW's first updates are lr * sign(g), so where bfloat16 flips a
small gradient's sign the runs part by 2 lr and then follow different trajectories). Each
bound comes from the same machine's own bfloat16 arithmetic, so it holds on every CPU (AVX2,
AVX-512, AMX) and still fails for a real bug: the worker also runs the first step on plain,
unsharded float32 and bfloat16 copies of the model (`plain`), with the recorded log-probs as
pi_old (rho = 1 up to rounding, so no token sits on the clip's edge).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import fsdp
from clipped_kl import CLIPS
from conftest import random_model, tiny_config
from model import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def run(cmd):
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{cmd[-4:]} exited {p.returncode}: {p.stderr[-3000:]}"  # -9: killed (memory)
    return p


@pytest.fixture(scope="module")
def steps(micro, tmp_path_factory):
    """{layout: what rank 0 saved} for 1 process and 2 ranks, float32 and bfloat16 compute."""
    d = tmp_path_factory.mktemp("fsdp")
    model_dir = micro[0].split("=", 1)[1]
    out = {}
    for name, launcher, mode, shift in (
            ("one", [sys.executable], "float32", "0.3"), ("two", TORCHRUN, "float32", "0.3"),
            ("one_recompute", [sys.executable], "checkpointing", "0.3"), ("one_own", [sys.executable], "float32", "0"),
            ("one_bf16", [sys.executable], "bfloat16", "0"), ("two_bf16", TORCHRUN, "bfloat16", "0"),
            ("one_f64", [sys.executable], "float64", "0.3"), ("two_f64", TORCHRUN, "float64", "0.3")):
        run(launcher + ["tests/sharded_steps.py", model_dir, str(d / f"{name}.pt"), mode, shift])
        out[name] = torch.load(d / f"{name}.pt", weights_only=True)
    return out


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_ranks_match_one_process_in_float64(steps):
    """In float64, 3 GRPO steps and an OFSD round per clip mode on 2 ranks are 1 process's, to 1e-10."""
    one, two = steps["one_f64"], steps["two_f64"]
    for a, b in zip(one["steps"], two["steps"]):
        assert a["tokens"] == b["tokens"] and a["clip_frac"] == b["clip_frac"]
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * max(1.0, abs(a["loss"]))
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * max(1.0, a["grad_norm"])
    assert one["steps"][2]["clip_frac"] > 0  # the later updates are clipped: the ratio path is exercised
    assert len(one["grads"]) == len(two["grads"]) == 3
    for g1, g2 in zip(one["grads"], two["grads"]):  # the full gradient each step applies
        assert max_diff(g1, g2) <= 1e-10
    for w1, w2 in zip(one["weights"], two["weights"]):
        assert max_diff(w1, w2) <= 1e-10
    for clip in CLIPS:
        assert len(one["ofsd"][clip]["losses"]) == len(two["ofsd"][clip]["losses"]) > 0
        assert max(abs(a - b) for a, b in zip(one["ofsd"][clip]["losses"], two["ofsd"][clip]["losses"])) <= 1e-10
        assert max_diff(one["after_ofsd"][clip], two["after_ofsd"][clip]) <= 1e-10
        before = one["after_grpo"] if clip == CLIPS[0] else one["after_ofsd"][CLIPS[CLIPS.index(clip) - 1]]
        assert max_diff(before, one["after_ofsd"][clip]) > 1e-3  # this round's merge changed the weights


def test_two_ranks_lora_grpo_steps_match_one_process_in_float64(steps):
    """GRPO through a LoRA adapter (replicated, its gradient summed over the ranks as backward makes
    it) on 2 ranks: 1 process's losses, gradient norms and adapter, to 1e-10."""
    one, two = steps["one_f64"], steps["two_f64"]
    for a, b in zip(one["lora_steps"], two["lora_steps"], strict=True):
        assert a["tokens"] == b["tokens"] and abs(a["loss"] - b["loss"]) <= 1e-10 * max(1.0, abs(a["loss"]))
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * max(1.0, a["grad_norm"])
    assert one["lora_steps"][1]["kl"] > 0  # the adapter moved the policy away from its adapter-off self
    for p, q in zip(one["lora_adapter"], two["lora_adapter"], strict=True):
        assert (p - q).abs().max() <= 1e-10


def test_two_ranks_float32_step_is_within_rounding(steps):
    """In float32, the first GRPO step's loss and gradient on 2 ranks are as near the float64 ones as 1 process's."""
    # Only the first step: after it AdamW turns a rounding-sized difference of a near-zero gradient into
    # a full +-lr update (lr g / (|g| + eps)), so later steps, weights and the OFSD round part by ~lr
    # (the float64 test above holds the exactness claim for them). Here the unit of error is this CPU's
    # own: how far 1 float32 process lies from the float64 result; summing over 2 ranks in another
    # order may err as much again, a lost or doubled trajectory's share is ~1/12 of the gradient.
    exact, one, two = steps["one_f64"], steps["one"], steps["two"]
    assert one["steps"][0]["tokens"] == two["steps"][0]["tokens"]
    g64, g1, g2 = flat(exact["grads"][0]), flat(one["grads"][0]), flat(two["grads"][0])
    assert (g2 - g64).norm() <= 4 * (g1 - g64).norm() + 1e-7 * g64.norm()
    l64, l1, l2 = (x["steps"][0]["loss"] for x in (exact, one, two))
    assert abs(l2 - l64) <= 4 * abs(l1 - l64) + 1e-6 * max(1.0, abs(l64))
    assert (g1 - g64).norm() <= 1e-4 * g64.norm()  # the unit itself is float32 rounding, not a defect


def test_two_ranks_hold_half_the_state(steps):
    """Each of 2 ranks holds half the parameters, gradients, AdamW state and reference of 1 process."""
    (one,), two = steps["one"]["state_bytes"], steps["two"]["state_bytes"]
    assert len(two) == 2
    for held in two:
        for key in ("params", "grads", "optimizer", "reference"):
            assert abs(held[key] - one[key] / 2) <= 0.01 * one[key], key
    assert one["optimizer"] >= 2 * one["params"]  # AdamW: two float32 moments per parameter


def flat(tensors):
    return torch.cat([tensors[k].flatten().double() for k in sorted(tensors)])


def unit(tensors):
    v = flat(tensors)
    return v / v.norm()


BF16_ULP = 2.0 ** -8  # bfloat16 keeps 8 significant bits: one rounding moves a value by < 2^-8 relative


def test_bfloat16_step_is_a_bfloat16_computation(steps):
    """Mixed precision computes the first step's loss and gradient as a plain bfloat16 model does."""
    plain = steps["one_bf16"]["plain"]["torch.bfloat16"]
    assert abs(steps["one_bf16"]["steps"][0]["loss"] - plain["loss"]) <= 1e-6  # the same bfloat16 forward
    for name in ("one_bf16", "two_bf16"):
        got = steps[name]
        # two bfloat16 backwards (micro-batches summed in float32 here, one pass there) part by a few
        # roundings; the float32 gradient lies 0.10 away and a lost or doubled rank's share >= 0.5
        assert (unit(got["grads"][0]) - unit(plain["grads"])).norm() <= 8 * BF16_ULP
        assert abs(got["steps"][0]["grad_norm"] / flat(plain["grads"]).norm().item() - 1) <= 8 * BF16_ULP
    float32_gap = (unit(steps["one_own"]["grads"][0]) - unit(plain["grads"])).norm()
    assert float32_gap > 8 * BF16_ULP  # the bound separates bfloat16 from float32 compute


def test_bfloat16_loss_within_rounding_of_float32(steps):
    """The first step's bfloat16 loss is within what rounding does to this model's log-probs."""
    p32, p16 = steps["one_bf16"]["plain"]["torch.float32"], steps["one_bf16"]["plain"]["torch.bfloat16"]
    # loss = token mean of -A rho + beta kl - c_H H (kl = 0 at the first step); rounding moves each
    # log-prob by delta and entropy by dH, so the loss by at most mean(|A| |e^delta - 1| + c_H |dH|)
    delta = p16["logp"].double() - p32["logp"].double()
    bound = (p32["adv"].abs() * delta.exp().sub(1).abs() + 0.01 * (p16["entropy"] - p32["entropy"]).abs()).mean()
    for name in ("one_bf16", "two_bf16"):
        gap = abs(steps[name]["steps"][0]["loss"] - steps["one_own"]["steps"][0]["loss"])
        assert 0 < gap <= bound, (name, gap, bound.item())


def test_adamw_applies_the_gradient_to_float32_masters(steps):
    """Each layout's first update is AdamW's first step, lr g / (|g| + eps), on float32 weights."""
    for name in ("one", "two", "one_own", "one_bf16", "two_bf16"):
        got = steps[name]
        assert all(t.dtype == torch.float32 for t in got["after_grpo"].values())
        w0, w1, g = flat(got["weights"][0]), flat(got["weights"][1]), flat(got["grads"][0])
        want = w0 - 1e-3 * g / (g.abs() + 1e-8)
        # float32 weights round the update by ~6e-8 |w|; bfloat16 masters would round by 2^-9 |w|
        assert (w1 - want).abs().max() <= 1e-6, name


def test_activation_checkpointing_changes_nothing(steps):
    """Recomputing each decoder layer in backward gives bit-identical steps and weights."""
    assert steps["one_recompute"]["steps"] == steps["one"]["steps"]
    for clip in CLIPS:
        assert max_diff(steps["one"]["after_ofsd"][clip], steps["one_recompute"]["after_ofsd"][clip]) == 0


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
    assert all(r["summary"]["all"]["n"] == 3 for r in rows if r["kind"] == "eval")  # each rank its share, once
    assert stdout.count("grpo | it 0 | step") == 1
    assert os.listdir(os.path.join(full, "checkpoint", "optimizer"))  # each rank's optimizer slices
    load(os.path.join(full, "checkpoint", "model"))


def test_two_rank_checkpoint_loads_in_transformers(two_rank_runs):
    """The model a 2-rank run saves (gathered on rank 0) is a Hugging Face checkpoint."""
    transformers = pytest.importorskip("transformers")
    path = os.path.join(two_rank_runs[0], "checkpoint", "model")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load(path)[0]
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



@pytest.fixture(scope="module")
def two_rank_lora_runs(micro, tmp_path_factory):
    """(a 2-rank LoRA evolve.py run of 2 iterations, the same stopped after 1 and resumed): out_dirs."""
    d = tmp_path_factory.mktemp("fsdp_lora_runs")
    args = [*micro, "--grpo_steps=1", "--grpo_lora_rank=4", "--grpo_lora_lr=1e-3", "--seed=3"]  # groups of both outcomes
    full, cut = str(d / "full"), str(d / "cut")
    run(TORCHRUN + ["evolve.py", *args, "--iterations=2", f"--out_dir={full}"])
    run(TORCHRUN + ["evolve.py", *args, "--iterations=1", f"--out_dir={cut}"])
    assert "resumed from" in run(TORCHRUN + ["evolve.py", *args, "--iterations=2", f"--out_dir={cut}", "--resume"]).stdout
    return full, cut


def test_two_rank_lora_run_holds_one_adapter_on_every_rank(two_rank_lora_runs):
    """A 2-rank LoRA run through evolve.py: each round's adapter the same on both ranks when merged (its
    gradient summed over them), each rank evaluating its share, the chain saved."""
    full, _ = two_rank_lora_runs
    rows = [json.loads(line) for line in open(os.path.join(full, "metrics.jsonl"))]
    merges = [r["replica_drift"] for r in rows if r["kind"] == "ofsd_round" and r["losses"]]
    merges += [r["replica_drift"] for r in rows if r["kind"] == "eval" and r["after"] == "grpo"]
    assert len(merges) >= 3 and merges == [0.0] * len(merges)  # 2 GRPO adapters and the OFSD rounds that mined pairs
    assert any(r["pg"] != 0 for r in rows if r["kind"] == "grpo_step")  # a group of both outcomes: a gradient to sum
    assert all(r["summary"]["all"]["n"] == 3 for r in rows if r["kind"] == "eval")
    chain = json.load(open(os.path.join(full, "checkpoint", "model", "policy.json")))
    assert len(chain["adapters"]) == len(os.listdir(os.path.join(full, "adapters"))) >= 3


def test_two_rank_lora_resume_gives_the_uninterrupted_result(two_rank_lora_runs):
    """A 2-rank LoRA run stopped after 1 iteration and resumed saves the uninterrupted run's adapters and table."""
    full, cut = two_rank_lora_runs
    names = sorted(os.listdir(os.path.join(full, "adapters")))
    assert names == sorted(os.listdir(os.path.join(cut, "adapters")))
    for name in names:
        a, b = (load_file(os.path.join(d, "adapters", name, "adapter_model.safetensors")) for d in (full, cut))
        assert max_diff(a, b) == 0, name
    results = [json.load(open(os.path.join(d, "checkpoint", "state.json")))["results"] for d in (full, cut)]
    assert [r["summary"] for r in results[0]] == [r["summary"] for r in results[1]]


@pytest.mark.parametrize("recompute", [False, True])
def test_wrap_trims_the_heap_before_each_layer_that_runs_with_gradients(monkeypatch, recompute):
    """fsdp.wrap on a CPU: a trim before each layer's forward and its backward with gradients; none without."""
    width = fsdp.BF16_MIN_HIDDEN  # as wide as a real model: a narrower one (the toy) is not trimmed
    model = fsdp.wrap(random_model(tiny_config(num_hidden_layers=3, hidden_size=width, num_attention_heads=8)),
                      torch.float32)
    model.checkpoint_layers = recompute
    trims = []
    monkeypatch.setattr(fsdp, "trim_host_memory", lambda: trims.append(1))
    ids = torch.randint(0, 400, (2, 9))
    with torch.no_grad():
        model.hidden(ids)  # a no-gradient forward (decoding, the KL pass): left alone
    assert trims == []
    h = model.hidden(ids)
    assert len(trims) == 3  # one before each layer's forward
    h.square().sum().backward()
    assert len(trims) == 6  # and one before each layer's backward (and recomputation)


def test_wrap_leaves_a_model_narrower_than_a_real_one_untrimmed(monkeypatch):
    """fsdp.wrap hooks no layer of a model of the toy's width: its heap is kilobytes, a trim only costs."""
    model = fsdp.wrap(random_model(tiny_config()), torch.float32)
    trims = []
    monkeypatch.setattr(fsdp, "trim_host_memory", lambda: trims.append(1))
    model.hidden(torch.randint(0, 400, (2, 9))).square().sum().backward()
    assert trims == []
