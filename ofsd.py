"""OFSD: offline self-distillation from the policy's own better sibling (Search-E1's contribution).

An OFSD round (METHOD.md, "OFSD") consolidates what the GRPO round found:
1. Rollouts and pair mining. G rollouts of the current policy per question, EM rewards, and per
   question group one pair:
     tau_ref = the correct trajectory (R = 1) with the fewest retrieval calls (ties: fewest
               policy tokens, then lowest index);
     tau_stu = the incorrect trajectory that differs most from tau_ref, else the correct one
               (other than tau_ref) that differs most; ties go to the lowest index.
   "Differs" = bigram distance over the policy-generated tokens (loss_mask = 1):
     d(a, b) = 1 - |bigrams(a) & bigrams(b)| / |bigrams(a) | bigrams(b)|   (multisets)
   A group without a correct trajectory gives no pair.
2. Conditioning: the same weights, two contexts, the same continuation tau_stu:
     student  P_S(q)          = chat(instruction || q)                  then tau_stu
     teacher  P_T(q, tau_ref) = chat(instruction || q || C(pair))        then tau_stu
   What the teacher sees, C (`ofsd_context`, rendered by `privileged`, each framing a constant):
     "full"          tau_ref's whole response: reasoning, searches, documents, answer (the paper's)
     "no_answer"     tau_ref's response cut before its final <answer> tag
     "queries"       only tau_ref's search queries, in order: a search plan
     "group_queries" every sibling's queries in the group, each marked correct / incorrect
   Loss positions R_tau (`ofsd_positions`): "policy", every token tau_stu's policy sampled (its
   loss_mask; the paper's), or "queries", only those that wrote a query the rollout ran ("q</search>"
   of a turn's <search>q</search>); aligned between the two sequences; retrieved text and the
   prompt never count.
3. The round: attach LoRA; the teacher pass runs with the adapter disabled, under no_grad, once
   per round (the base is frozen, so its states at the loss positions do not change); the student
   pass runs with the adapter, at every step; AdamW on the adapter only, minimising per pair the
   mean over its loss positions of the token-level forward KL(teacher || student), clipped as
   `ofsd_clip` says (clipped_kl.py):
     "vocab"     L = 1/|R_tau| sum_{p in R_tau} sum_v min(Pt_p(v) log(Pt_p(v) / Ps_p(v)), tau_clip)
                 (the paper's formula; its clipped terms push the student away from the teacher)
     "position"  L = 1/|R_tau| sum_{p in R_tau} min(KL_p, tau_clip)
     "none"      L = 1/|R_tau| sum_{p in R_tau} KL_p
   then merge the adapter into the base weights: the next GRPO round's policy.
   Each round measures itself (in its metrics): before and after, over the round's pairs, the
   true (unclipped) KL, the loss, the share of positions the clip changed and the student's
   probability of the teacher's most likely token (`distill`); before, greedy EM on the mined
   questions from the teacher view and from the student view (the headroom to distil) and each
   view's searches a question, the share of loss positions where the teacher's most likely token
   differs from the student's sampled one, the true KL by segment (think / search / answer) and
   each view's probability of the student's choices to search (`mined_diagnostics`);
   after, greedy EM on the mined questions, split by whether the student was incorrect.

Left out: reverse KL, mixing OFSD with RL in one loss, several full references per pair
("group_queries" shows every sibling's queries, not their documents or reasoning).

    python evolve.py --ofsd_clip=none      # the loop runs the rounds; python clipped_kl.py checks the loss
"""

import random
from collections import Counter
from typing import NamedTuple

import torch
import torch.nn.functional as F

import fsdp
import lora
from model import pad_right
from clipped_kl import fused_linear_clipped_kl, position_stats
from rollout import ACTION, em_rewards, exact_match, make_prompt, rollout

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


# What the teacher sees: the framing of each ofsd_context, appended to the teacher's user message.
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


# ----------------------------------------------------------------------------------------------
# 1. pair mining

def policy_tokens(t):
    return [x for x, m in zip(t.tokens, t.loss_mask) if m]


def token_distance(a, b):
    """1 - multiset Jaccard overlap of token bigrams (0: same bigrams, 1: none shared)."""
    ba, bb = Counter(zip(a, a[1:])), Counter(zip(b, b[1:]))
    union = sum((ba | bb).values())
    return 0.0 if union == 0 else 1.0 - sum((ba & bb).values()) / union


def mine_pair(group, rewards):
    """(ref index, student index, student is incorrect) within one question's group, or None."""
    correct = [i for i, r in enumerate(rewards) if r > 0]
    if not correct:
        return None
    ref = min(correct, key=lambda i: (group[i].n_search, sum(group[i].loss_mask), i))
    wrong = [i for i, r in enumerate(rewards) if r <= 0]
    pool = wrong or [i for i in correct if i != ref]
    if not pool:
        return None
    ref_toks = policy_tokens(group[ref])
    stu = max(pool, key=lambda i: (token_distance(ref_toks, policy_tokens(group[i])), -i))
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
    """EM rewards, then a Pair with its gold answers per question group with a correct rollout;
    ofsd_students="incorrect" keeps only the pairs whose student is incorrect."""
    golds = {q["question"]: q["golden_answers"] for q in questions}
    return [p._replace(golds=tuple(golds[p.stu.question]))
            for p in mine_pairs(trajs, em_rewards(trajs, questions, group_size), group_size)
            if p.incorrect or ofsd_students == "any"]


# ----------------------------------------------------------------------------------------------
# 2. conditioning

def privileged(tokenizer, pair, context):
    """The teacher view's addition to the user message: what `context` (one of CONTEXTS) shows of
    the pair's tau_ref, or of its group."""
    ref = pair.ref
    if context == "full":
        return FULL.format(tau_ref=tokenizer.decode(ref.tokens[ref.prompt_len:]))
    if context == "no_answer":
        response = tokenizer.decode(ref.tokens[ref.prompt_len:])
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
    """At most how many tokens `privileged` adds for a response of at most `response` tokens:
    the framing and tau_ref's response ("full", "no_answer"; a query list is shorter than the
    response it came from, whose observations it leaves out), or every sibling's ("group_queries",
    a few tokens more a line for its mark)."""
    framing = {"full": FULL, "no_answer": NO_ANSWER, "queries": QUERIES, "group_queries": GROUP_QUERIES}[context]
    mark = len(tokenizer.encode("\n- incorrect: " + NO_SEARCH))
    return len(tokenizer.encode(framing)) + (group_size * (response + mark) if context == "group_queries" else response)


def query_positions(tokenizer, stu):
    """Indices of tau_stu's policy-sampled tokens that wrote a search query the rollout ran: in each
    turn (a run of policy tokens) whose action (rollout.ACTION, the first tag pair) is a search, the
    tokens that overlap its query and closing tag, "q</search>" of "<search>q</search>"."""
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
    """The PairSequences of tau_stu with `context` (text) added to the teacher's user message: both
    views' token ids and the aligned loss positions, every policy token ("policy") or only those
    inside search queries ("queries")."""
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


def _gather_hidden(model, seqs, positions):
    """Hidden states that predict each listed position (ascending in each sequence):
    (sum of len(positions), d)."""
    dev = model.model.embed_tokens.weight.device
    ids, valid = pad_right(seqs, 0, dev)  # (B, T) each
    select = torch.zeros_like(valid)  # (B, T): the positions that predict a listed token
    for i, ps in enumerate(positions):
        if list(ps) != sorted(set(ps)):
            raise ValueError(f"positions of sequence {i} must be ascending and distinct: {ps}")
        select[i, [p - 1 for p in ps]] = True
    return model.hidden(ids, valid=valid, select=select)  # (N, d), row-major = the listed order


# ----------------------------------------------------------------------------------------------
# 3. the round

def ofsd_round(policy, tokenizer, index, questions, *, group_size, rollout_args, generator, ofsd_students, lora_rank,
               lora_alpha, lora_lr, lora_epochs, ofsd_micro_batch, tau_clip, ofsd_clip, ofsd_context, ofsd_positions,
               max_grad_norm, kl_chunk, lora_seed, log, adapter_dir=None):
    """One OFSD round: G rollouts of the current policy per question, EM rewards, one mined pair per
    question (all ranks' pairs, when distributed), then `distill`. ofsd_students="incorrect" keeps only
    the pairs whose student is incorrect ("any": the paper's rule); ofsd_context is what the teacher
    sees, ofsd_positions where the loss counts; `lora_seed` seeds the order of the pairs;
    `adapter_dir`: where the adapter is saved before its merge (None: not saved). Returns its metrics."""
    with torch.no_grad():
        trajs = rollout(policy, tokenizer, index, [q["question"] for q in questions], group_size, generator=generator,
                        **rollout_args)
    mined = mine(trajs, questions, group_size, ofsd_students)
    # every rank distills all ranks' pairs (the round is cheap; sharded weights are all-gathered
    # layer by layer, so every rank must run the same passes)
    mined = fsdp.all_ranks(mined)
    before = mined_diagnostics(policy, tokenizer, index, mined, rollout_args, kl_chunk, ofsd_context) if mined else {}
    metrics = distill(policy, tokenizer, mined, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_lr=lora_lr,
                      lora_epochs=lora_epochs, ofsd_micro_batch=ofsd_micro_batch, tau_clip=tau_clip,
                      ofsd_clip=ofsd_clip, ofsd_context=ofsd_context, ofsd_positions=ofsd_positions,
                      max_grad_norm=max_grad_norm, kl_chunk=kl_chunk, seed=lora_seed, log=log, adapter_dir=adapter_dir)
    if mined:  # the round's effect on its own questions, by whether the student was incorrect
        after, _ = greedy_scores(policy, tokenizer, index, mined, rollout_args)
        metrics.update(before, **split_em("mined_em_after", after, mined))
    return metrics


# ----------------------------------------------------------------------------------------------
# diagnostics: what a round can teach (the teacher's advantage), and what it taught

SEGMENTS = ("think", "search", "answer")


def greedy_scores(policy, tokenizer, index, mined, rollout_args, context=None):
    """One greedy rollout per mined question from the student view (context None), or the teacher
    view that `context` (one of CONTEXTS) renders: (EM per question, searches per question)."""
    contexts = [privileged(tokenizer, p, context) for p in mined] if context else None
    greedy = dict(rollout_args, temperature=0.0, top_p=1.0)
    with torch.no_grad():
        trajs = rollout(policy, tokenizer, index, [p.stu.question for p in mined], 1,
                        contexts=contexts, generator=None, **greedy)
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
        s_ids, t_ids, s_pos, t_pos = pair_sequences(tokenizer, stu, privileged(tokenizer, pair, context))
        if not s_pos:
            continue
        h_s, h_t = _gather_hidden(model, [s_ids], [s_pos]), _gather_hidden(model, [t_ids], [t_pos])  # (n, d)
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


def mined_diagnostics(policy, tokenizer, index, mined, rollout_args, kl_chunk, context):
    """Before the round: greedy EM from the teacher view (as `context` renders it) and the student
    view (the headroom to distil;
    the teacher's also split by whether the pair's student was incorrect, as mined_em_before is),
    each view's searches a question, the teacher/student disagreement and true KL by segment."""
    student, student_searches = greedy_scores(policy, tokenizer, index, mined, rollout_args)
    teacher, teacher_searches = greedy_scores(policy, tokenizer, index, mined, rollout_args, context)
    out = split_em("teacher_em", teacher, mined)  # overall, and split by whether the student was incorrect
    out.update(student_em=sum(student) / len(student), **split_em("mined_em_before", student, mined))
    out.update(student_searches=sum(student_searches) / len(mined), teacher_searches=sum(teacher_searches) / len(mined))
    out.update(token_diagnostics(policy, tokenizer, mined, kl_chunk, context))
    return out


def distill(model, tokenizer, pairs, *, lora_rank, lora_alpha, lora_lr, lora_epochs, ofsd_micro_batch, tau_clip,
            ofsd_clip, ofsd_context, ofsd_positions, max_grad_norm, kl_chunk, seed, log=None, adapter_dir=None):
    """Distill each Pair's teacher view (what ofsd_context shows) into its student view through LoRA
    at the positions ofsd_positions names, then merge (the adapter saved to `adapter_dir` first, when
    given). `log(epoch, step, loss)` is called after every optimizer step."""
    items = pair_items(model, tokenizer, pairs, ofsd_micro_batch, ofsd_context, ofsd_positions)
    metrics = dict(pairs=len(pairs), incorrect_students=sum(p.incorrect for p in pairs), losses=[])
    if not items:
        return metrics
    params = lora.attach(model, lora_rank, lora_alpha)
    fsdp.broadcast(params)  # every rank trains the same adapter on the same pairs (it is small)
    before = pair_stats(model, items, tau_clip, ofsd_clip, ofsd_micro_batch, kl_chunk)
    loss = lambda m, batch: pair_loss(m, batch, tau_clip, ofsd_clip, kl_chunk)  # noqa: E731
    metrics["losses"] = fit_adapter(model, params, items, loss, lora_lr=lora_lr, lora_epochs=lora_epochs,
                                    micro_batch=ofsd_micro_batch, max_grad_norm=max_grad_norm, seed=seed, log=log)
    after = pair_stats(model, items, tau_clip, ofsd_clip, ofsd_micro_batch, kl_chunk)
    metrics.update({f"{k}_{when}": v for when, d in (("before", before), ("after", after)) for k, v in d.items()})
    lora.merge_trained(model, params, adapter_dir)
    return metrics


def fit_adapter(model, params, data, batch_loss, *, lora_lr, lora_epochs, micro_batch, max_grad_norm, seed, log=None):
    """AdamW on the adapter `params`: `lora_epochs` passes over `data` in an order shuffled by
    random.Random(seed), one step per `micro_batch` items minimising batch_loss(model, items), the
    gradient norm clipped at max_grad_norm. `log(epoch, step, loss)` after every step. Returns the losses."""
    opt = torch.optim.AdamW(params, lr=lora_lr, weight_decay=0.0)
    rng, losses = random.Random(seed), []
    for epoch in range(lora_epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        for s in range(0, len(order), micro_batch):
            loss = batch_loss(model, [data[i] for i in order[s:s + micro_batch]])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            losses.append(loss.item())
            if log:
                log(epoch, len(losses), loss.item())
    return losses


def pair_items(model, tokenizer, pairs, micro_batch, context, positions):
    """(PairSequences, teacher states (n, d)) for each Pair whose student has a loss position (one
    without has nothing to learn); the teacher view is what `context` renders, the positions what
    `positions` names; the teacher states are the model's as it is now, adapter off."""
    data = [pair_sequences(tokenizer, p.stu, privileged(tokenizer, p, context), positions) for p in pairs]
    data = [d for d in data if d.student_pos]
    return list(zip(data, teacher_states(model, data, micro_batch)))


@torch.no_grad()
def teacher_states(model, data, micro_batch):
    """The teacher view's final hidden states at each pair's loss positions, the adapter off:
    a list of (n_i, d), one per PairSequences, computed `micro_batch` pairs at a time."""
    out = []
    with lora.disabled(model):
        for i in range(0, len(data), micro_batch):
            part = data[i:i + micro_batch]
            h_t = _gather_hidden(model, [d.teacher for d in part], [d.teacher_pos for d in part])  # (N, d)
            out += h_t.split([len(d.teacher_pos) for d in part])
    return out


def pair_states(model, items):
    """(student states with the adapter as it is (N, d), the items' teacher states (N, d), the student
    loss positions per pair) for (PairSequences, teacher states) items."""
    s_pos = [d.student_pos for d, _ in items]
    return _gather_hidden(model, [d.student for d, _ in items], s_pos), torch.cat([h for _, h in items]), s_pos


@torch.no_grad()
def pair_stats(model, items, tau_clip, ofsd_clip, ofsd_micro_batch, kl_chunk):
    """Mean over the pairs of each pair's mean over its loss positions (the loss's own weighting)
    of: the loss ("loss", the clipped value training minimises), the true forward KL ("kl_true"), the share
    of positions the clip changed ("clip_frac") and the student's probability of the teacher's
    most likely token ("p_top"). items: (PairSequences, teacher states) as `teacher_states` gives
    them; the student runs with the adapter."""
    sums = dict(loss=0.0, kl_true=0.0, clip_frac=0.0, p_top=0.0)
    for i in range(0, len(items), ofsd_micro_batch):
        part = items[i:i + ofsd_micro_batch]
        h_s, h_t, s_pos = pair_states(model, part)  # (N, d) each
        stats = position_stats(h_s, h_t, model.lm_head_weight, tau_clip, ofsd_clip, kl_chunk)
        lengths = [len(p) for p in s_pos]
        for key, name in (("loss", "loss"), ("kl_true", "kl"), ("clip_frac", "clipped"), ("p_top", "p_top")):
            sums[key] += sum(x.mean().item() for x in stats[name].split(lengths)) / len(items)
    return sums


def pair_loss(model, batch, tau_clip, ofsd_clip, kl_chunk):
    """Mean over the pairs of each pair's mean clipped KL over its loss positions; batch: (PairSequences,
    teacher states) as `teacher_states` gives them (the frozen base's, adapter off)."""
    h_s, h_t, s_pos = pair_states(model, batch)  # (N, d) each
    w = torch.tensor([1.0 / (len(p) * len(batch)) for p in s_pos for _ in p], device=h_s.device)
    return fused_linear_clipped_kl(h_s, h_t, model.lm_head_weight, tau_clip, ofsd_clip, w, kl_chunk)
