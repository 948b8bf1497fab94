"""What an OFSD round can teach, and what it taught: the teacher view's advantage over the student view.

Before the round, on its mined pairs: greedy EM on the mined questions from the teacher view (tau_ref
shown as `ofsd_context` renders it) and from the student view (the plain prompt), each view's searches
a question, the share of loss positions where the teacher's most likely token is not the one the
student sampled, the true forward KL by segment (think / search / answer / other), and each view's
probability of the student's choices to search. After it, greedy EM on the same questions. A round
whose teacher view answers no better than its student view has nothing to distil: the toy world's
rounds show exactly that (README, docs/ablation.md).

    python evolve.py        # each OFSD line prints these; metrics.jsonl keeps them all
"""

import torch
import torch.nn.functional as F

import ofsd
from clipped_kl import position_stats
from rollout import exact_match, rollout

SEGMENTS = ("think", "search", "answer")


def greedy_scores(policy, tokenizer, index, mined, cfg, context=None):
    """One greedy rollout (cfg: a RolloutConfig, its sampling ignored) per mined question from the
    student view (context None), or the teacher view that `context` renders: (EM, searches) per question."""
    contexts = [ofsd.privileged(tokenizer, p, context) for p in mined] if context else None
    trajs = rollout(policy, tokenizer, index, [p.stu.question for p in mined], 1, cfg.greedy(), contexts=contexts)
    return [exact_match(t.answer, list(p.golds)) for t, p in zip(trajs, mined)], [t.n_search for t in trajs]


def split_em(name, em, mined):
    """Mean EM overall and over the pairs whose student was incorrect / correct (None when none)."""
    def mean(xs):
        return sum(xs) / len(xs) if xs else None
    return {name: mean(em), name + "_incorrect": mean([e for e, p in zip(em, mined) if p.incorrect]),
            name + "_correct": mean([e for e, p in zip(em, mined) if not p.incorrect])}


def segment_of(text):
    """The tag a token sits in, given the text before it: think, search, answer, or other."""
    opened = {tag: text.rfind(f"<{tag}>") for tag in SEGMENTS}
    inside = [(i, tag) for tag, i in opened.items() if i >= 0 and text.find(f"</{tag}>", i) < 0]
    return max(inside)[1] if inside else "other"


@torch.no_grad()
def token_diagnostics(model, tokenizer, mined, kl_chunk, context):
    """Over the loss positions of every pair: the share where the teacher's most likely token is
    not the token the student sampled, the mean true KL of a position in each segment, and at the
    positions where the student's sampled token completes "<search" (its choice to search rather
    than answer), the mean probability each view gives that token (None where no such position).
    The teacher view is the one `context` renders."""
    differ, n, kl, opens = 0, 0, {s: [] for s in SEGMENTS + ("other",)}, {"student": [], "teacher": []}
    for pair in mined:
        stu = pair.stu
        s_ids, t_ids, s_pos, t_pos = ofsd.pair_sequences(tokenizer, stu, ofsd.privileged(tokenizer, pair, context))
        if not s_pos:
            continue
        h_s, h_t = ofsd.gather_hidden(model, [s_ids], [s_pos]), ofsd.gather_hidden(model, [t_ids], [t_pos])  # (n, d)
        stats = position_stats(h_s, h_t, model.lm_head_weight, 0.0, "none", kl_chunk)
        sampled = torch.tensor([s_ids[p] for p in s_pos], device=h_s.device)
        differ += (stats["teacher_top"] != sampled).sum().item()
        n += len(sampled)
        before = [tokenizer.decode(s_ids[stu.prompt_len:p]) for p in s_pos]  # the text before each token
        for text, term in zip(before, stats["kl"].tolist()):
            kl[segment_of(text)].append(term)
        after = [before[i + 1] if i + 1 < len(s_pos) and s_pos[i + 1] == p + 1  # the next token's "before"
                 else tokenizer.decode(s_ids[stu.prompt_len:p + 1]) for i, p in enumerate(s_pos)]
        i_open = [i for i in range(len(s_pos)) if after[i].count("<search") > before[i].count("<search")]
        for view, h in (("student", h_s), ("teacher", h_t)):
            logp = torch.log_softmax(F.linear(h[i_open], model.lm_head_weight).float(), -1)  # (k, V)
            opens[view] += logp.gather(-1, sampled[i_open, None]).exp().squeeze(-1).tolist()  # (k,)
    out = {"disagree": differ / n if n else None}
    out.update({f"kl_{s}": sum(v) / len(v) if v else None for s, v in kl.items()})
    out.update({f"p_search_{v}": sum(ps) / len(ps) if ps else None for v, ps in opens.items()})
    return out


def before_round(policy, tokenizer, index, mined, cfg, kl_chunk, context):
    """Before the round ({} without pairs): greedy EM from the teacher view (as `context` renders it)
    and the student view (the headroom to distil; the teacher's also split by whether the pair's
    student was incorrect, as mined_em_before is), each view's searches a question, the
    teacher/student disagreement and true KL by segment."""
    if not mined:
        return {}
    student, student_searches = greedy_scores(policy, tokenizer, index, mined, cfg)
    teacher, teacher_searches = greedy_scores(policy, tokenizer, index, mined, cfg, context)
    out = split_em("teacher_em", teacher, mined)  # overall, and split by whether the student was incorrect
    out.update(student_em=sum(student) / len(student), **split_em("mined_em_before", student, mined))
    out.update(student_searches=sum(student_searches) / len(mined), teacher_searches=sum(teacher_searches) / len(mined))
    out.update(token_diagnostics(policy, tokenizer, mined, kl_chunk, context))
    return out


def after_round(policy, tokenizer, index, mined, cfg):
    """After the round ({} without pairs): greedy EM on its own questions, split by whether the student was incorrect."""
    return split_em("mined_em_after", greedy_scores(policy, tokenizer, index, mined, cfg)[0], mined) if mined else {}
