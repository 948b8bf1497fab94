"""What a run reports and refuses: evaluation, the settings groups, the rank and context checks, the
resume's refusals, a policy folder's integrity, the LM head's precision, pair mining and its statistics.
Each test fails for a small realistic defect of its line (the note of #80 lists defect -> test)."""

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist

import checkpoint
import evolve
import fsdp
import lora
import ofsd
from conftest import AGENT_QUESTION, settings
from eval import evaluate, summarize
from grpo import GRPOConfig
from model import _head, save
from rollout import RolloutConfig, Trajectory
from test_rollout import run


def test_evaluation_is_greedy_whatever_sampling_it_is_handed(agent, tokenizer, search_index):
    """evaluate() with the training's sampling settings answers as greedy decoding does, every time."""
    qs = [{"question": AGENT_QUESTION, "golden_answers": ["Paris"]}, {"question": "who founded Tokyo", "golden_answers": ["x"]}]
    sampling = RolloutConfig(max_turns=2, max_turn_tokens=40, max_obs_tokens=400, top_k=3, temperature=1.5, top_p=0.9)
    a, b = evaluate(agent, tokenizer, search_index, qs, sampling, 2), evaluate(agent, tokenizer, search_index, qs, sampling, 1)
    greedy = evaluate(agent, tokenizer, search_index, qs, sampling.greedy(), 2)
    assert [r["trajectory"] for r in a] == [r["trajectory"] for r in b] == [r["trajectory"] for r in greedy]


def test_summary_divides_each_type_by_its_own_results():
    """summarize: a type's EM, searches and format are means over that type's results alone."""
    rows = [dict(type="a", em=1.0, searches=2, formatted=True), dict(type="a", em=0.0, searches=2, formatted=True),
            dict(type="b", em=0.0, searches=0, formatted=False)]
    s = summarize(rows, "type")
    assert s["a"] == dict(n=2, em=0.5, searches=2.0, format=1.0) and s["b"] == dict(n=1, em=0.0, searches=0.0, format=0.0)
    assert s["all"]["n"] == 3 and s["all"]["searches"] == 4 / 3


def test_a_nested_group_takes_the_overrides_given():
    """configurator.group fills GRPOConfig.rollout from the same overrides (a temperature, a turn cap)."""
    cfg = settings(GRPOConfig, temperature=0.5, max_turn_tokens=7)
    assert cfg.rollout.temperature == 0.5 and cfg.rollout.max_turn_tokens == 7


def test_ranks_need_a_question_per_update_each():
    """fsdp.check_ranks compares each rank's share of a step's questions with the PPO updates."""
    cfg = settings(GRPOConfig, questions_per_step=4, ppo_mini_batch=1)  # 4 updates a step
    fsdp.check_ranks(cfg.questions_per_step, cfg.ppo_updates, 4, 1)
    with pytest.raises(SystemExit, match="at least one question per rank for each of its 4 updates"):
        fsdp.check_ranks(cfg.questions_per_step, cfg.ppo_updates, 4, 2)  # 2 questions a rank for 4 updates


def test_the_context_check_counts_the_teacher_view(tokenizer):
    """check_context: a context that holds a trajectory but not the teacher's privileged text besides is refused."""
    from rollout import make_prompt, max_response_tokens
    sampling = RolloutConfig(max_turns=1, max_turn_tokens=10, max_obs_tokens=20, top_k=3)
    qs = [{"question": AGENT_QUESTION}]
    alone = len(tokenizer.encode(tokenizer.chat_prompt(make_prompt(AGENT_QUESTION)))) + max_response_tokens(tokenizer, sampling)
    evolve.check_context(alone, tokenizer, qs, sampling, 5, None)  # the trajectory alone fits exactly
    with pytest.raises(SystemExit, match=r"teacher view \(full\)"):
        evolve.check_context(alone, tokenizer, qs, sampling, 5, "full")


def test_a_resume_on_another_number_of_ranks_is_refused(tmp_path):
    """check_resume refuses a checkpoint that another number of ranks wrote."""
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps(dict(config=dict(a=1), world_size=2)))
    checkpoint.check_resume(str(ckpt), dict(a=1), 2, ())
    with pytest.raises(SystemExit, match="written by 2 ranks, this run has 1"):
        checkpoint.check_resume(str(ckpt), dict(a=1), 1, ())


def test_metrics_lines_count_only_the_records(tmp_path):
    """Run.record counts metrics.jsonl's lines: a printed-only line is not one (a resume cuts the file to it)."""
    r = checkpoint.Run(str(tmp_path / "run"), dict(resume=False, overwrite=False), 0, 1, ())
    checkpoint.claim_run_dir(r.out_dir)
    r.record(dict(kind="a"), "a")
    r.record(None, "printed only")
    r.record(dict(kind="b"), "b")
    assert r.state["metrics_lines"] == 2 == len(open(r.metrics_path).readlines())


def test_held_dtype_is_the_compute_dtype_in_one_process_and_float32_masters_when_sharded():
    """fsdp.held_dtype: bfloat16 compute is held in bfloat16 by one process, in float32 masters in a process group."""
    assert fsdp.held_dtype(torch.bfloat16) == torch.bfloat16 and fsdp.held_dtype(torch.float32) == torch.float32
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert fsdp.held_dtype(torch.bfloat16) == torch.float32
    finally:
        dist.destroy_process_group()


def test_a_sharded_model_trims_the_heap_before_each_layer_with_gradients(monkeypatch):
    """fsdp.wrap under a process group (FSDP2) keeps the per-layer heap trims of one process."""
    from conftest import random_model, tiny_config
    calls = []
    monkeypatch.setattr(fsdp, "BF16_MIN_HIDDEN", 64)  # the tiny model's width counts as real here
    monkeypatch.setattr(fsdp, "trim_host_memory", lambda: calls.append(1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = fsdp.wrap(random_model(tiny_config()), torch.float32)
        model.hidden(torch.tensor([[1, 2, 3]])).sum().backward()
        assert len(calls) >= 2 * model.config.num_hidden_layers  # forward and backward, each layer
    finally:
        dist.destroy_process_group()


def policy_folder(agent, tokenizer, tmp_path):
    """A base and a chain of two adapters saved as a policy folder; returns its path."""
    base, policy = str(tmp_path / "base"), copy.deepcopy(agent)
    save(agent, tokenizer, base)
    torch.manual_seed(0)
    names = ("01-grpo", "02-ofsd")
    for name in names:
        params = lora.attach(policy, 2, 4)
        with torch.no_grad():
            params[1].add_(0.01)
        checkpoint.merge_adapter(policy, params, str(tmp_path / "a" / name))
    checkpoint.save_policy(str(tmp_path / "policy"), dict(base=base, base_sha256=None,
                                                         adapters=[str(tmp_path / "a" / n) for n in names]))
    return str(tmp_path / "policy")


def test_a_changed_adapter_config_is_refused_by_name(agent, tokenizer, tmp_path):
    """An adapter's SHA-256 covers its adapter_config.json: a changed alpha is refused naming the adapter."""
    path = policy_folder(agent, tokenizer, tmp_path)
    cfg_file = os.path.join(path, "adapters", "00-grpo", "adapter_config.json")
    cfg = json.load(open(cfg_file))
    json.dump(dict(cfg, lora_alpha=cfg["lora_alpha"] * 2), open(cfg_file, "w"))
    with pytest.raises(ValueError, match="adapter .*00-grpo is not the one it was trained with"):
        checkpoint.load_policy(path)


def test_a_chain_with_a_hash_too_many_is_refused(agent, tokenizer, tmp_path):
    """policy.json with adapter and hash lists of different lengths is refused, naming both counts."""
    path = policy_folder(agent, tokenizer, tmp_path)
    file = os.path.join(path, checkpoint.POLICY_FILE)
    chain = json.load(open(file))
    json.dump(dict(chain, adapters_sha256=chain["adapters_sha256"] + ["0" * 64]), open(file, "w"))
    with pytest.raises(ValueError, match="2 adapters but 3 hashes"):
        checkpoint.load_policy(path)


def test_a_rebase_refuses_an_adapter_that_misses_a_target(agent, tokenizer, tmp_path):
    """rebase: an adapter whose tensors do not cover its target modules is refused, naming its file."""
    path = policy_folder(agent, tokenizer, tmp_path)
    chain = checkpoint.read_chain(path)
    from safetensors.torch import load_file, save_file
    file = os.path.join(chain["adapters"][0], "adapter_model.safetensors")
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if ".q_proj." not in k}, file)  # the q_proj updates gone
    with pytest.raises(ValueError, match="adapter_model.safetensors: tensors do not match the model"):
        checkpoint.rebase(copy.deepcopy(agent), chain)


def test_the_lm_head_log_softmax_runs_in_float32_for_a_bfloat16_model():
    """model._head on bfloat16 states: log p within float32's rounding of float64 on the same bfloat16 logits."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(16, 64, generator=g).bfloat16(), torch.randn(3001, 64, generator=g).bfloat16()
    targets = torch.randint(0, 3001, (16,), generator=g)
    logp, _ = _head(h, w, targets, 1.0)
    exact = torch.log_softmax(torch.nn.functional.linear(h, w).double(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert logp.dtype == torch.float32 and (logp.double() - exact).abs().max() < 1e-4


def test_mining_measures_distance_over_the_policy_tokens():
    """mine_pair's student: the incorrect sibling farthest from tau_ref in the tokens the policy sampled,
    whatever the prompt and documents around them."""
    def traj(sampled, env):
        t = Trajectory("q", 3)
        t.add([1, 2, 3], sampled=False)
        t.add(sampled, sampled=True)
        t.add(env, sampled=False)
        return t
    ref = traj([10, 11, 12, 13], [50, 51, 52, 53, 54, 55])
    near_policy = traj([10, 11, 12, 14], [60, 61, 62, 63, 64, 65])  # same policy bigrams but one; other documents
    far_policy = traj([20, 21, 22, 23], [50, 51, 52, 53, 54, 55])  # other policy tokens; the same documents
    assert ofsd.mine_pair([ref, near_policy, far_policy], [1.0, 0.0, 0.0]) == (0, 2, True)


def test_pair_stats_are_means_over_pairs_whatever_the_micro_batch(agent, tokenizer, search_index):
    """pair_stats: the same loss, true KL, clipped share and P(top) with 1 or 3 pairs a pass."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=3, temperature=1.3,
                generator=torch.Generator().manual_seed(0))
    pairs = [ofsd.Pair(trajs[0], trajs[1], True), ofsd.Pair(trajs[3], trajs[5], False), ofsd.Pair(trajs[0], trajs[2], True)]
    lesson = ofsd.prepare(agent, tokenizer, pairs, settings(ofsd.OFSDConfig, ofsd_pairs_per_step=3))
    one, three = (ofsd.pair_stats(agent, lesson.items, 0.05, "vocab", k, 256) for k in (1, 3))
    assert all(abs(one[k] - three[k]) < 1e-5 for k in one) and 0 <= one["p_top"] <= 1


def test_a_grpo_alone_run_refreshes_its_kl_model_each_round(micro, tmp_path):
    """kl_policy="round" without OFSD rounds: each GRPO round's first update has KL exactly 0 (its own start)."""
    from test_evolve import evolve as run_evolve
    out = str(tmp_path / "grpo")
    p = run_evolve(micro + ["--iterations=2", "--ofsd_rounds=false", f"--out_dir={out}"])
    assert p.returncode == 0, p.stderr[-3000:]
    first = [r["kl"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
             if r["kind"] == "grpo_step" and r["step"] in (1, 3)]
    assert first == [0.0, 0.0]
    later = [r["kl"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
             if r["kind"] == "grpo_step" and r["step"] == 2]
    assert later[0] > 0  # the policy moved within the round
