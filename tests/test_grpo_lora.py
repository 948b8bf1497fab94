"""GRPO through a LoRA adapter (evolve.py --grpo_lora_rank) and a policy as its base and adapters (lora.py)."""

import copy
import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
from evolve import grpo_round
import fsdp
import grpo
import lora
from conftest import AGENT_QUESTION
from model import load, save
from test_evolve import evolve as run_evolve
from test_rollout import run
from grpo import GRPOConfig
from conftest import settings
from model import token_logprobs
from rollout import pad_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lora_step(agent, tokenizer, search_index, seed=0):
    """(the policy after one LoRA GRPO step with the adapter still attached, the adapter, the trajectories)."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=3, temperature=1.0,
                generator=torch.Generator().manual_seed(seed))
    policy = copy.deepcopy(agent)
    torch.manual_seed(seed)
    adapter = lora.attach(policy, 4, 8)
    opt = torch.optim.AdamW(adapter, lr=1e-2, weight_decay=0.0)
    m = grpo.grpo_step(policy, None, opt, trajs, [1.0, -1.0, 0.5, 0.0, 2.0, -0.5], settings(GRPOConfig, micro_batch=4, clip_ratio=0.2, kl_coef=0.1, entropy_coef=0.0, temperature=1.0, max_grad_norm=1.0), 0)
    assert m["tokens"] > 0
    return policy, adapter, trajs


def test_lora_step_leaves_the_base_untouched(agent, tokenizer, search_index):
    """A LoRA GRPO step changes the adapter only: every base weight is bit for bit the round's start."""
    policy, adapter, _ = lora_step(agent, tokenizer, search_index)
    assert all(p.grad is not None for p in adapter) and max(m.lora_B.weight.abs().max() for _, m in lora._wrapped(policy)) > 0
    start = dict(agent.named_parameters())
    for name, p in policy.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, start[name.replace(".base.", ".")]), name


def test_kl_reference_with_the_adapter_off_is_the_round_start(agent, tokenizer, search_index):
    """The KL term's model of a LoRA step (the policy, adapter off) gives the log-probs of a separate copy of the
    round's starting policy, while the adapted policy has moved."""
    policy, _, trajs = lora_step(agent, tokenizer, search_index)
    ids, valid, mask, _ = pad_batch(trajs, 0, "cpu")
    with torch.no_grad(), lora.disabled(policy):
        off = token_logprobs(policy, ids, valid, mask, 1.0)
    with torch.no_grad():
        start, moved = (token_logprobs(m, ids, valid, mask, 1.0) for m in (copy.deepcopy(agent), policy))
    assert torch.equal(off, start)
    assert (moved - start).abs().max() > 1e-3


def test_a_moved_adapter_has_a_kl_term(agent, tokenizer, search_index):
    """After a LoRA step moved the adapter, the next step's KL term (to the policy with the adapter off) is not 0."""
    policy, adapter, trajs = lora_step(agent, tokenizer, search_index)
    opt = torch.optim.AdamW(adapter, lr=1e-2, weight_decay=0.0)
    m = grpo.grpo_step(policy, None, opt, trajs, [1.0, -1.0, 0.5, 0.0, 2.0, -0.5], settings(GRPOConfig, micro_batch=4, clip_ratio=0.2, kl_coef=0.1, entropy_coef=0.0, temperature=1.0, max_grad_norm=1.0), 0)
    assert m["kl"] > 1e-6


def test_base_and_chain_reloaded_give_the_policy(agent, tokenizer, search_index, tmp_path):
    """Base + ordered adapters written by save_policy and read by load_policy give the in-memory merged policy's
    logits (two adapters merged in turn), and a base with other weights is refused."""
    base = str(tmp_path / "base")
    save(agent, tokenizer, base)
    policy, adapter, trajs = lora_step(agent, tokenizer, search_index)
    checkpoint.merge_adapter(policy, adapter, str(tmp_path / "a" / "01-grpo"))
    second = lora.attach(policy, 2, 4)
    with torch.no_grad():
        for p in second:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    checkpoint.merge_adapter(policy, second, str(tmp_path / "a" / "02-ofsd"))
    chain = dict(base=base, base_sha256=None, adapters=[str(tmp_path / "a" / n) for n in ("01-grpo", "02-ofsd")])
    checkpoint.save_policy(str(tmp_path / "policy"), chain)
    assert json.load(open(tmp_path / "policy" / "policy.json"))["adapters"] == ["adapters/00-grpo", "adapters/01-ofsd"]
    reloaded, _ = checkpoint.load_policy(str(tmp_path / "policy"))
    ids, valid, _, _ = pad_batch(trajs, 0, "cpu")
    with torch.no_grad():
        assert torch.allclose(reloaded(ids, valid=valid), policy(ids, valid=valid), atol=1e-5, rtol=0)
    with torch.no_grad():
        agent_copy = copy.deepcopy(agent)
        agent_copy.lm_head.weight.add_(1e-3)
    save(agent_copy, tokenizer, base)
    with pytest.raises(ValueError, match="not the base it was trained from"):
        checkpoint.load_policy(str(tmp_path / "policy"))


def test_a_changed_adapter_or_base_is_refused_by_name(agent, tokenizer, tmp_path):
    """policy.json records each adapter's SHA-256: one changed byte in an adapter is refused naming that
    adapter; a policy folder with no adapter still checks its base."""
    base = str(tmp_path / "base")
    save(agent, tokenizer, base)
    policy = copy.deepcopy(agent)
    torch.manual_seed(0)
    for name in ("01-grpo", "02-ofsd"):
        params = lora.attach(policy, 2, 4)
        with torch.no_grad():
            params[1].add_(0.01)
        checkpoint.merge_adapter(policy, params, str(tmp_path / "a" / name))
    chain = dict(base=base, base_sha256=None, adapters=[str(tmp_path / "a" / n) for n in ("01-grpo", "02-ofsd")])
    checkpoint.save_policy(str(tmp_path / "policy"), chain)
    checkpoint.load_policy(str(tmp_path / "policy"))
    weights = tmp_path / "policy" / "adapters" / "01-ofsd" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="adapter .*01-ofsd is not the one it was trained with"):
        checkpoint.load_policy(str(tmp_path / "policy"))
    checkpoint.save_policy(str(tmp_path / "bare"), dict(chain, adapters=[]))
    with torch.no_grad():
        agent_copy = copy.deepcopy(agent)
        agent_copy.lm_head.weight.add_(1e-3)
    save(agent_copy, tokenizer, base)
    with pytest.raises(ValueError, match="not the base it was trained from"):
        checkpoint.load_policy(str(tmp_path / "bare"))


def evolve(args):
    p = run_evolve(args)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def lora_runs(micro, tmp_path_factory):
    """(a LoRA run of 2 iterations, the same run stopped after 1 and resumed to 2): out_dirs."""
    d = tmp_path_factory.mktemp("lora_runs")
    # micro's whole observations and turns: both OFSD rounds mine pairs, so OFSD adapters are saved, chained
    # and resumed
    args = [*micro, "--grpo_lora_rank=4", "--grpo_lora_lr=1e-3"]
    full, cut = str(d / "full"), str(d / "cut")
    evolve(args + ["--iterations=2", f"--out_dir={full}"])
    evolve(args + ["--iterations=1", f"--out_dir={cut}"])
    assert "resumed from" in evolve(args + ["--iterations=2", f"--out_dir={cut}", "--resume"]).stdout
    return full, cut


def test_lora_run_saves_its_adapters_and_a_policy_folder(lora_runs, micro):
    """A LoRA run saves each round's adapter in PEFT's format and checkpoints its policy as base + adapters."""
    full, _ = lora_runs
    names = sorted(os.listdir(os.path.join(full, "adapters")))
    trained = [json.loads(line)["round"] for line in open(os.path.join(full, "metrics.jsonl"))
               if json.loads(line)["kind"] == "ofsd_round" and json.loads(line)["losses"]]  # rounds that mined pairs
    assert trained and names == sorted(["01-grpo", "03-grpo"] + [f"{r:02d}-ofsd" for r in trained])
    cfg = json.load(open(os.path.join(full, "adapters", names[0], "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and len(cfg["target_modules"]) == 7
    model_dir = os.path.join(full, "checkpoint", "model")
    chain = json.load(open(os.path.join(model_dir, "policy.json")))
    assert chain["base"] == micro[0].split("=", 1)[1] and len(chain["adapters"]) == len(names)
    assert not os.path.exists(os.path.join(model_dir, "model.safetensors"))  # megabytes, not the weights
    assert not os.path.exists(os.path.join(full, "checkpoint", "optimizer.pt"))  # each round's AdamW is its own


def test_lora_run_resumes_exactly(lora_runs):
    """A LoRA run stopped after one iteration and resumed gives the uninterrupted run's adapters and table."""
    full, cut = lora_runs
    for name in sorted(os.listdir(os.path.join(full, "adapters"))):
        a, b = (load_file(os.path.join(d, "adapters", name, "adapter_model.safetensors")) for d in (full, cut))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    results = [json.load(open(os.path.join(d, "checkpoint", "state.json")))["results"] for d in (full, cut)]
    assert [r["summary"] for r in results[0]] == [r["summary"] for r in results[1]]
    chains = [json.load(open(os.path.join(d, "checkpoint", "model", "policy.json"))) for d in (full, cut)]
    assert chains[0]["adapters_sha256"] == chains[1]["adapters_sha256"]  # the whole chain, not the resumed part
    assert len(chains[0]["adapters"]) == len(os.listdir(os.path.join(full, "adapters")))


def test_lora_rounds_train_at_the_lora_lr(lora_runs):
    """Each LoRA GRPO step's learning rate is --grpo_lora_lr (1e-3 here, --lr 1e-4) under the warm-up."""
    full, _ = lora_runs
    rows = [json.loads(line) for line in open(os.path.join(full, "metrics.jsonl"))]
    steps = [r for r in rows if r["kind"] == "grpo_step"]
    assert steps and all(r["lr"] == pytest.approx(1e-3 * min(1.0, r["step"] / 3)) for r in steps)


def test_initial_kl_model_after_a_merge_is_refused(micro, tmp_path):
    """--kl_policy=initial with LoRA GRPO over several iterations is refused before anything is written."""
    out = tmp_path / "run"
    p = run_evolve([*micro, "--grpo_lora_rank=4", "--kl_policy=initial", "--iterations=2", f"--out_dir={out}"])
    assert p.returncode != 0 and not out.exists()
    assert "--kl_policy=initial with --grpo_lora_rank=4" in p.stderr


def test_a_bfloat16_base_steps_as_fsdp_mixed_precision(tiny_checkpoint):
    """A LoRA step on a base held in bfloat16 (one process) equals FSDP2's one-rank mixed precision over
    float32 masters: the same loss, bit for bit the same adapter gradients."""
    p = subprocess.run([sys.executable, "tests/bf16_base_step.py", tiny_checkpoint], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["dtype"] == "torch.bfloat16" and out["grad_max"] > 0
    assert out["held"] == out["sharded"] and out["grad_diff"] == 0.0


def test_a_merge_into_a_bfloat16_base_is_the_float32_chain_cast(tiny_checkpoint, tmp_path):
    """A LoRA run holding its base in bfloat16 merges an adapter in float32 (Run.merge): the weights are
    the cast of base + update in float32, which adding the update to bfloat16 weights would round away."""
    run = checkpoint.Run(str(tmp_path / "run"), dict(resume=False, overwrite=False), 0, 1, ())
    policy = fsdp.wrap(run.load_policy(tiny_checkpoint, "cpu", torch.bfloat16, lora_chain=True), torch.bfloat16)
    exact = load(tiny_checkpoint)[0]
    torch.manual_seed(0)
    adapter = lora.attach(policy, 4, 8)
    with torch.no_grad():
        for p in adapter:
            p.add_(torch.randn_like(p) * 1e-2)  # an update far smaller than the weights
    naive = copy.deepcopy(policy)
    for m, a in ((exact, adapter), (naive, None)):
        if a is not None:
            lora.attach(m, 4, 8)
            for p, q in zip(lora._wrapped(m), lora._wrapped(policy)):
                p[1].lora_A.weight.data.copy_(q[1].lora_A.weight)
                p[1].lora_B.weight.data.copy_(q[1].lora_B.weight)
        lora.merge(m)
    run.merge(policy, adapter, "01-grpo")
    assert os.path.isfile(tmp_path / "run" / "adapters" / "01-grpo" / "adapter_model.safetensors")
    weights = dict(policy.named_parameters())
    assert all(torch.equal(weights[n], p.to(torch.bfloat16)) for n, p in exact.named_parameters())
    assert any(not torch.equal(weights[n], p) for n, p in naive.named_parameters())


def live_tensors():
    """(count, bytes) of every torch tensor the process can still reach."""
    gc.collect()
    ts = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return len(ts), sum(t.untyped_storage().nbytes() for t in ts)


def test_lora_rounds_keep_no_tensor_alive(agent, tokenizer, search_index, tmp_path):
    """Three LoRA GRPO rounds in one process (a fresh adapter, a step, the merge into the run's chain) leave
    the same tensors alive after the third round as after the first: nothing piles up across rounds."""
    save(agent, tokenizer, str(tmp_path / "base"))
    run = checkpoint.Run(str(tmp_path / "run"), dict(resume=False, overwrite=False), 0, 1, ())
    policy = fsdp.wrap(run.load_policy(str(tmp_path / "base"), "cpu", torch.float32, lora_chain=True), torch.float32)
    cfg = settings(GRPOConfig, grpo_steps=1, questions_per_step=2, ppo_mini_batch=2, group_size=3, micro_batch=4,
                   max_turns=1, max_turn_tokens=24, max_obs_tokens=64, temperature=1.0)
    question = dict(question=AGENT_QUESTION, golden_answers=["Seine"])
    gen, live = torch.Generator().manual_seed(0), []
    for r in range(3):
        adapter = lora.attach(policy, 4, 8)
        opt = torch.optim.AdamW(adapter, lr=1e-2, weight_decay=0.0)
        list(grpo_round(policy, None, opt, tokenizer, search_index, [[question] * 2], cfg, gen, r))
        run.merge(policy, adapter, f"{r:02d}-grpo")
        del adapter, opt
        live.append(live_tensors())
    assert len(run.chain["adapters"]) == 3 and live[2] == live[0], live
