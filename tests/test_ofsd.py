"""ofsd.py: pair mining rules, teacher/student conditioning, and the OFSD round on a real model."""

import copy
import dataclasses

import pytest
import torch

import lora
from model import pad_right
import ofsd
import rollout
from rollout import RolloutConfig
import teacher_gap
from conftest import AGENT_QUESTION, random_model, tiny_config, distill_round
from test_rollout import run
from ofsd import OFSDConfig
from conftest import settings


def traj(policy, n_search=0, question="q"):
    """A hand-built trajectory: a 3-token prompt, then the given policy tokens."""
    t = rollout.Trajectory(question, 3)
    t.add([1, 2, 3], sampled=False)
    t.add(policy, sampled=True, logprobs=[0.0] * len(policy))
    t.queries = ["x"] * n_search
    return t


def views(tokenizer, ref, stu, context="full", positions="policy"):
    """ofsd.pair_sequences of the pair (ref, stu) with the teacher context `context` renders."""
    return ofsd.pair_sequences(tokenizer, stu, ofsd.privileged(tokenizer, ofsd.Pair(ref, stu, True), context), positions)


def test_reference_is_correct_with_fewest_searches():
    """tau_ref: the correct trajectory with the fewest searches, however long; ties to the shortest."""
    g = [traj([5, 6, 7], 2), traj([5, 6, 7, 8], 1), traj([5, 6, 7, 8, 9], 1), traj([5], 3), traj([9, 9], 0)]
    assert ofsd.mine_pair(g, [1, 1, 1, 1, 0])[0] == 1


def test_student_is_the_most_different_incorrect():
    """tau_stu: the incorrect sibling farthest from tau_ref (bigram distance), not the nearest."""
    g = [traj([5, 6, 7, 8], 1), traj([5, 6, 7, 9], 1), traj([1, 2, 3, 4], 3), traj([5, 6, 7, 8], 2)]
    assert ofsd.mine_pair(g, [1, 0, 0, 1]) == (0, 2, True)


def test_student_falls_back_to_a_correct_sibling():
    """All correct: the correct sibling farthest from tau_ref is the student."""
    g = [traj([5, 6, 7], 1), traj([5, 6, 7], 2), traj([9, 8, 7], 2)]
    assert ofsd.mine_pair(g, [1, 1, 1]) == (0, 2, False)


def test_no_correct_no_pair_and_ties_are_deterministic():
    """No correct trajectory gives no pair; equal distances go to the lowest index."""
    assert ofsd.mine_pair([traj([1, 2]), traj([3, 4])], [0, 0]) is None
    assert ofsd.mine_pair([traj([1, 2])], [1]) is None
    g = [traj([1, 2, 3], 0), traj([7, 8], 1), traj([8, 9], 1)]
    assert ofsd.mine_pair(g, [1, 0, 0]) == (0, 1, True)
    pairs = ofsd.mine_pairs(g + [traj([4, 4])] * 3, [1, 0, 0, 0, 0, 0], 3)
    assert len(pairs) == 1 and pairs[0].ref is g[0] and pairs[0].incorrect


def test_token_distance():
    """Identical sequences are 0 apart, disjoint ones 1."""
    assert ofsd.token_distance([1, 2, 3], [1, 2, 3]) == 0.0
    assert ofsd.token_distance([1, 2, 3], [4, 5, 6]) == 1.0
    assert 0 < ofsd.token_distance([1, 2, 3], [1, 2, 4]) < 1


def test_conditioning_aligns_student_tokens(agent, tokenizer, search_index):
    """Teacher = prompt with tau_ref as privileged context, then tau_stu; positions line up."""
    ref, stu = run(agent, tokenizer, search_index, [AGENT_QUESTION], G=2, temperature=1.0,
                   generator=torch.Generator().manual_seed(0))
    s_ids, t_ids, s_pos, t_pos = views(tokenizer, ref, stu)
    assert s_ids == stu.tokens and [s_ids[p] for p in s_pos] == [t_ids[p] for p in t_pos]
    assert s_pos == [p for p, m in enumerate(stu.loss_mask) if m]
    teacher_prompt = tokenizer.decode(t_ids[:len(t_ids) - (len(stu.tokens) - stu.prompt_len)])
    assert teacher_prompt == tokenizer.chat_prompt(rollout.make_prompt(AGENT_QUESTION) + ofsd.FULL.format(
        tau_ref=tokenizer.decode(ref.tokens[ref.prompt_len:])))


def test_gathered_hidden_states_predict_the_listed_positions():
    """gather_hidden returns the full forward's states at p - 1 in listed order; unsorted lists are refused."""
    model = random_model(tiny_config(), seed=5)
    seqs, positions = [[5, 6, 7, 8, 9], [10, 11, 12]], [[2, 4], [1, 2]]
    ids, valid = pad_right(seqs)
    with torch.no_grad():
        full = model.hidden(ids, valid=valid)  # (B, T, d)
        got = ofsd.gather_hidden(model, seqs, positions)
    want = torch.stack([full[0, 1], full[0, 3], full[1, 0], full[1, 1]])
    assert (got - want).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="sequence 1"):
        ofsd.gather_hidden(model, seqs, [[2, 4], [2, 1]])


def test_teacher_pass_ignores_adapter(agent, tokenizer, search_index):
    """With a trained adapter attached, the teacher pass equals the base model exactly."""
    model = copy.deepcopy(agent)
    trajs = run(model, tokenizer, search_index, [AGENT_QUESTION], G=2, temperature=1.0,
                generator=torch.Generator().manual_seed(0))
    batch = [views(tokenizer, trajs[0], trajs[1])]
    _, t_ids, _, t_pos = batch[0]
    with torch.no_grad():
        base = ofsd.gather_hidden(model, [t_ids], [t_pos])
    lora.attach(model, r=4, alpha=8)
    for _, m in lora._wrapped(model):
        torch.nn.init.normal_(m.lora_B.weight, std=0.1)
    with torch.no_grad(), lora.disabled(model):
        assert torch.equal(ofsd.gather_hidden(model, [t_ids], [t_pos]), base)
    with torch.no_grad():
        assert not torch.equal(ofsd.gather_hidden(model, [t_ids], [t_pos]), base)


def test_round_lowers_kl_and_merges(agent, tokenizer, search_index):
    """An OFSD round lowers the pairs' clipped KL, and the merged model equals the adapted one."""
    model = copy.deepcopy(agent)
    trajs = run(model, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=3, temperature=1.3,
                generator=torch.Generator().manual_seed(0))
    pairs = [ofsd.Pair(trajs[0], trajs[1], True), ofsd.Pair(trajs[3], trajs[5], False)]
    seen = {}
    original = lora.merge

    def spy_merge(m, part=None):
        ids = torch.tensor([trajs[1].tokens])
        with torch.no_grad():
            seen["adapted"] = m(ids)
        original(m, part)
        with torch.no_grad():
            seen["merged"] = m(ids)
        return m

    lora.merge = spy_merge
    try:
        out = distill_round(model, tokenizer, pairs, settings(OFSDConfig, ofsd_loss="kl", ofsd_kl_weight=1.0, ofsd_lora_rank=4, ofsd_lora_alpha=8, ofsd_lora_lr=5e-3, ofsd_epochs=8, ofsd_pairs_per_step=2, tau_clip=1.0, ofsd_clip="vocab", ofsd_context="full", ofsd_positions="policy", max_grad_norm=1.0, kl_chunk=256), seed=0)
    finally:
        lora.merge = original
    assert out["pairs"] == 2 and out["incorrect_students"] == 1
    assert out["loss_after"] < out["loss_before"]
    assert (seen["merged"] - seen["adapted"]).abs().max() <= 1e-4  # float32, 400+ positions
    assert not lora._wrapped(model) and all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("clip", ["position", "none"])
def test_round_lowers_the_true_kl_where_its_clip_claims_to(agent, tokenizer, search_index, clip):
    """An OFSD round whose clip keeps the true KL's direction (each position's sum clipped, or nothing; METHOD.md:
    the per-term clip does not) lowers the true forward KL from the student view to the teacher view on its pairs
    (tau_clip above most positions' KL: a clipped position has no gradient)."""
    model = copy.deepcopy(agent)
    trajs = run(model, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=3, temperature=1.3,
                generator=torch.Generator().manual_seed(0))
    pairs = [ofsd.Pair(trajs[0], trajs[1], True), ofsd.Pair(trajs[3], trajs[5], False)]
    m = distill_round(model, tokenizer, pairs, settings(OFSDConfig, ofsd_loss="kl", ofsd_lora_rank=4, ofsd_lora_alpha=8,
                                                        ofsd_lora_lr=5e-3, ofsd_epochs=4, ofsd_pairs_per_step=2,
                                                        tau_clip=4.0, ofsd_clip=clip, kl_chunk=256))
    assert m["kl_true_after"] < m["kl_true_before"]


def test_segment_of_the_open_tag():
    """A position's segment is the tag still open in the text before it."""
    assert teacher_gap.segment_of("<think> a") == "think"
    assert teacher_gap.segment_of("<think> a </think>\n<search> b") == "search"
    assert teacher_gap.segment_of("<think> a </think>\n") == "other"
    assert teacher_gap.segment_of("<search> b </search>\n\n<information>x</information><think> c </think><answer> d") == "answer"


def test_token_diagnostics_equal_a_full_forward(agent, tokenizer, search_index):
    """disagree, the per-segment true KL and each view's probability of the student's search-opening
    tokens equal those computed from full teacher/student logits."""
    for seed in range(3, 23):  # a student that searched: which seed gives one depends on the CPU's rounding
        trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION], G=2, temperature=1.3,
                    generator=torch.Generator().manual_seed(seed))
        if trajs[1].n_search:
            break
    mined = [ofsd.Pair(trajs[0], trajs[1], True, ("Paris",))]
    got = teacher_gap.token_diagnostics(agent, tokenizer, mined, kl_chunk=7, context="full")
    s_ids, t_ids, s_pos, t_pos = views(tokenizer, trajs[0], trajs[1])
    with torch.no_grad():
        ls = torch.log_softmax(agent(torch.tensor([s_ids]))[0].double(), -1)[[p - 1 for p in s_pos]]  # (n, V)
        lt = torch.log_softmax(agent(torch.tensor([t_ids]))[0].double(), -1)[[p - 1 for p in t_pos]]
    terms = (lt.exp() * (lt - ls)).sum(-1)
    differ = (lt.argmax(-1) != torch.tensor([s_ids[p] for p in s_pos])).double().mean().item()
    assert abs(got["disagree"] - differ) <= 1e-9
    seg = [teacher_gap.segment_of(tokenizer.decode(s_ids[trajs[1].prompt_len:p])) for p in s_pos]
    for name in ("think", "search", "answer", "other"):
        vals = [t for t, s in zip(terms.tolist(), seg) if s == name]
        assert (got[f"kl_{name}"] is None) == (not vals)
        if vals:
            assert abs(got[f"kl_{name}"] - sum(vals) / len(vals)) <= 1e-5
    upto = [tokenizer.decode(s_ids[trajs[1].prompt_len:p + k]).rstrip(">") for p in s_pos for k in (0, 1)]
    opens = [i for i in range(len(s_pos)) if upto[2 * i + 1].endswith("<search") and not upto[2 * i].endswith("<search")]
    assert opens  # the student searched, so the check has positions to compare
    for view, logp in (("student", ls), ("teacher", lt)):
        want = sum(logp[i, s_ids[s_pos[i]]].exp().item() for i in opens) / len(opens)
        assert abs(got[f"p_search_{view}"] - want) <= 1e-5, view


def test_round_reports_its_diagnostics(agent, tokenizer, search_index):
    """An OFSD round as evolve.py runs it (mine, diagnose, distil, diagnose) reports teacher/student EM,
    disagreement and EM on its own questions before/after."""
    model = copy.deepcopy(agent)
    questions = [{"question": AGENT_QUESTION, "golden_answers": ["Paris"]},
                 {"question": "which lake is near London", "golden_answers": ["Paris"]}]
    args = RolloutConfig(max_turns=2, max_turn_tokens=40, max_obs_tokens=400, top_k=3, temperature=1.0, top_p=1.0)
    pairs = ofsd.mine_round(model, tokenizer, search_index, questions, settings(OFSDConfig, group_size=4, rollout=args),
                            torch.Generator().manual_seed(0))
    gap = teacher_gap.before_round(model, tokenizer, search_index, pairs, args, 64, "full")
    m = distill_round(model, tokenizer, pairs, settings(OFSDConfig, ofsd_loss="kl", ofsd_kl_weight=1.0, ofsd_lora_rank=4, ofsd_lora_alpha=8, ofsd_lora_lr=1e-3, ofsd_epochs=1, ofsd_pairs_per_step=2, tau_clip=0.05, ofsd_clip="vocab", ofsd_context="full", ofsd_positions="policy", max_grad_norm=1.0, kl_chunk=64), seed=0)
    m.update(gap, **teacher_gap.after_round(model, tokenizer, search_index, pairs, args))
    assert m["pairs"] >= 1
    for key in ("teacher_em", "student_em", "mined_em_before", "mined_em_after", "disagree"):
        assert 0.0 <= m[key] <= 1.0, key
    n_wrong = m["incorrect_students"]  # the teacher's split weighs its two halves back to its mean
    halves = [(m["teacher_em_incorrect"], n_wrong), (m["teacher_em_correct"], m["pairs"] - n_wrong)]
    assert abs(sum(e * n for e, n in halves if e is not None) / m["pairs"] - m["teacher_em"]) < 1e-9


def test_greedy_scores_read_each_view(agent, tokenizer, search_index):
    """greedy_scores's teacher view is a greedy rollout with tau_ref in the prompt, its student view one
    without: on pairs where the context changes the answer, each scores what its own rollout answers
    and counts its own searches."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "which lake is near London", "who founded Tokyo"],
                G=3, temperature=1.3, generator=torch.Generator().manual_seed(0))
    args = RolloutConfig(max_turns=2, max_turn_tokens=40, max_obs_tokens=400, top_k=3, temperature=1.0, top_p=1.0)
    pairs = [ofsd.Pair(trajs[i], trajs[i + 1], True) for i in range(0, len(trajs), 3)]
    views = {}
    for view, contexts in (("student", None), ("teacher", [ofsd.privileged(tokenizer, p, "full") for p in pairs])):
        direct = rollout.rollout(agent, tokenizer, search_index, [p.stu.question for p in pairs], 1,
                                 dataclasses.replace(args, temperature=0.0), contexts=contexts)
        views[view] = [t.answer for t in direct]
        views[view + " searches"] = [t.n_search for t in direct]
    changed = [i for i, (a, b) in enumerate(zip(views["student"], views["teacher"])) if a != b]
    assert changed, views  # the fixture must hold a pair whose answer the context changes
    golds = [(views["teacher"][i] or views["student"][i],) for i in changed]  # an answer one view gives, not the other
    mined = [pairs[i]._replace(golds=g) for i, g in zip(changed, golds)]
    want = {v: [rollout.exact_match(views[v][i], list(g)) for i, g in zip(changed, golds)] for v in ("student", "teacher")}
    assert all(a != b for a, b in zip(want["student"], want["teacher"]))
    for view in ("student", "teacher"):
        em, searches = teacher_gap.greedy_scores(agent, tokenizer, search_index, mined, args, "full" if view == "teacher" else None)
        assert em == want[view] and searches == [views[view + " searches"][i] for i in changed], view


def test_round_with_incorrect_students_only(agent, tokenizer, search_index):
    """ofsd_students="incorrect" mines only pairs whose student sibling is incorrect."""
    questions = [{"question": AGENT_QUESTION, "golden_answers": ["Paris"]},
                 {"question": "which lake is near London", "golden_answers": ["Paris"]}] * 2
    counts = {}
    for students in ("any", "incorrect"):
        cfg = RolloutConfig(max_turns=2, max_turn_tokens=40, max_obs_tokens=400, top_k=3, temperature=0.5, top_p=1.0)
        pairs = ofsd.mine_round(agent, tokenizer, search_index, questions,
                                settings(OFSDConfig, group_size=4, rollout=cfg, ofsd_students=students),
                                torch.Generator().manual_seed(1))
        counts[students] = (len(pairs), sum(p.incorrect for p in pairs))
    assert counts["incorrect"] == (counts["any"][1], counts["any"][1])
    assert counts["any"][0] > counts["any"][1]  # the fixture mines correct students too


def adapted_pairs(agent, tokenizer, search_index):
    """(base model copy, the same model with a non-zero LoRA adapter, two pairs of unequal length)."""
    base = copy.deepcopy(agent)
    model = copy.deepcopy(agent)
    trajs = run(model, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=2, temperature=1.3,
                generator=torch.Generator().manual_seed(4))
    data = [views(tokenizer, trajs[0], trajs[1]), views(tokenizer, trajs[3], trajs[2])]
    assert len(data[0][2]) != len(data[1][2])  # unequal lengths: the per-pair weights matter
    lora.attach(model, r=4, alpha=8)
    torch.manual_seed(0)
    for _, m in lora._wrapped(model):
        torch.nn.init.normal_(m.lora_B.weight, std=0.5)
    return base, model, data


def reference_positions(base, model, data, tau_clip, clip):
    """Per pair, float64 per-position (loss, true KL, P_student(teacher's top), the clip changed the
    position's loss): teacher = the base copy."""
    out = []
    for s_ids, t_ids, s_pos, t_pos in data:
        with torch.no_grad():
            ls = torch.log_softmax(model(torch.tensor([s_ids]))[0].double(), -1)[[p - 1 for p in s_pos]]  # (n, V)
            lt = torch.log_softmax(base(torch.tensor([t_ids]))[0].double(), -1)[[p - 1 for p in t_pos]]
        f = lt.exp() * (lt - ls)  # (n, V)
        kl = f.sum(-1)
        loss = {"vocab": f.clamp(max=tau_clip).sum(-1), "position": kl.clamp(max=tau_clip), "none": kl}[clip]
        clipped = {"vocab": (f > tau_clip).any(-1), "position": kl > tau_clip, "none": torch.zeros_like(kl).bool()}[clip]
        out.append((loss, kl, ls.exp().gather(-1, lt.argmax(-1, keepdim=True)).squeeze(-1), clipped))
    return out


@pytest.mark.parametrize("clip", ["vocab", "position", "none"])
def test_pair_loss_teacher_is_the_base_model(agent, tokenizer, search_index, clip):
    """pair_loss = mean over pairs of each pair's mean loss, the teacher being the model with its
    adapter off (checked against a separate copy of the base model), the student with it on."""
    base, model, data = adapted_pairs(agent, tokenizer, search_index)
    got = ofsd.pair_loss(model, list(zip(data, ofsd.teacher_states(model, data, 1))), 0.05, clip, kl_chunk=7)
    ref = reference_positions(base, model, data, 0.05, clip)
    want = sum(loss.mean() for loss, *_ in ref) / len(ref)
    assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    with_adapter_teacher = sum(l.mean() for l, *_ in reference_positions(model, model, data, 0.05, clip)) / 2
    assert abs(with_adapter_teacher.item() - want.item()) > 1e-3  # the check can tell the two teachers apart


@pytest.mark.parametrize("clip", ["vocab", "position", "none"])
def test_pair_stats_report_the_true_kl(agent, tokenizer, search_index, clip):
    """pair_stats, in each clip mode: the loss, the unclipped KL, the clipped share and P(teacher's top),
    per pair then mean (what an OFSD round reports as loss / clip_frac before and after)."""
    base, model, data = adapted_pairs(agent, tokenizer, search_index)
    got = ofsd.pair_stats(model, list(zip(data, ofsd.teacher_states(model, data, 2))), 0.05, clip,
                          ofsd_pairs_per_step=2, kl_chunk=5)
    ref = reference_positions(base, model, data, 0.05, clip)
    for key, want in (("loss", sum(r[0].mean() for r in ref) / 2), ("kl_true", sum(r[1].mean() for r in ref) / 2),
                      ("clip_frac", sum(r[3].double().mean() for r in ref) / 2), ("p_top", sum(r[2].mean() for r in ref) / 2)):
        assert abs(got[key] - want.item()) <= 1e-5 * max(1.0, abs(want.item())), key
    if clip != "none":
        assert got["kl_true"] > got["loss"] and 0 < got["clip_frac"] < 1  # the clip acted, not everywhere


def test_nll_loss_fits_tau_ref_and_merges(agent, tokenizer, search_index):
    """ofsd_loss="nll" (the rft control): its loss is each tau_ref's mean -log p over its policy tokens
    (float64 full forward), the round lowers it, reports the true KL from the starting teacher view
    before -> after, and leaves a plain Qwen2 with moved weights."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=2, temperature=1.0,
                generator=torch.Generator().manual_seed(5))
    pairs = [ofsd.Pair(trajs[0], trajs[1], True), ofsd.Pair(trajs[2], trajs[3], True)]
    refs = [p.ref for p in pairs]
    want = 0.0
    for t in refs:
        ids = torch.tensor([t.tokens])
        logp = torch.log_softmax(copy.deepcopy(agent).double()(ids)[0, :-1], -1)  # (T-1, V)
        mask = torch.tensor(t.loss_mask[1:]).bool()  # position p predicts token p + 1
        want -= logp.gather(-1, ids[0, 1:, None])[:, 0][mask].mean().item() / len(refs)
    model = copy.deepcopy(agent)
    with torch.no_grad():
        assert abs(ofsd.tau_ref_nll(model, refs, 0).item() - want) <= 1e-5
    torch.manual_seed(0)
    m = distill_round(model, tokenizer, pairs, settings(OFSDConfig, ofsd_loss="nll", ofsd_kl_weight=0.0, ofsd_lora_rank=4, ofsd_lora_alpha=8, ofsd_lora_lr=1e-2, ofsd_epochs=3, ofsd_pairs_per_step=1, tau_clip=0.0, ofsd_clip="none", ofsd_context="full", ofsd_positions="policy", max_grad_norm=1.0, kl_chunk=5), seed=0)
    assert abs(m["nll_before"] - want) <= 1e-5 and m["nll_after"] < m["nll_before"] and len(m["losses"]) == 6
    with torch.no_grad():  # the first step's loss: one pair's NLL (a pair a step), the adapter still zero
        assert min(abs(m["losses"][0] - ofsd.tau_ref_nll(agent, [p.ref], 0).item()) for p in pairs) <= 1e-5
    data = [views(tokenizer, p.ref, p.stu) for p in pairs]
    start = ofsd.pair_stats(agent, list(zip(data, ofsd.teacher_states(agent, data, 1))), 0.0, "none", 1, 5)
    assert abs(m["kl_true_before"] - start["kl_true"]) <= 1e-6 and m["kl_true_after"] != m["kl_true_before"]
    assert not lora._wrapped(model) and set(dict(model.named_parameters())) == set(dict(agent.named_parameters()))
    assert any((p - q).abs().max() > 0 for p, q in zip(model.parameters(), agent.parameters()))


def test_pairs_saved_and_read_back(agent, tokenizer, search_index, tmp_path):
    """checkpoint.save_pairs then load_pairs gives equal pairs (trajectories, golds, groups): what a
    resumed experiment reads."""
    from checkpoint import load_pairs, save_pairs
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=2, temperature=1.0,
                generator=torch.Generator().manual_seed(5))
    pairs = [ofsd.Pair(trajs[0], trajs[1], True, ("Paris",), ((("a", "b"), 1.0), ((), 0.0))),
             ofsd.Pair(trajs[2], trajs[3], False, ("x", "y"))]
    path = str(tmp_path / "pairs.json")
    save_pairs(path, pairs, {"teacher_em": 0.5})
    assert load_pairs(path) == (pairs, {"teacher_em": 0.5})
