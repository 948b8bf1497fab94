"""OFSD: offline self-distillation from the policy's own better sibling (Search-E1's contribution).

An OFSD round follows a GRPO round:
1. Mine. G rollouts a question; in a group with a correct one, tau_ref = the correct rollout with
   the fewest searches (then policy tokens), tau_stu = the incorrect one farthest from it (bigram
   distance of policy tokens), else the farthest other correct one.
2. Two views of tau_stu, one set of weights:
     student  chat(instruction || q)             then tau_stu      (the LoRA adapter on)
     teacher  chat(instruction || q || C(pair))  then tau_stu      (the adapter off)
   C (`ofsd_context`): tau_ref's response ("full", the paper's), cut before its answer ("no_answer"),
   its queries ("queries"), or every sibling's queries marked right or wrong ("group_queries").
3. Over tau_stu's loss positions R (`ofsd_positions`: "policy", every sampled token, the paper's;
   "queries", its search queries), with the teacher's Pt (no gradient) and the student's Ps:
     L = 1/|R| sum_{p in R} sum_v min(Pt_p(v) log(Pt_p(v) / Ps_p(v)), tau_clip)      ofsd_clip "vocab"
   ("position" clips each position's KL, "none" nothing). `ofsd_loss` "nll" fits tau_ref's policy
   tokens in the student view instead (the rft control), "nll_kl" the sum.
4. AdamW on the adapter alone (the loop attaches it, then merges it). Left out: reverse KL, OFSD and
   RL in one loss.

    python evolve.py --ofsd_loss=nll      # the loop runs the rounds; python clipped_kl.py checks the loss
"""

import random
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch

import lora
from clipped_kl import CLIPS, fused_linear_clipped_kl, position_stats
from configurator import refuse_bad
from model import pad_right, token_logprobs
from rollout import ACTION, RolloutConfig, em_rewards, make_prompt, pad_batch, rollout


@dataclass(frozen=True)
class OFSDConfig:
    """An OFSD round's settings (evolve.py's constants of these names), each checked here."""
    ofsd_questions: int  # questions rolled out to mine pairs
    group_size: int  # G rollouts a question
    ofsd_students: str  # "any" (the paper's rule), "incorrect"
    ofsd_loss: str  # "kl" (the paper's), "nll" (the rft control), "nll_kl"
    ofsd_kl_weight: float  # the KL's weight beside the NLL in "nll_kl"
    ofsd_lora_rank: int
    ofsd_lora_alpha: float
    ofsd_lora_lr: float
    ofsd_epochs: int  # passes over the pairs
    ofsd_pairs_per_step: int  # pairs an optimizer step (and a teacher or measuring pass)
    tau_clip: float  # the loss's clip threshold
    ofsd_clip: str  # what tau_clip caps: "vocab", "position", "none"
    ofsd_context: str  # what the teacher sees of tau_ref (CONTEXTS)
    ofsd_positions: str  # where the loss counts (POSITIONS)
    max_grad_norm: float
    kl_chunk: int  # positions per LM-head chunk (memory, not results)
    rollout: RolloutConfig  # how the mining rollouts run

    def __post_init__(self):
        refuse_bad(self, positive=("ofsd_questions", "ofsd_lora_rank", "ofsd_lora_alpha", "ofsd_lora_lr", "ofsd_epochs",
                                   "ofsd_pairs_per_step", "max_grad_norm", "kl_chunk"),
                   not_negative=("ofsd_kl_weight", "tau_clip"),
                   choices=dict(ofsd_students=("any", "incorrect"), ofsd_loss=LOSSES, ofsd_clip=CLIPS,
                                ofsd_context=CONTEXTS, ofsd_positions=POSITIONS),
                   also=[(self.ofsd_clip != "none" and not self.tau_clip > 0, f"--tau_clip={self.tau_clip}: must be > 0 "
                                                                             f"(--ofsd_clip={self.ofsd_clip})")])


class Pair(NamedTuple):
    """One question's mined pair."""
    ref: object  # tau_ref: the correct Trajectory with the fewest searches
    stu: object  # tau_stu: the sibling both views continue
    incorrect: bool  # whether tau_stu is incorrect (else a correct sibling: ofsd_students="any")
    golds: tuple = ()  # the question's gold answers (greedy EM on the mined questions)
    group: tuple = ()  # (queries, reward) of every sibling in the group, in order ("group_queries")


class PairSequences(NamedTuple):
    """A pair as the loss reads it: both views' token ids and their aligned loss positions."""
    student: list  # chat(instruction || q) then tau_stu
    teacher: list  # chat(instruction || q || context) then tau_stu
    student_pos: list  # indices of tau_stu's policy-sampled tokens in `student`
    teacher_pos: list  # the same tokens' indices in `teacher`


# What the teacher sees, appended to its user message, for each ofsd_context
FULL = ("\n\nFor reference, here is a correct and efficient solution to this question, "
        "with its searches and the retrieved documents:\n{tau_ref}\n")
NO_ANSWER = ("\n\nFor reference, here is a correct and efficient solution to this question, with its "
             "searches and the retrieved documents, stopped before its final answer:\n{tau_ref}\n")
QUERIES = "\n\nFor reference, a correct and efficient solution to this question searched for, in order:\n{queries}\n"
GROUP_QUERIES = ("\n\nFor reference, earlier attempts at this question searched for the following, each "
                 "marked by whether its final answer was correct:\n{attempts}\n")
NO_SEARCH = "(nothing: it answered without searching)"
CONTEXTS = ("full", "no_answer", "queries", "group_queries")
POSITIONS = ("policy", "queries")
LOSSES = ("kl", "nll", "nll_kl")  # ofsd_loss: the paper's KL, the rft control (tau_ref's NLL), both


# ----------------------------------------------------------------------------------------------
# 1. pair mining

def token_distance(a, b):
    """1 - multiset Jaccard overlap of token bigrams (0: same bigrams, 1: none shared)."""
    ba, bb = Counter(zip(a, a[1:])), Counter(zip(b, b[1:]))
    union = sum((ba | bb).values())
    return 0.0 if union == 0 else 1.0 - sum((ba & bb).values()) / union


def reference(group, rewards):
    """Index of tau_ref in one question's group: the correct rollout with the fewest searches (then
    policy tokens), or None when none is correct."""
    correct = [i for i, r in enumerate(rewards) if r > 0]
    return min(correct, key=lambda i: (group[i].n_search, sum(group[i].loss_mask), i)) if correct else None


def mine_pair(group, rewards):
    """(ref index, student index, student is incorrect) within one question's group, or None."""
    ref = reference(group, rewards)
    if ref is None:
        return None
    correct = [i for i, r in enumerate(rewards) if r > 0]
    wrong = [i for i, r in enumerate(rewards) if r <= 0]
    pool = wrong or [i for i in correct if i != ref]
    if not pool:
        return None
    sampled = [[x for x, m in zip(t.tokens, t.loss_mask) if m] for t in group]  # each one's policy tokens
    stu = max(pool, key=lambda i: (token_distance(sampled[ref], sampled[i]), -i))
    return ref, stu, bool(wrong)


def mine_pairs(trajs, rewards, group_size):
    """One Pair (without gold answers) per question group that has a correct rollout."""
    pairs = []
    for s in range(0, len(trajs), group_size):
        found = mine_pair(trajs[s:s + group_size], rewards[s:s + group_size])
        if found:
            ref, stu, incorrect = found
            group = tuple((tuple(t.queries), r) for t, r in zip(trajs[s:s + group_size], rewards[s:s + group_size]))
            pairs.append(Pair(trajs[s + ref], trajs[s + stu], incorrect, group=group))
    return pairs


def mine(trajs, questions, group_size, ofsd_students="any"):
    """The Pairs, gold answers added; ofsd_students="incorrect" keeps those with an incorrect student."""
    golds = {q["question"]: q["golden_answers"] for q in questions}
    return [p._replace(golds=tuple(golds[p.stu.question]))
            for p in mine_pairs(trajs, em_rewards(trajs, questions, group_size), group_size)
            if p.incorrect or ofsd_students == "any"]


def mine_round(policy, tokenizer, index, questions, cfg, generator):
    """Step 1 on this rank's questions: G rollouts each of the current policy (cfg: an OFSDConfig), then `mine`."""
    trajs = rollout(policy, tokenizer, index, [q["question"] for q in questions], cfg.group_size, cfg.rollout, generator)
    return mine(trajs, questions, cfg.group_size, cfg.ofsd_students)


# ----------------------------------------------------------------------------------------------
# 2. the two views

def privileged(tokenizer, pair, context):
    """The teacher view's addition to the user message: what `context` shows of tau_ref or its group."""
    ref = pair.ref
    response = tokenizer.decode(ref.tokens[ref.prompt_len:])
    if context == "full":
        return FULL.format(tau_ref=response)
    if context == "no_answer":
        cut = response.rfind("<answer>")
        return NO_ANSWER.format(tau_ref=response[:cut] if cut >= 0 else response)
    if context == "queries":
        return QUERIES.format(queries="\n".join(f"{i}. {q}" for i, q in enumerate(ref.queries, 1)) or NO_SEARCH)
    if context == "group_queries":
        if not pair.group:
            raise ValueError(f"ofsd_context='group_queries' needs the pair's group (Pair.group); the pair of "
                             f"{ref.question!r} was mined without it")
        return GROUP_QUERIES.format(attempts="\n".join(
            f"- {'correct' if r > 0 else 'incorrect'}: {' | '.join(qs) if qs else NO_SEARCH}" for qs, r in pair.group))
    raise ValueError(f"ofsd_context={context!r}: must be one of {', '.join(CONTEXTS)}")


def max_context_tokens(tokenizer, context, response, group_size):
    """At most how many tokens `privileged` adds for a response of at most `response` tokens: the
    framing and tau_ref's response ("full", "no_answer"; a query list is shorter than the response it
    came from, whose observations it leaves out), or every sibling's ("group_queries", a few tokens
    more a line for its mark)."""
    framing = {"full": FULL, "no_answer": NO_ANSWER, "queries": QUERIES, "group_queries": GROUP_QUERIES}[context]
    mark = len(tokenizer.encode("\n- incorrect: " + NO_SEARCH))
    return len(tokenizer.encode(framing)) + (group_size * (response + mark) if context == "group_queries" else response)


def query_positions(tokenizer, stu):
    """Indices of tau_stu's tokens that wrote a query the rollout ran: in each turn whose action is a
    search, the tokens overlapping "q</search>" of its "<search>q</search>"."""
    out, p, end = [], stu.prompt_len, len(stu.tokens)
    while p < end:
        if not stu.loss_mask[p]:
            p += 1
            continue
        turn = p
        while p < end and stu.loss_mask[p]:
            p += 1
        pieces = [tokenizer.decode([t]) for t in stu.tokens[turn:p]]  # byte-level: tags survive any split
        m = ACTION.search("".join(pieces))
        if m and m.group(1) == "search":
            offset = 0
            for i, piece in enumerate(pieces):
                if offset < m.end() and offset + len(piece) > m.start(2):
                    out.append(turn + i)
                offset += len(piece)
    return out


def pair_sequences(tokenizer, stu, context, positions="policy"):
    """Both views of tau_stu (`context` added to the teacher's user message) and their loss positions."""
    response = stu.tokens[stu.prompt_len:]
    teacher_prompt = tokenizer.encode(tokenizer.chat_prompt(make_prompt(stu.question) + context))
    if positions == "policy":
        pos = [p for p in range(stu.prompt_len, len(stu.tokens)) if stu.loss_mask[p]]
    elif positions == "queries":
        pos = query_positions(tokenizer, stu)
    else:
        raise ValueError(f"ofsd_positions={positions!r}: must be one of {', '.join(POSITIONS)}")
    shift = len(teacher_prompt) - stu.prompt_len
    return PairSequences(stu.tokens, teacher_prompt + response, pos, [p + shift for p in pos])


def gather_hidden(model, seqs, positions):
    """The hidden states that predict each listed (ascending) position: (sum of len(positions), d)."""
    ids, valid = pad_right(seqs, 0, model.model.embed_tokens.weight.device)  # (B, T) each
    select = torch.zeros_like(valid)  # (B, T): the positions that predict a listed token
    for i, ps in enumerate(positions):
        if list(ps) != sorted(set(ps)):
            raise ValueError(f"positions of sequence {i} must be ascending and distinct: {ps}")
        select[i, [p - 1 for p in ps]] = True
    return model.hidden(ids, valid=valid, select=select)  # (N, d), row-major = the listed order


# ----------------------------------------------------------------------------------------------
# 3. the loss: the clipped forward KL of the teacher view, or tau_ref's NLL

def pair_loss(model, batch, tau_clip, ofsd_clip, kl_chunk):
    """Mean over the pairs of each pair's mean clipped KL; batch: (PairSequences, teacher states)."""
    h_s, h_t, s_pos = pair_states(model, batch)  # (N, d) each
    w = torch.tensor([1.0 / (len(p) * len(batch)) for p in s_pos for _ in p], device=h_s.device)
    return fused_linear_clipped_kl(h_s, h_t, model.lm_head_weight, tau_clip, ofsd_clip, w, kl_chunk)


def tau_ref_nll(model, refs, pad_id):
    """Mean over the trajectories of each one's mean -log p of its policy tokens: (), differentiable."""
    ids, valid, mask, _ = pad_batch(refs, pad_id, model.model.embed_tokens.weight.device)  # (B, T) each
    logp = token_logprobs(model, ids, valid, mask, 1.0)  # (n,) row-major
    counts = mask[:, 1:].sum(1)  # (B,) policy tokens of each trajectory
    w = torch.repeat_interleave(1.0 / (counts.to(logp.dtype) * len(refs)), counts)  # (n,)
    return -(w * logp).sum()


def pair_states(model, items):
    """(student states (N, d), teacher states (N, d), student loss positions) of the items."""
    s_pos = [d.student_pos for d, _ in items]
    return gather_hidden(model, [d.student for d, _ in items], s_pos), torch.cat([h for _, h in items]), s_pos


# ----------------------------------------------------------------------------------------------
# 4. the round

class Lesson(NamedTuple):
    """What a round distils, made before its adapter exists: the pairs' counts, the loss's data and the
    items the KL statistics measure."""
    metrics: dict  # pairs, incorrect_students
    data: list  # (tau_ref, (PairSequences, teacher states) or None) a usable pair: what the loss trains on
    items: list  # (PairSequences, teacher states (n, d)) of every pair with a loss position
    refs: list  # the tau_refs with policy tokens (their NLL is measured)


def prepare(model, tokenizer, pairs, cfg):
    """Step 2 for every pair: both views and the teacher's hidden states (the adapter off), and what the
    loss (cfg.ofsd_loss) can train on. No usable pair: empty `data`, and the round trains nothing."""
    seqs = [pair_sequences(tokenizer, p.stu, privileged(tokenizer, p, cfg.ofsd_context), cfg.ofsd_positions)
            for p in pairs]
    with_pos = [s for s in seqs if s.student_pos]  # a student with no loss position has no KL term
    states = iter(teacher_states(model, with_pos, cfg.ofsd_pairs_per_step))
    items = [(s, next(states)) if s.student_pos else None for s in seqs]  # per pair: (PairSequences, (n, d))
    data = [(p.ref, item) for p, item in zip(pairs, items)
            if (cfg.ofsd_loss == "nll" or item is not None) and (cfg.ofsd_loss == "kl" or sum(p.ref.loss_mask))]
    return Lesson(dict(pairs=len(pairs), incorrect_students=sum(p.incorrect for p in pairs), losses=[]), data,
                  [item for item in items if item is not None], [p.ref for p in pairs if sum(p.ref.loss_mask)])


def distill(model, params, tokenizer, lesson, cfg, seed):
    """Steps 3-4: the LoRA adapter `params`, just attached to `model`, trained on the lesson's data (in
    an order `seed` shuffles; the caller merges it). Returns the counts, the KL's statistics and
    tau_ref's NLL before and after, and each step's epoch and loss."""
    metrics, items, refs = dict(lesson.metrics), lesson.items, lesson.refs

    def measure(when):
        stats = pair_stats(model, items, cfg.tau_clip, cfg.ofsd_clip, cfg.ofsd_pairs_per_step, cfg.kl_chunk) \
            if items else {}
        with torch.no_grad():
            stats["nll"] = tau_ref_nll(model, refs, tokenizer.pad_id).item() if refs else None
        metrics.update({f"{k}_{when}": v for k, v in stats.items()})

    def batch_loss(batch):
        if cfg.ofsd_loss == "kl":
            return pair_loss(model, [item for _, item in batch], cfg.tau_clip, cfg.ofsd_clip, cfg.kl_chunk)
        nll = tau_ref_nll(model, [ref for ref, _ in batch], tokenizer.pad_id)
        return nll if cfg.ofsd_loss == "nll" else nll + cfg.ofsd_kl_weight * pair_loss(
            model, [item for _, item in batch], cfg.tau_clip, cfg.ofsd_clip, cfg.kl_chunk)
    measure("before")
    metrics["epochs"], metrics["losses"] = fit_adapter(params, lesson.data, batch_loss, cfg, seed)
    measure("after")
    return metrics


def fit_adapter(params, data, batch_loss, cfg, seed):
    """AdamW on `params`, cfg.ofsd_epochs shuffled passes over `data`, a step on batch_loss(items) for
    each cfg.ofsd_pairs_per_step items. Returns each step's epoch and loss."""
    opt = torch.optim.AdamW(params, lr=cfg.ofsd_lora_lr, weight_decay=0.0)
    rng, epochs, losses = random.Random(seed), [], []
    for epoch in range(cfg.ofsd_epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        for s in range(0, len(order), cfg.ofsd_pairs_per_step):
            loss = batch_loss([data[i] for i in order[s:s + cfg.ofsd_pairs_per_step]])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            epochs.append(epoch)
            losses.append(loss.item())
    return epochs, losses


@torch.no_grad()
def teacher_states(model, data, micro_batch):
    """The teacher view's hidden states at each pair's loss positions, the adapter off: [(n_i, d)]."""
    out = []
    with lora.disabled(model):
        for i in range(0, len(data), micro_batch):
            part = data[i:i + micro_batch]
            h_t = gather_hidden(model, [d.teacher for d in part], [d.teacher_pos for d in part])  # (N, d)
            out += h_t.split([len(d.teacher_pos) for d in part])
    return out


@torch.no_grad()
def pair_stats(model, items, tau_clip, ofsd_clip, ofsd_pairs_per_step, kl_chunk):
    """Mean over the pairs of each pair's mean over its positions of the clipped loss, the true KL, the
    share of positions clipped and the student's probability of the teacher's top token."""
    sums = dict(loss=0.0, kl_true=0.0, clip_frac=0.0, p_top=0.0)
    for i in range(0, len(items), ofsd_pairs_per_step):
        part = items[i:i + ofsd_pairs_per_step]
        h_s, h_t, s_pos = pair_states(model, part)  # (N, d) each
        stats = position_stats(h_s, h_t, model.lm_head_weight, tau_clip, ofsd_clip, kl_chunk)
        lengths = [len(p) for p in s_pos]
        for key, name in (("loss", "loss"), ("kl_true", "kl"), ("clip_frac", "clipped"), ("p_top", "p_top")):
            sums[key] += sum(x.mean().item() for x in stats[name].split(lengths)) / len(items)
    return sums
