"""The teacher inside GRPO: token credit from the group's successful sibling (RLSD, arXiv 2604.03128).

OFSD distils what the privileged teacher would write; here the teacher only weighs the tokens GRPO's
own rollouts wrote. In a group with a correct rollout, tau_ref is the correct one with the fewest
searches (ofsd.reference); every other row o with advantage A != 0 gets, at each token t it sampled,

    w_t = clip(exp(sign(A) (log p_T(t) - log p_S(t))), 1 - eps, 1 + eps)          (no gradient)
    A_t = A ((1 - lambda) + lambda w_t),   lambda = lambda_0 max(0, 1 - (step - 1) / decay_steps)

p_T: the current policy with tau_ref shown in its prompt as ofsd.privileged renders `context`; p_S: the
same weights on the rollout's own prompt, at the same tokens and positions (one code path: an empty
context gives w = 1 exactly). A correct row's tokens the teacher also expects gain credit, a failed
row's tokens the teacher would not write take more of the blame, each by at most eps. tau_ref itself
gets w = 1 (the teacher would read the trajectory it is asked about), and so does every row of a group
without both outcomes: its A is 0, and a credit multiplies A. `token_stats` says where the credit went.

Left out: HSD's answer-only teacher for groups with no correct rollout (their A is 0 here), a teacher
other than the policy itself, the credit inside the OFSD round.

    python evolve.py --ofsd_rounds=false --credit_lambda=0.5     # GRPO with the credit (docs/ablation.md)
"""

import torch

import ofsd
from model import pad_right, token_logprobs
from teacher_gap import segment_of

SEGMENTS = ("think", "search", "answer")


def token_weights(logp_teacher, logp_student, sign, eps):
    """w = clip(exp(sign (log p_T - log p_S)), 1 - eps, 1 + eps), elementwise: (n,) -> (n,)."""
    return torch.exp(sign * (logp_teacher - logp_student)).clamp(1 - eps, 1 + eps)


def credited(advantage, w, lam):
    """Each token's advantage A ((1 - lambda) + lambda w): lambda 0 gives A itself, bit for bit."""
    return advantage * ((1 - lam) + lam * w)


def token_advantages(advantages, weights, lam):
    """Each row's advantage: the float A where the teacher did not weigh it (w None), else A_t on each of
    its sampled tokens (grpo.grpo_step takes either)."""
    return [a if w is None else [credited(a, x, lam) for x in w] for a, w in zip(advantages, weights)]


def schedule(lam, decay_steps, step):
    """lambda at the run's step `step` (from 1): lam falling linearly to 0 over decay_steps (0: constant)."""
    return lam * max(0.0, 1 - (step - 1) / decay_steps) if decay_steps else lam


@torch.no_grad()
def view_logprobs(model, tokenizer, trajs, contexts, temperature, micro_batch):
    """For each trajectory, (log p of its sampled tokens with `context` added to its user message,
    log p of the same tokens on its own prompt): two (n_i,) tensors, the same code path for both."""
    out = []
    for s in range(0, len(trajs), micro_batch):
        part = [ofsd.pair_sequences(tokenizer, t, c) for t, c in zip(trajs[s:s + micro_batch], contexts[s:s + micro_batch])]
        views = []
        for seqs, pos in (([p.teacher for p in part], [p.teacher_pos for p in part]),
                          ([p.student for p in part], [p.student_pos for p in part])):
            ids, valid = pad_right(seqs, tokenizer.pad_id, model.model.embed_tokens.weight.device)  # (B, T) each
            mask = torch.zeros_like(valid)  # (B, T): the sampled tokens
            for i, ps in enumerate(pos):
                mask[i, ps] = True
            views.append(token_logprobs(model, ids, valid, mask, temperature).float().split([len(ps) for ps in pos]))
        out += list(zip(*views))
    return out


def group_weights(model, tokenizer, trajs, rewards, advantages, group_size, context, eps, temperature, micro_batch):
    """Per trajectory (question-major, group_size a group) its w over its sampled tokens in order, or
    None (w = 1: tau_ref, A = 0, a group without a correct rollout). Returns (weights, tau_ref of each
    trajectory or None)."""
    rows, refs = [], [None] * len(trajs)
    for s in range(0, len(trajs), group_size):
        ref = ofsd.reference(trajs[s:s + group_size], rewards[s:s + group_size])
        for i in range(s, s + group_size):
            if ref is not None and i != s + ref and advantages[i] != 0:
                rows.append(i)
                refs[i] = trajs[s + ref]
    contexts = [ofsd.privileged(tokenizer, ofsd.Pair(refs[i], trajs[i], rewards[i] <= 0), context) for i in rows]
    weights = [None] * len(trajs)
    for i, (lt, ls) in zip(rows, view_logprobs(model, tokenizer, [trajs[i] for i in rows], contexts, temperature,
                                               micro_batch)):
        weights[i] = token_weights(lt.double(), ls.double(), 1.0 if advantages[i] > 0 else -1.0, eps).tolist()  # float64: w in bounds exactly
    return weights, refs


def token_segments(tokenizer, traj):
    """The segment (think, search, answer, other) of each token the policy sampled, in order."""
    text, out = "", []
    for tok, m in zip(traj.tokens[traj.prompt_len:], traj.loss_mask[traj.prompt_len:]):
        if m:
            out.append(segment_of(text))
        text += tokenizer.decode([tok])  # byte-level pieces: the tags survive any split
    return out


def departure(traj, ref):
    """Index (among traj's sampled tokens) of its first token not at the same place in tau_ref's
    response: where the failed row leaves its successful sibling's path."""
    a, b = traj.tokens[traj.prompt_len:], ref.tokens[ref.prompt_len:]
    first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return sum(traj.loss_mask[traj.prompt_len:traj.prompt_len + first])


def token_stats(tokenizer, trajs, advantages, weights, refs):
    """Where the credit went: the mean w - 1 on think, search and answer tokens, apart for rows with
    A > 0 ("pos") and A < 0 ("neg"), and the share of the failed rows' |w - 1| after their first
    departure from tau_ref (None where there is nothing to average)."""
    sums = {(sign, seg): [0.0, 0] for sign in ("pos", "neg") for seg in SEGMENTS}
    after, total = 0.0, 0.0
    for t, a, w, ref in zip(trajs, advantages, weights, refs):
        if w is None:
            continue
        sign = "pos" if a > 0 else "neg"
        for seg, x in zip(token_segments(tokenizer, t), w):
            if seg in SEGMENTS:
                sums[sign, seg][0] += x - 1
                sums[sign, seg][1] += 1
        if a < 0:
            d = departure(t, ref)
            after += sum(abs(x - 1) for x in w[d:])
            total += sum(abs(x - 1) for x in w)
    out = {f"{seg}_{sign}": (s / n if n else None) for (sign, seg), (s, n) in sums.items()}
    out["after_departure"] = after / total if total else None
    return out
