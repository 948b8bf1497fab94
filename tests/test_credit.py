"""credit.py: the teacher's bounded token credit inside GRPO (RLSD), its statistics and tokens.html."""

import copy
import html.parser
import json
import math
import os

import pytest
import torch

import credit
import grpo
import ofsd
from conftest import AGENT_QUESTION, settings
from eval import token_page, token_section
from grpo import GRPOConfig
from rollout import Trajectory
from test_evolve import evolve
from test_rollout import run


def test_weights_match_a_float64_reference():
    """w = clip(exp(sign (log p_T - log p_S)), 1 - eps, 1 + eps) elementwise, both signs of A, both bounds hit."""
    g = torch.Generator().manual_seed(0)
    lt, ls = -3 * torch.rand(64, generator=g, dtype=torch.float64), -3 * torch.rand(64, generator=g, dtype=torch.float64)
    for sign in (1.0, -1.0):
        w = credit.token_weights(lt, ls, sign, 0.2)
        ref = [min(max(math.exp(sign * (a - b)), 0.8), 1.2) for a, b in zip(lt.tolist(), ls.tolist())]
        assert max(abs(x - y) for x, y in zip(w.tolist(), ref)) <= 1e-15
        assert (w == 0.8).any() and (w == 1.2).any() and ((w > 0.8) & (w < 1.2)).any()  # both bounds, and inside


def test_credited_advantage_formula_and_lambda_zero_is_a_itself():
    """A_t = A ((1 - lambda) + lambda w_t) against float64 for both signs of A; lambda 0 gives A bit for bit."""
    for a in (0.7302967433402214, -1.4605934866804429):
        for w in (0.8, 1.0, 1.13, 1.2):
            assert abs(credit.credited(a, w, 0.5) - a * (0.5 + 0.5 * w)) <= 1e-15
            assert credit.credited(a, w, 0.0) == a


def test_lambda_falls_linearly_to_zero_or_stays():
    """lambda 0.5 over 50 steps: 0.5 at step 1, 0.25 at step 26, 0 from step 51; decay 0 keeps it."""
    assert credit.schedule(0.5, 50, 1) == 0.5 and credit.schedule(0.5, 50, 26) == 0.25
    assert credit.schedule(0.5, 50, 51) == 0.0 == credit.schedule(0.5, 50, 90)
    assert credit.schedule(1.0, 0, 1000) == 1.0


def test_lambda_zero_step_is_plain_grpo_bit_for_bit(agent, tokenizer, search_index):
    """A GRPO step given per-token advantages A ((1 - 0) + 0 w) equals the plain step: the same loss and weights."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION], G=4, temperature=1.0,
                generator=torch.Generator().manual_seed(3))
    adv, g = [1.2, -0.4, -0.4, -0.4], torch.Generator().manual_seed(1)
    per_token = [[credit.credited(a, 0.8 + 0.4 * torch.rand((), generator=g).item(), 0.0) for _ in range(sum(t.loss_mask))]
                 for a, t in zip(adv, trajs)]
    cfg = settings(GRPOConfig, micro_batch=2, temperature=1.0)
    out = []
    for a in (adv, per_token):
        policy = copy.deepcopy(agent)
        opt = torch.optim.SGD(policy.parameters(), lr=0.1)
        m = grpo.grpo_step(policy, agent, opt, trajs, a, cfg, tokenizer.pad_id)
        out.append((m["loss"], [p.detach().clone() for p in policy.parameters()]))
    assert out[0][0] == out[1][0] and all(torch.equal(p, q) for p, q in zip(out[0][1], out[1][1]))


def test_an_empty_context_gives_w_one_exactly(agent, tokenizer, search_index):
    """The teacher with nothing added to its prompt reads the student's tokens at the same positions: w = 1 exactly."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "which lake is near London"], G=2, temperature=1.0,
                generator=torch.Generator().manual_seed(0))
    for t, (lt, ls) in zip(trajs, credit.view_logprobs(agent, tokenizer, trajs, [""] * len(trajs), 1.0, 3)):
        assert len(lt) == sum(t.loss_mask) and torch.equal(lt, ls)
        assert torch.equal(credit.token_weights(lt, ls, -1.0, 0.2), torch.ones_like(lt))


def test_weights_go_to_the_rows_a_credit_can_move(agent, tokenizer, search_index):
    """A mixed group's rows other than tau_ref get a weight per sampled token; tau_ref and groups without both
    outcomes (A = 0) get None (w = 1); a shown tau_ref moves the teacher (some w is not 1)."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "which lake is near London"], G=3, temperature=1.2,
                generator=torch.Generator().manual_seed(0))
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # a mixed group, then a group with no correct rollout
    adv = grpo.group_advantages(rewards, 3).tolist()
    weights, refs = credit.group_weights(agent, tokenizer, trajs, rewards, adv, 3, "full", 0.2, 1.0, 4)
    assert weights[0] is None and refs[1] is trajs[0] and all(w is None for w in weights[3:])
    for i in (1, 2):
        assert len(weights[i]) == sum(trajs[i].loss_mask) and all(0.8 <= x <= 1.2 for x in weights[i])
    assert any(x != 1.0 for i in (1, 2) for x in weights[i])
    contexts = [ofsd.privileged(tokenizer, ofsd.Pair(trajs[0], trajs[i], True), "full") for i in (1, 2)]
    for i, (lt, ls) in zip((1, 2), credit.view_logprobs(agent, tokenizer, trajs[1:3], contexts, 1.0, 4)):
        assert adv[i] < 0 and weights[i] == credit.token_weights(lt.double(), ls.double(), -1.0, 0.2).tolist()


def test_departure_and_segments_count_the_sampled_tokens(tokenizer):
    """departure: the sampled tokens before a row's response first differs from tau_ref's (in its own turn,
    or in the documents a different query brought); token_segments: each sampled token's tag."""
    def traj(*spans):
        t = Trajectory("q", 2)
        t.add([1, 2], sampled=False)
        for ids, sampled in spans:
            t.add(ids, sampled=sampled)
        return t
    ref = traj(([5, 6, 7, 8], True), ([9, 9], False), ([10, 11], True))
    assert credit.departure(traj(([5, 6, 7, 3], True), ([9, 9], False), ([10, 11], True)), ref) == 3
    assert credit.departure(traj(([5, 6, 7, 8], True), ([9, 4], False), ([10, 11], True)), ref) == 4
    assert credit.departure(ref, ref) == 6
    t = traj((tokenizer.encode("<think> river </think><search> Paris </search>"), True), (tokenizer.encode(" Doc 1 "), False),
             (tokenizer.encode("<answer> Paris </answer>"), True))
    segs = credit.token_segments(tokenizer, t)
    assert len(segs) == sum(t.loss_mask) and {"think", "search", "answer"} <= set(segs)


def test_stats_split_by_sign_and_segment():
    """token_stats: the mean w - 1 over a segment's tokens for A > 0 and A < 0 rows, and the failed rows' share
    of |w - 1| after their departure."""
    class Tok:
        def decode(self, ids):
            return {7: "<think>", 8: "x", 9: "<answer>", 10: "y"}[ids[0]]
    ref, bad = Trajectory("q", 1), Trajectory("q", 1)
    ref.add([0], sampled=False)
    ref.add([7, 8, 9, 10], sampled=True)
    bad.add([0], sampled=False)
    bad.add([7, 8, 9, 8], sampled=True)  # leaves tau_ref at its 4th sampled token
    s = credit.token_stats(Tok(), [bad], [-1.0], [[1.0, 1.1, 0.9, 1.2]], [ref])
    # "<think>" itself is before any tag (other); "x" and "<answer>" inside think; the last "x" inside answer
    assert s["think_neg"] == pytest.approx(0.0) and s["answer_neg"] == pytest.approx(0.2)
    assert s["think_pos"] is None and s["after_departure"] == pytest.approx(0.2 / 0.4)


class Spans(html.parser.HTMLParser):
    """The text of every policy token span (class "p") of each trajectory div, in order."""

    def __init__(self):
        super().__init__()
        self.trajs, self.inside = [], None

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class")
        if cls == "traj":
            self.trajs.append([])
        elif tag == "span" and cls == "p":
            self.inside = ""

    def handle_endtag(self, tag):
        if tag == "span" and self.inside is not None:
            self.trajs[-1].append(self.inside)
            self.inside = None

    def handle_data(self, data):
        if self.inside is not None:
            self.inside += data


def test_page_shows_every_policy_token_in_order(agent, tokenizer, search_index):
    """token_page: each shown trajectory's policy tokens, in order, as its coloured spans (the environment apart)."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION], G=2, temperature=1.2,
                generator=torch.Generator().manual_seed(0))
    rows = [("row", t, [0.1 * (k % 3 - 1) for k in range(sum(t.loss_mask))]) for t in trajs]
    p = Spans()
    p.feed(token_page([token_section(tokenizer, "a group", rows, 0.2, "legend")]))
    assert p.trajs == [[tokenizer.decode([x]) for x, m in zip(t.tokens, t.loss_mask) if m] for t in trajs]


def test_a_run_with_the_credit_logs_it_writes_its_page_and_keeps_it_on_resume(micro, tmp_path):
    """evolve.py --credit_lambda: each GRPO record carries the credit's statistics, the run writes tokens.html
    with every policy token of its shown rows, and a resume without the setting is refused by name."""
    out = str(tmp_path / "run")
    learn = ["--max_turn_tokens=40", "--max_obs_tokens=400", "--temperature=0.7", "--group_size=5", "--grpo_steps=2",
             "--iterations=1", "--ofsd_rounds=false"]  # answers: groups with both outcomes
    p = evolve(micro + learn + ["--credit_lambda=0.5", f"--out_dir={out}"])
    assert p.returncode == 0, p.stderr[-3000:]
    steps = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if r["kind"] == "grpo_step"]
    assert all(r["credit"]["credit_lambda"] == pytest.approx(0.5 * (1 - (r["step"] - 1) / 50)) for r in steps)
    assert "credit lambda 0.50" in p.stdout
    page = Spans()
    page.feed(open(os.path.join(out, "tokens.html")).read())
    assert page.trajs and all(page.trajs)  # the first step's mixed groups, each row's policy tokens
    p = evolve(micro + learn[:-2] + ["--iterations=2", "--ofsd_rounds=false", "--resume", f"--out_dir={out}"])
    assert p.returncode != 0 and "credit_lambda=0.5 (now 0.0)" in p.stderr
