"""grpo.py (and rollout.py's exact match): Search-R1's EM, group advantages and the GRPO loss, by hand."""

import copy
import math

import pytest
import torch

import grpo
import rollout
from conftest import AGENT_QUESTION
from test_rollout import run
from grpo import GRPOConfig
from conftest import settings
from model import token_logprobs
from rollout import pad_batch


@pytest.mark.parametrize("pred,golds,want", [
    ("The Eiffel Tower", ["eiffel tower"], 1.0),            # article and case
    ("  eiffel   tower. ", ["Eiffel Tower"], 1.0),          # whitespace and punctuation
    ("an apple", ["Apple Inc."], 0.0),                      # "inc" is not dropped
    ("Apple, Inc", ["apple inc."], 1.0),
    ("Paris", ["Lyon", "paris", "Nice"], 1.0),              # any gold answer
    ("Paris", "Paris", 1.0),                                # a single gold string
    ("theatre", ["atre"], 0.0),                             # articles only as whole words
    ("Paris France", ["Paris"], 0.0),                       # exact, not contains
    (None, ["Paris"], 0.0),                                 # no answer tag
])
def test_exact_match_cases(pred, golds, want):
    """EM behaves like Search-R1's on articles, punctuation, case, spaces and several golds."""
    assert rollout.exact_match(pred, golds) == want


def test_prompt_example_is_not_an_answer():
    """A response without its own <answer> scores 0 even though the prompt shows <answer> Beijing."""
    assert rollout.extract_answer("<think> hmm </think> I think it is Beijing") is None
    assert rollout.exact_match(rollout.extract_answer("no tag, Beijing"), ["Beijing"]) == 0.0


def test_group_advantages_by_hand():
    """(r - mean) / (std + 1e-6) per group with Bessel's std; equal rewards give 0."""
    adv = grpo.group_advantages([1, 0, 0, 1, 1, 0, 0, 0, 0, 0], 5)
    s = math.sqrt(0.3)  # unbiased std of [1, 0, 0, 1, 1]
    want = [0.4 / s, -0.6 / s, -0.6 / s, 0.4 / s, 0.4 / s] + [0.0] * 5
    assert torch.allclose(adv, torch.tensor(want), atol=1e-5)


def test_token_loss_by_hand():
    """PPO-clip and k3 KL terms equal values computed by hand."""
    logp = torch.tensor([-1.0, -2.0, -0.5])
    old = torch.tensor([-1.5, -1.0, -0.5])
    kl_logp = torch.tensor([-1.0, -2.5, -0.4])
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, pg, kl, clipped = grpo.grpo_token_loss(logp, old, kl_logp, adv, clip_ratio=0.2, kl_coef=0.1)
    r = [math.exp(0.5), math.exp(-1.0), 1.0]
    want_pg = [max(-1.0 * r[0], -1.0 * 1.2), max(2.0 * r[1], 2.0 * 0.8), -0.5]
    want_kl = [0.0, math.exp(-0.5) + 0.5 - 1, math.exp(0.1) - 0.1 - 1]
    assert torch.allclose(pg, torch.tensor(want_pg), atol=1e-6)
    assert torch.allclose(kl, torch.tensor(want_kl), atol=1e-6)
    assert torch.allclose(loss, torch.tensor(want_pg) + 0.1 * torch.tensor(want_kl), atol=1e-6)
    assert clipped.tolist() == [True, True, False]


def test_policy_equal_to_kl_model(agent, tokenizer, search_index):
    """On fresh rollouts with policy = KL model: ratio = 1, KL = 0, pg = -mean token advantage."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=3, temperature=1.0,
                generator=torch.Generator().manual_seed(0))
    ids, valid, mask, old = pad_batch(trajs, 0, "cpu")
    with torch.no_grad():
        logp = token_logprobs(agent, ids, valid, mask, 1.0)
    assert (logp - old[:, 1:][mask[:, 1:]]).abs().max() <= 1e-4
    policy = copy.deepcopy(agent)
    adv = [1.0, -1.0, 0.5, 0.0, 2.0, -0.5]
    opt = torch.optim.SGD(policy.parameters(), lr=0.001)
    m = grpo.grpo_step(policy, agent, opt, trajs, adv, settings(GRPOConfig, micro_batch=4, clip_ratio=0.2, kl_coef=0.001, entropy_coef=0.0, temperature=1.0, max_grad_norm=1.0), 0)
    lengths = [sum(t.loss_mask) for t in trajs]
    want_pg = -sum(a * n for a, n in zip(adv, lengths)) / sum(lengths)
    assert abs(m["kl"]) <= 1e-6 and m["clip_frac"] == 0.0 and abs(m["pg"] - want_pg) <= 1e-4


def test_step_moves_toward_advantaged_samples(agent, tokenizer, search_index):
    """A GRPO step raises the log-prob of positive-advantage trajectories (real gradient)."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION], G=4, temperature=1.0,
                generator=torch.Generator().manual_seed(1))
    policy = copy.deepcopy(agent)
    adv = [1.0, 1.0, 1.0, 1.0]
    opt = torch.optim.SGD(policy.parameters(), lr=0.001)
    ids, valid, mask, _ = pad_batch(trajs, 0, "cpu")
    with torch.no_grad():
        before = token_logprobs(policy, ids, valid, mask, 1.0).sum()
    grpo.grpo_step(policy, agent, opt, trajs, adv, settings(GRPOConfig, micro_batch=2, clip_ratio=0.2, kl_coef=0.001, entropy_coef=0.0, temperature=1.0, max_grad_norm=1.0), 0)
    with torch.no_grad():
        assert token_logprobs(policy, ids, valid, mask, 1.0).sum() > before


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_step_raises_rewarded_and_lowers_unrewarded_rows(agent, tokenizer, search_index, sign):
    """One GRPO update on fixed rollouts (rewards 1, 0, 0, 1 as group advantages) raises each rewarded row's
    log-probability and lowers each unrewarded one's; the advantage's sign flipped, the opposite."""
    sampled = run(agent, tokenizer, search_index, [AGENT_QUESTION], G=12, temperature=1.3,
                  generator=torch.Generator().manual_seed(1))
    trajs = list({tuple(t.tokens): t for t in sampled}.values())[:4]  # four different rollouts
    assert len(trajs) == 4
    adv = [sign * a for a in grpo.group_advantages([1.0, 0.0, 0.0, 1.0], 4).tolist()]
    policy = copy.deepcopy(agent)
    ids, valid, mask, _ = pad_batch(trajs, 0, "cpu")

    def per_row():
        with torch.no_grad():
            lp = token_logprobs(policy, ids, valid, mask, 1.0)
        return [x.sum().item() for x in lp.split(mask[:, 1:].sum(1).tolist())]
    before = per_row()
    grpo.grpo_step(policy, agent, torch.optim.SGD(policy.parameters(), lr=0.01), trajs, adv,
                   settings(GRPOConfig, micro_batch=2, kl_coef=0.0, entropy_coef=0.0, temperature=1.0), 0)
    moved = [a - b for a, b in zip(per_row(), before)]
    assert all((m > 0) == (a > 0) for m, a in zip(moved, adv)), (moved, adv)


def test_kl_term_against_a_moved_kl_model(agent, tokenizer, search_index):
    """With a KL model that differs from the policy, the step's KL is the token mean of (clamped) k3
    of the two models' log-probs (float64 full forward), and the loss carries kl_coef times it."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=3, temperature=1.0,
                generator=torch.Generator().manual_seed(2))
    moved = copy.deepcopy(agent)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=g))
    ids, valid, mask, old = pad_batch(trajs, 0, "cpu")
    pred = mask[:, 1:]
    with torch.no_grad():
        lp = [torch.log_softmax(m(ids, valid=valid)[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0][pred]
              for m in (agent, moved)]  # (n,) each: policy, KL model
    d = (lp[1] - lp[0]).clamp(-20, 20)
    want = (d.exp() - d - 1).clamp(-10, 10).mean().item()  # k3, clamped as grpo.py's docstring says
    assert want > 1e-3  # the KL model has really moved
    policy = copy.deepcopy(agent)
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    m = grpo.grpo_step(policy, moved, opt, trajs, [0.0] * len(trajs), settings(GRPOConfig, micro_batch=4, clip_ratio=0.2, kl_coef=0.5, entropy_coef=0.0, temperature=1.0, max_grad_norm=1.0), 0)
    assert abs(m["kl"] - want) <= 1e-5 * max(1.0, want)
    assert abs(m["loss"] - (m["pg"] + 0.5 * m["kl"])) <= 1e-6


def test_chunked_head_matches_full_logits(agent, tokenizer, search_index):
    """token_logprobs over LM-head chunks of 7 rows (each recomputed in backward) gives the log-probs,
    entropies and parameter gradients of one float64 log-softmax over the full (B, T, V) logits."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=2, temperature=1.0,
                generator=torch.Generator().manual_seed(3))
    ids, valid, mask, _ = pad_batch(trajs, 0, "cpu")
    pred = mask[:, 1:]
    assert pred.sum() > 3 * 7  # several chunks, the last one partial
    models = [copy.deepcopy(agent).double(), copy.deepcopy(agent)]
    w = torch.linspace(-1, 1, int(pred.sum()), dtype=torch.float64)  # a loss that weighs every token
    ref = torch.log_softmax(models[0](ids, valid=valid)[:, :-1] / 0.8, -1)  # (B, T-1, V)
    ref_lp, ref_ent = ref.gather(-1, ids[:, 1:, None])[..., 0][pred], -(ref.exp() * ref).sum(-1)[pred]  # (n,)
    (w @ ref_lp + w @ ref_ent).backward()
    lp, ent = token_logprobs(models[1], ids, valid, mask, 0.8, entropy=True, chunk=7)
    (w.float() @ lp + w.float() @ ent).backward()
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    for (name, p64), p32 in zip(models[0].named_parameters(), models[1].parameters()):
        assert (p32.grad.double() - p64.grad).abs().max() <= 2e-5 * p64.grad.abs().max(), name  # float32 sums


def test_clip_indicator_between_the_two_thresholds():
    """A ratio of 1.3 or 0.75 is clipped at clip_ratio 0.2 and not at 0.4; 1.1 and 1.0 at neither."""
    logp = torch.zeros(4)
    old = -torch.log(torch.tensor([1.3, 0.75, 1.1, 1.0]))  # rho = exp(logp - old)
    adv = torch.ones(4)
    assert grpo.grpo_token_loss(logp, old, logp, adv, 0.2, 0.0)[3].tolist() == [True, True, False, False]
    assert grpo.grpo_token_loss(logp, old, logp, adv, 0.4, 0.0)[3].tolist() == [False] * 4


def test_micro_batched_step_is_one_float64_pass(agent, tokenizer, search_index):
    """grpo_step in micro-batches of 2 gives, in float64, the loss and every parameter gradient of the
    masked token-mean loss over the whole batch written out in one pass (each trajectory counted once)."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "Ada", "who founded Tokyo"], G=2, temperature=1.0,
                generator=torch.Generator().manual_seed(6))
    adv = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0]
    policy, kl_model = copy.deepcopy(agent).double(), copy.deepcopy(agent).double()
    with torch.no_grad():
        for p in kl_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
    ref = copy.deepcopy(policy)
    ids, valid, mask, old = pad_batch(trajs, 0, "cpu")
    pred = mask[:, 1:]
    logp_all = torch.log_softmax(ref(ids, valid=valid)[:, :-1], -1)  # (B, T-1, V)
    logp = logp_all.gather(-1, ids[:, 1:, None])[..., 0][pred]  # (n,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)[pred]
    with torch.no_grad():
        kl_lp = torch.log_softmax(kl_model(ids, valid=valid)[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0][pred]
    a = torch.tensor(adv, dtype=torch.float64)[:, None].expand_as(pred)[pred]
    want = grpo.grpo_token_loss(logp, old[:, 1:][pred].double(), kl_lp, a, 0.2, 0.1, entropy, 0.01)[0].mean()
    want.backward()
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    m = grpo.grpo_step(policy, kl_model, opt, trajs, adv, settings(GRPOConfig, micro_batch=2, clip_ratio=0.2, kl_coef=0.1, entropy_coef=0.01, temperature=1.0, max_grad_norm=1e9), 0)
    assert abs(m["loss"] - want.item()) <= 1e-10
    for (name, p), q in zip(policy.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-10 * max(1.0, q.grad.abs().max()), name
