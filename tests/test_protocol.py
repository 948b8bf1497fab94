"""The Search-R1 protocol on real checkpoints: the checkpoint's chat template, end-of-turn tokens,
PPO mini-batches and the entropy bonus."""

import copy
import json
import os

import pytest
import torch

import evolve
import grpo
from model import load
from tokenizer import Tokenizer
from rollout import INVALID, make_prompt, rollout
from conftest import AGENT_QUESTION, needs_wiki_packages, random_model, tiny_config, distill_round
from test_rollout import run
from ofsd import OFSDConfig
from grpo import GRPOConfig
from conftest import settings
from model import token_logprobs
from rollout import RolloutConfig

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
MESSAGES = ["Who wrote Hamlet?", make_prompt("who founded Paris"), "Ünïcode {braces} 'quotes' \\n <b>"]
REAL = os.environ.get("QWEN_CHECKPOINT")


def transformers_render(folder, message):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                   add_generation_prompt=True)


@pytest.mark.parametrize("message", MESSAGES)
def test_saved_folder_renders_like_transformers(tiny_checkpoint, message):
    """A folder we save carries its chat template: transformers renders the same prompt as we do."""
    _, tok = load(tiny_checkpoint)
    assert tok.chat_prompt(message) == transformers_render(tiny_checkpoint, message)


@pytest.mark.skipif(not REAL, reason="set QWEN_CHECKPOINT to a real Qwen2.5 folder")
@pytest.mark.parametrize("message", MESSAGES)
def test_real_checkpoint_renders_like_transformers(message):
    """The real Qwen2.5 folder's template: Qwen2.5's default system message, as transformers renders it."""
    _, tok = load(REAL)
    assert tok.system == QWEN25_SYSTEM
    assert tok.chat_prompt(message) == transformers_render(REAL, message)


def test_template_it_cannot_render_names_the_file(tiny_checkpoint):
    """A chat template without one default system message is an error naming tokenizer_config.json."""
    path = os.path.join(tiny_checkpoint, "tokenizer_config.json")
    cfg = json.load(open(path))
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template is not a ChatML template"):
        load(tiny_checkpoint)


def test_qwen25_template_system_message(tokenizer, tmp_path):
    """Qwen2.5's template text (tools branch included) yields its default system message."""
    template = ("{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
                "{{- messages[0]['content'] }}{%- else %}{{- '" + QWEN25_SYSTEM + "' }}{%- endif %}"
                "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
                "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\n"
                + QWEN25_SYSTEM + "<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for message in messages %}"
                "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    tok = Tokenizer(tokenizer.path, chat_template=template)
    assert tok.chat_prompt("hi") == (f"<|im_start|>system\n{QWEN25_SYSTEM}<|im_end|>\n"
                                     "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# ----------------------------------------------------------------------------------------------
# end-of-turn tokens

@pytest.fixture(scope="module")
def eot_agent(tokenizer):
    """A tiny Qwen2 trained to end its first turn with <|im_end|> (no tag), then to answer."""
    torch.manual_seed(0)
    model = random_model(tiny_config(), seed=3)
    eot = tokenizer.tok.token_to_id("<|im_end|>")
    prompt = tokenizer.encode(tokenizer.chat_prompt(make_prompt(AGENT_QUESTION)))
    turn1 = tokenizer.encode("<think> I know it. </think>") + [eot]
    msg = tokenizer.encode(INVALID)
    turn2 = tokenizer.encode("<answer> Paris </answer>")
    ids = torch.tensor([prompt + turn1 + msg + turn2])
    mask = torch.tensor([[0] * len(prompt) + [1] * len(turn1) + [0] * len(msg) + [1] * len(turn2)]).bool()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(80):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1])[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_end_of_turn_token_is_not_kept(eot_agent, tokenizer, search_index):
    """A turn ending on <|im_end|> leaves no end-of-turn id in tokens, mask or log-probs; the
    invalid-action message follows the turn's text directly."""
    (t,) = run(eot_agent, tokenizer, search_index, [AGENT_QUESTION], max_turns=2)
    assert tokenizer.decode(t.tokens[t.prompt_len:]) == "<think> I know it. </think>" + INVALID + \
        "<answer> Paris </answer>"
    assert not set(t.tokens[t.prompt_len:]) & set(tokenizer.eos_ids)
    assert len(t.tokens) == len(t.loss_mask) == len(t.logprobs) and t.answer == "Paris"


def test_cache_forgets_the_end_of_turn_token(eot_agent, tokenizer, search_index):
    """After the dropped token, recorded log-probs equal a fresh forward over the kept tokens."""
    trajs = run(eot_agent, tokenizer, search_index, [AGENT_QUESTION], G=3, max_turns=2, temperature=1.0,
                generator=torch.Generator().manual_seed(0))
    assert any(tokenizer.decode(t.tokens).count(INVALID) for t in trajs)
    for t in trajs:
        with torch.no_grad():
            logp = torch.log_softmax(eot_agent(torch.tensor([t.tokens]))[0].float(), -1)  # (T, V)
        want = logp[:-1].gather(-1, torch.tensor(t.tokens)[1:, None])[:, 0]
        m = torch.tensor(t.loss_mask[1:]).bool()
        assert (torch.tensor(t.logprobs[1:])[m] - want[m]).abs().max() <= 1e-4


@pytest.mark.skipif(not REAL, reason="set QWEN_CHECKPOINT to a real Qwen2.5 folder")
def test_real_checkpoint_responses_hold_no_end_of_turn_id(search_index):
    """Sampled rollouts of the real checkpoint: no end-of-turn id anywhere after the prompt."""
    model, tok = load(REAL)
    trajs = rollout(model, tok, search_index, ["Who wrote Hamlet?", "What is the capital of France?"], 2, RolloutConfig(max_turns=2, max_turn_tokens=24, max_obs_tokens=64, top_k=2, temperature=1.0, top_p=1.0), generator=torch.Generator().manual_seed(0))
    for t in trajs:
        assert not set(t.tokens[t.prompt_len:]) & set(tok.eos_ids), t.render(tok)


# ----------------------------------------------------------------------------------------------
# PPO mini-batches and the entropy bonus

def test_second_mini_batch_sees_a_moved_policy(agent, tokenizer, search_index):
    """Two mini-batches: the first update has ratio 1 (no clipping), the second clips (the entropy
    bonus makes the first update move the policy even where a group's advantages are 0)."""
    policy = copy.deepcopy(agent)
    questions = [{"question": AGENT_QUESTION, "golden_answers": ["Paris"]},
                 {"question": "which lake is near London", "golden_answers": ["Paris"]}]
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    cfg = settings(GRPOConfig, grpo_steps=1, questions_per_step=2, ppo_mini_batch=1, group_size=3, micro_batch=8,
                   lr=0.5, warmup_steps=1, clip_ratio=1e-4, kl_coef=0.0, entropy_coef=0.1, max_grad_norm=100.0,
                   max_turns=2, max_turn_tokens=24, max_obs_tokens=64, top_k=3, temperature=1.0, top_p=1.0)
    (m,) = evolve.grpo_round(policy, agent, opt, tokenizer, search_index, [questions], cfg,
                             torch.Generator().manual_seed(0), 0)
    first, second = m["updates"]
    assert first["clip_frac"] == 0.0 and second["clip_frac"] > 0.0
    assert m["tokens"] == first["tokens"] + second["tokens"]


def test_entropy_bonus_moves_the_loss(agent, tokenizer, search_index):
    """With entropy_coef c the reported loss is the plain loss minus c times the mean entropy."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION], G=4, temperature=1.0,
                generator=torch.Generator().manual_seed(2))
    adv = [1.0, -1.0, 0.5, -0.5]

    def step(coef):
        policy = copy.deepcopy(agent)
        return grpo.grpo_step(policy, agent, torch.optim.SGD(policy.parameters(), lr=0.0), trajs, adv, settings(GRPOConfig, micro_batch=4, clip_ratio=0.2, kl_coef=0.001, entropy_coef=coef, temperature=1.0, max_grad_norm=1.0), 0)
    plain, bonus = step(0.0), step(0.3)
    assert plain["entropy"] > 0 and abs(bonus["loss"] - (plain["loss"] - 0.3 * plain["entropy"])) <= 1e-5


def test_entropy_is_the_distributions():
    """token_logprobs(entropy=True) gives -sum p log p of softmax(logits / T) at each loss position."""
    model = random_model(tiny_config(), seed=4)
    ids = torch.tensor([[5, 6, 7, 8]])
    valid, mask = torch.ones_like(ids).bool(), torch.tensor([[0, 1, 1, 0]]).bool()
    with torch.no_grad():
        _, ent = token_logprobs(model, ids, valid, mask, 0.7, entropy=True)
        p = torch.softmax(model(ids)[0, :2].double() / 0.7, -1)  # positions 0, 1 predict tokens 1, 2
    assert torch.allclose(ent.double(), -(p * p.log()).sum(-1), atol=1e-5)


@pytest.mark.skipif(not REAL, reason="set QWEN_CHECKPOINT to a real Qwen2.5 folder")
@needs_wiki_packages
def test_real_checkpoint_runs_the_whole_loop(tmp_path):
    """The real 0.5B checkpoint through evolve.py on real questions over real Wikipedia text
    (wikiworld.py): 1 GRPO step (2 questions x 2 samples), an OFSD round, evaluations; the saved
    checkpoint gives transformers' logits."""
    transformers = pytest.importorskip("transformers")
    import subprocess
    import sys

    from worlds import wikiworld
    from test_evolve import ROOT
    world = str(tmp_path / "w")
    wikiworld.write_wiki_world(world)  # FanOutQA's dev sub-questions: a test set, used for both here
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "evolve.py", f"--model_dir={REAL}", f"--index_dir={world}/index",
                        f"--train_file={world}/test.jsonl", f"--test_file={world}/test.jsonl", "--test_limit=2",
                        "--iterations=1", "--grpo_steps=1", "--questions_per_step=2", "--ppo_mini_batch=2",
                        "--group_size=2", "--ofsd_questions=2", "--max_turns=2", "--max_turn_tokens=48",
                        "--max_obs_tokens=96", "--micro_batch=1", "--lr=1e-6", "--ofsd_epochs=1",
                        "--ofsd_pairs_per_step=1", f"--out_dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    print(p.stdout[-2500:])
    saved = str(out / "checkpoint" / "model")
    ours, tok = load(saved)
    ref = transformers.Qwen2ForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(tok.chat_prompt(make_prompt("Who wrote Hamlet?")))])
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-3


@pytest.mark.skipif(not REAL, reason="set QWEN_CHECKPOINT to a real Qwen2.5 folder")
def test_real_checkpoint_ofsd_lowers_the_pair_kl(search_index):
    """OFSD's LoRA distillation on the real checkpoint (one sibling pair of its own rollouts, the
    first as tau_ref): the clipped KL of the pair falls and the adapter merges."""
    import ofsd
    model, tok = load(REAL)
    trajs = rollout(model, tok, search_index, ["Who wrote Hamlet?"], 2, RolloutConfig(max_turns=1, max_turn_tokens=32, max_obs_tokens=64, top_k=2, temperature=1.0, top_p=1.0), generator=torch.Generator().manual_seed(0))
    m = distill_round(model, tok, [ofsd.Pair(trajs[0], trajs[1], True)], settings(OFSDConfig, ofsd_loss="kl", ofsd_kl_weight=1.0, ofsd_lora_rank=8, ofsd_lora_alpha=16, ofsd_lora_lr=1e-3, ofsd_epochs=3, ofsd_pairs_per_step=1, tau_clip=0.05, ofsd_clip="vocab", ofsd_context="full", ofsd_positions="policy", max_grad_norm=1.0, kl_chunk=64), seed=0)
    print(m)
    assert m["loss_after"] < m["loss_before"] and not any("lora" in n for n, _ in model.named_parameters())
