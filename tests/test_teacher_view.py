"""What the teacher sees (ofsd_context) and where the loss counts (ofsd_positions): the identity of
the two views, each context's rendering, the query positions, and the loop with both settings."""

import copy
import json
import os

import pytest
import torch

import lora
import ofsd
from ofsd import max_context_tokens
from clipped_kl import CLIPS
from conftest import AGENT_QUESTION, distill_round
from test_evolve import evolve
from test_rollout import run
from ofsd import OFSDConfig
from conftest import settings

QUESTIONS = [AGENT_QUESTION, "which lake is near London", "who founded Tokyo"]


@pytest.fixture(scope="module")
def group(agent, tokenizer, search_index):
    """Four sampled siblings of one question, at least one of which searched."""
    for seed in range(40):  # which seed gives a search depends on the CPU's rounding
        trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION], G=4, temperature=1.3,
                    generator=torch.Generator().manual_seed(seed))
        if sum(t.n_search > 0 for t in trajs) >= 2:
            return trajs
    pytest.fail("no seed gave two searching siblings")


def searcher(trajs):
    return next(t for t in trajs if t.n_search)


def student_gradient(model, tokenizer, pairs, context, clip):
    """The round's own loss (teacher states, then pair_loss on a fresh adapter) and its gradient's largest entry."""
    model = copy.deepcopy(model)
    data = [ofsd.pair_sequences(tokenizer, p.stu, context(p)) for p in pairs]
    items = list(zip(data, ofsd.teacher_states(model, data, 2)))
    params = lora.attach(model, 4, 8)
    loss = ofsd.pair_loss(model, items, 0.05, clip, kl_chunk=7)
    loss.backward()
    return loss.item(), max(p.grad.abs().max().item() for p in params)


@pytest.mark.parametrize("clip", CLIPS)
def test_identical_views_give_zero_loss_and_gradient(agent, tokenizer, group, clip):
    """A teacher context equal to the student's (no added text) gives loss 0 and a zero adapter
    gradient through pair_sequences and the round's own loss, in every clip mode."""
    pairs = [ofsd.Pair(group[0], group[1], True), ofsd.Pair(group[2], group[3], True)]
    for p in pairs:
        s_ids, t_ids, s_pos, t_pos = ofsd.pair_sequences(tokenizer, p.stu, "")
        assert s_ids == t_ids and s_pos == t_pos
    loss, grad = student_gradient(agent, tokenizer, pairs, lambda p: "", clip)
    assert abs(loss) <= 1e-6 and grad <= 1e-6
    loss, grad = student_gradient(agent, tokenizer, pairs, lambda p: ofsd.privileged(tokenizer, p, "full"), clip)
    assert abs(loss) > 1e-4 and grad > 1e-5  # a real teacher context moves the student: the check can fail


def reference_kl(model, s_ids, t_ids, n_response, positions):
    """float64 true KL at `positions` of the student sequence, each view's full forward on its own,
    the teacher's position found from the end (both end in the same response of n_response tokens)."""
    with torch.no_grad():
        ls = torch.log_softmax(model(torch.tensor([s_ids]))[0].double(), -1)  # (T_s, V)
        lt = torch.log_softmax(model(torch.tensor([t_ids]))[0].double(), -1)  # (T_t, V)
    assert s_ids[-n_response:] == t_ids[-n_response:]
    rows_s = [p - 1 for p in positions]
    rows_t = [p - 1 + len(t_ids) - len(s_ids) for p in positions]
    return (lt[rows_t].exp() * (lt[rows_t] - ls[rows_s])).sum(-1).mean().item()


@pytest.mark.parametrize("k", [1, 2, 7, 40])
def test_k_extra_teacher_tokens_leave_the_true_kl_where_a_full_forward_puts_it(agent, tokenizer, group, k):
    """With k extra tokens before the teacher's prompt, the round's true KL (pair_stats) equals the
    float64 KL of two separate full forwards aligned from the end; so does the zero of k = 0, and a
    teacher shifted by one token does not match (an off-by-one between the views is caught)."""
    stu = searcher(group)
    context = " ".join(["river"] * k)
    d = ofsd.pair_sequences(tokenizer, stu, context)
    assert len(d.teacher) - len(d.student) == len(tokenizer.encode(tokenizer.chat_prompt(context))) - \
        len(tokenizer.encode(tokenizer.chat_prompt(""))) > 0
    model = copy.deepcopy(agent)
    got = ofsd.pair_stats(model, list(zip([d], ofsd.teacher_states(model, [d], 1))), 0.05, "none", 1, 7)["kl_true"]
    want = reference_kl(agent, d.student, d.teacher, len(stu.tokens) - stu.prompt_len, d.student_pos)
    assert abs(got - want) <= 1e-5 * max(1.0, want)
    shifted = d._replace(teacher_pos=[p - 1 for p in d.teacher_pos])
    off = ofsd.pair_stats(model, list(zip([shifted], ofsd.teacher_states(model, [shifted], 1))), 0.05, "none", 1, 7)
    assert abs(off["kl_true"] - want) > 1e-3


def test_each_context_renders_what_it_names(tokenizer, group):
    """full: tau_ref's whole response; no_answer: the same cut before its final <answer>; queries:
    its queries in order and nothing else of it; group_queries: every sibling's, marked by reward."""
    ref = searcher(group)
    rewards = [1.0, 0.0, 0.0, 1.0]
    pair = ofsd.Pair(ref, group[1], True, group=tuple((tuple(t.queries), r) for t, r in zip(group, rewards)))
    response = tokenizer.decode(ref.tokens[ref.prompt_len:])
    full = ofsd.privileged(tokenizer, pair, "full")
    assert full == ofsd.FULL.format(tau_ref=response)
    no_answer = ofsd.privileged(tokenizer, pair, "no_answer")
    cut = response.rfind("<answer>")
    assert no_answer == ofsd.NO_ANSWER.format(tau_ref=response[:cut] if cut >= 0 else response)
    if ref.answer is not None:  # what is cut is the final answer tag, the one the reward read
        assert response[cut:].startswith("<answer>") and ref.answer in response[cut:]
        assert response[cut:].count("<answer>") == 1
    queries = ofsd.privileged(tokenizer, pair, "queries")
    assert queries == ofsd.QUERIES.format(queries="\n".join(f"{i}. {q}" for i, q in enumerate(ref.queries, 1)))
    assert "<information>" not in queries and "<think>" not in queries
    lines = ofsd.privileged(tokenizer, pair, "group_queries").split("correct:\n", 1)[1].strip().split("\n")
    assert len(lines) == 4
    for line, t, r in zip(lines, group, rewards):
        mark, _, text = line[2:].partition(": ")
        assert mark == ("correct" if r else "incorrect")
        assert text == (" | ".join(t.queries) if t.queries else ofsd.NO_SEARCH)
    with pytest.raises(ValueError, match="needs the pair's group"):
        ofsd.privileged(tokenizer, pair._replace(group=()), "group_queries")


def test_mined_pairs_carry_their_group(group):
    """mine_pairs keeps every sibling's queries and reward, in group order, for group_queries."""
    (pair,) = ofsd.mine_pairs(group, [1, 0, 0, 1], 4)
    assert pair.group == tuple((tuple(t.queries), r) for t, r in zip(group, [1, 0, 0, 1]))


def test_query_positions_are_the_tokens_of_each_query(tokenizer, group):
    """ofsd_positions="queries": exactly the policy tokens after an open <search>, each run of them the
    query and its closing tag; the teacher's positions hold the same tokens."""
    stu = searcher(group)
    d = ofsd.pair_sequences(tokenizer, stu, ofsd.privileged(tokenizer, ofsd.Pair(group[0], stu, True), "full"),
                            "queries")
    assert d.student_pos and all(stu.loss_mask[p] for p in d.student_pos)
    assert [d.student[p] for p in d.student_pos] == [d.teacher[p] for p in d.teacher_pos]
    runs, start = [], 0
    for i in range(1, len(d.student_pos) + 1):
        if i == len(d.student_pos) or d.student_pos[i] != d.student_pos[i - 1] + 1:
            runs.append(tokenizer.decode([d.student[p] for p in d.student_pos[start:i]]))
            start = i
    assert len(runs) == stu.n_search
    for text, q in zip(runs, stu.queries):
        assert text.strip().removesuffix("</search>").strip() == q
    every = ofsd.pair_sequences(tokenizer, stu, "", "policy").student_pos
    assert set(d.student_pos) < set(every)


def test_context_bound_holds_for_every_context(tokenizer, group):
    """max_context_tokens bounds each rendering for responses of the sampled lengths (evolve's check)."""
    ref = searcher(group)
    pair = ofsd.Pair(ref, group[1], True, group=tuple((tuple(t.queries), 1.0) for t in group))
    longest = max(len(t.tokens) - t.prompt_len for t in group)
    for context in ofsd.CONTEXTS:
        used = len(tokenizer.encode(ofsd.privileged(tokenizer, pair, context)))
        assert used <= max_context_tokens(tokenizer, context, longest, len(group)), context


def test_loop_runs_with_a_query_plan_teacher_and_query_positions(micro, tmp_path):
    """evolve.py --ofsd_context=queries --ofsd_positions=queries runs GRPO and OFSD rounds end to end."""
    out = str(tmp_path / "run")
    p = evolve(micro + ["--iterations=1", f"--out_dir={out}", "--ofsd_context=queries", "--ofsd_positions=queries"])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["kind"] for r in rows] == ["eval", "grpo_step", "grpo_step", "eval", "ofsd_round", "eval"]
    assert json.load(open(os.path.join(out, "checkpoint", "state.json")))["config"]["ofsd_context"] == "queries"


def test_nll_kl_loss_adds_the_weighted_kl_to_the_nll(agent, tokenizer, group):
    """ofsd_loss="nll_kl": the round's first loss is tau_ref's NLL plus kl_weight times the KL from the
    chosen teacher view, at the start (a fresh adapter changes nothing yet)."""
    pair = ofsd.Pair(searcher(group), group[1], True, group=tuple((tuple(t.queries), 1.0) for t in group))
    model = copy.deepcopy(agent)
    data = [ofsd.pair_sequences(tokenizer, pair.stu, ofsd.privileged(tokenizer, pair, "queries"), "policy")]
    items = list(zip(data, ofsd.teacher_states(model, data, 1)))
    with torch.no_grad():
        want = ofsd.tau_ref_nll(model, [pair.ref], 0).item() + 0.5 * ofsd.pair_loss(model, items, 0.0, "none", 7).item()
    m = distill_round(model, tokenizer, [pair], settings(OFSDConfig, ofsd_loss="nll_kl", ofsd_kl_weight=0.5, ofsd_lora_rank=4, ofsd_lora_alpha=8, ofsd_lora_lr=1e-3, ofsd_epochs=1, ofsd_pairs_per_step=1, tau_clip=0.0, ofsd_clip="none", ofsd_context="queries", ofsd_positions="policy", max_grad_norm=1.0, kl_chunk=7), seed=0)
    assert abs(m["losses"][0] - want) <= 1e-5 * max(1.0, want)


def hand_trajectory(tokenizer, turns):
    """A trajectory of the agent's question with the given (text, sampled) spans after its prompt."""
    from rollout import Trajectory, make_prompt
    prompt = tokenizer.encode(tokenizer.chat_prompt(make_prompt(AGENT_QUESTION)))
    t = Trajectory(AGENT_QUESTION, len(prompt))
    t.add(prompt, sampled=False)
    for text, sampled in turns:
        t.add(tokenizer.encode(text), sampled=sampled)
        if sampled and "<search>" in text:
            t.queries.append(text.split("<search>")[1].split("</search>")[0].strip())
    return t


def test_query_positions_leave_out_answer_turns(tokenizer):
    """In a search turn then an answer turn, the query positions cover "q</search>" and nothing of the answer."""
    t = hand_trajectory(tokenizer, [("<think> look </think>\n<search> river Paris </search>", True),
                                    ("\n\n<information>Doc 1(Title: x) river</information>\n\n", False),
                                    ("<think> found </think>\n<answer> Paris </answer>", True)])
    pos = ofsd.query_positions(tokenizer, t)
    text = tokenizer.decode([t.tokens[p] for p in pos])
    assert "river Paris" in text and text.strip().endswith("</search>")
    assert "answer" not in text and "Paris </answer>" not in text
    answer_start = max(i for i in range(len(t.tokens)) if not t.loss_mask[i]) + 1
    assert all(p < answer_start for p in pos)


def test_nll_at_query_positions_keeps_students_that_never_searched(agent, tokenizer, group):
    """ofsd_loss="nll" fits tau_ref whatever the student's loss positions: a pair whose student never
    searched (no query position) still trains with ofsd_positions="queries"."""
    stu = hand_trajectory(tokenizer, [("<think> sure </think>\n<answer> Paris </answer>", True)])
    assert not ofsd.query_positions(tokenizer, stu)
    pair = ofsd.Pair(searcher(group), stu, True, golds=("Paris",))
    m = distill_round(copy.deepcopy(agent), tokenizer, [pair], settings(OFSDConfig, ofsd_loss="nll", ofsd_kl_weight=0.0, ofsd_lora_rank=4, ofsd_lora_alpha=8, ofsd_lora_lr=1e-3, ofsd_epochs=1, ofsd_pairs_per_step=1, tau_clip=0.05, ofsd_clip="vocab", ofsd_context="queries", ofsd_positions="queries", max_grad_norm=1.0, kl_chunk=7), seed=0)
    assert len(m["losses"]) == 1
