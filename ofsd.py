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
     student  P_S(q)          = chat(instruction || q)                      then tau_stu
     teacher  P_T(q, tau_ref) = chat(instruction || q || PRIVILEGED(tau_ref)) then tau_stu
   Loss positions R_tau = tau_stu's policy-sampled tokens (its loss_mask), aligned between the
   two sequences; retrieved text and the prompt never count.
3. The round: attach LoRA; the teacher pass runs with the adapter disabled, under no_grad; the
   student pass with it; AdamW on the adapter only, minimising per pair
     L = 1/|R_tau| sum_{p in R_tau} sum_v min(Pt_p(v) log(Pt_p(v) / Ps_p(v)), tau_clip)
   (a token-level forward KL(teacher || student), each (position, vocabulary) term clipped from
   above); then merge the adapter into the base weights: the next GRPO round's policy.
   Each round also measures itself (`mined_diagnostics`, in its metrics): greedy EM on the mined
   questions from the teacher view and from the student view (the headroom there is to distil),
   the share of loss positions where the teacher's most likely token differs from the student's
   sampled one, the clipped KL by segment (think / search / answer), and greedy EM on the mined
   questions before and after the round, split by whether the student was incorrect.
4. The loss, below the method in its own part: `clipped_forward_kl_spec` (plain PyTorch, the
   readable spec), a chunked PyTorch path and a Triton kernel (CUDA) that compute the loss and
   its analytic gradient together, and `fused_linear_clipped_kl`, which starts from hidden
   states and the frozen LM head so the (N, V) logits never exist (what training uses).

Left out: several privileged references per pair (the paper's future work), reverse KL, mixing
OFSD with RL in one loss.

    python ofsd.py        # checks the CPU path and (with CUDA or TRITON_INTERPRET=1) the kernel
"""

import random
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp as FS
import lora
import model as M
from rollout import em_rewards, exact_match, make_prompt, rollout

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheel on this platform: the PyTorch paths still work
    triton = None

PRIVILEGED = ("\n\nFor reference, here is a correct and efficient solution to this question, "
              "with its searches and the retrieved documents:\n{tau_ref}\n")


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
    """(ref index, student index, student is incorrect) for one question's group, or None."""
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
    """One (tau_ref, tau_stu, student_incorrect) per question group that has a correct rollout."""
    pairs = []
    for s in range(0, len(trajs), group_size):
        found = mine_pair(trajs[s:s + group_size], rewards[s:s + group_size])
        if found:
            pairs.append((trajs[s + found[0]], trajs[s + found[1]], found[2]))
    return pairs


# ----------------------------------------------------------------------------------------------
# 2. conditioning

def privileged(tokenizer, ref):
    """The teacher view's addition to the user message: tau_ref's response as a worked solution."""
    return PRIVILEGED.format(tau_ref=tokenizer.decode(ref.tokens[ref.prompt_len:]))


def pair_sequences(tokenizer, ref, stu):
    """Student and teacher token ids plus the aligned loss positions (predicted token indices)."""
    response = stu.tokens[stu.prompt_len:]
    teacher_prompt = tokenizer.encode(tokenizer.chat_prompt(make_prompt(stu.question) + privileged(tokenizer, ref)))
    pos = [p for p in range(stu.prompt_len, len(stu.tokens)) if stu.loss_mask[p]]
    shift = len(teacher_prompt) - stu.prompt_len
    return stu.tokens, teacher_prompt + response, pos, [p + shift for p in pos]


def _gather_hidden(model, seqs, positions):
    """Hidden states that predict each listed position (ascending in each sequence):
    (sum of len(positions), d)."""
    dev = model.model.embed_tokens.weight.device
    ids, valid = M.pad_right(seqs, 0, dev)  # (B, T) each
    select = torch.zeros_like(valid)  # (B, T): the positions that predict a listed token
    for i, ps in enumerate(positions):
        if list(ps) != sorted(set(ps)):
            raise ValueError(f"positions of sequence {i} must be ascending and distinct: {ps}")
        select[i, [p - 1 for p in ps]] = True
    return model.hidden(ids, valid=valid, select=select)  # (N, d), row-major = the listed order


# ----------------------------------------------------------------------------------------------
# 3. the round

def ofsd_round(policy, tokenizer, index, questions, *, group_size, rollout_args, students, lora_rank, lora_alpha,
               lr, epochs, micro_batch, tau_clip, max_grad_norm, kl_chunk, seed, log):
    """One OFSD round: G rollouts of the current policy per question, EM rewards, one mined pair per
    question (all ranks' pairs, when distributed), then `distill`. students="incorrect" keeps only
    the pairs whose student is incorrect ("any": the paper's rule). Returns its metrics."""
    with torch.no_grad():
        trajs = rollout(policy, tokenizer, index, [q["question"] for q in questions], group_size, **rollout_args)
    golds = {q["question"]: q["golden_answers"] for q in questions}
    mined = [(ref, stu, wrong, golds[stu.question])
             for ref, stu, wrong in mine_pairs(trajs, em_rewards(trajs, questions, group_size), group_size)
             if wrong or students == "any"]
    # every rank distills all ranks' pairs (the round is cheap; sharded weights are all-gathered
    # layer by layer, so every rank must run the same passes)
    mined = FS.all_ranks(mined)
    pairs = [(ref, stu, wrong) for ref, stu, wrong, _ in mined]
    before = mined_diagnostics(policy, tokenizer, index, mined, rollout_args, tau_clip, kl_chunk) if mined else {}
    metrics = distill(policy, tokenizer, pairs, lora_rank=lora_rank, lora_alpha=lora_alpha, lr=lr,
                      epochs=epochs, micro_batch=micro_batch, tau_clip=tau_clip, max_grad_norm=max_grad_norm,
                      kl_chunk=kl_chunk, seed=seed, log=log)
    if mined:  # the round's effect on its own questions, by whether the student was incorrect
        after = greedy_em(policy, tokenizer, index, mined, rollout_args)
        metrics.update(before, **split_em("mined_em_after", after, mined))
    return metrics


# ----------------------------------------------------------------------------------------------
# diagnostics: what a round can teach (the teacher's advantage), and what it taught

SEGMENTS = ("think", "search", "answer")


def greedy_em(policy, tokenizer, index, mined, rollout_args, teacher_view=False):
    """Greedy EM on the mined questions from the student view, or the teacher view (tau_ref shown)."""
    contexts = [privileged(tokenizer, ref) for ref, *_ in mined] if teacher_view else None
    greedy = dict(rollout_args, temperature=0.0, top_p=1.0, generator=None)
    with torch.no_grad():
        trajs = rollout(policy, tokenizer, index, [stu.question for _, stu, _, _ in mined], 1,
                        contexts=contexts, **greedy)
    return [exact_match(t.answer, gold) for t, (*_, gold) in zip(trajs, mined)]


def split_em(name, em, mined):
    """Mean EM overall and over the pairs whose student was incorrect / correct (None when none)."""
    def mean(xs):
        return sum(xs) / len(xs) if xs else None
    return {name: mean(em), name + "_incorrect": mean([e for e, m in zip(em, mined) if m[2]]),
            name + "_correct": mean([e for e, m in zip(em, mined) if not m[2]])}


def segment_of(text):
    """The tag a token sits in, given the text before it: think, search, answer, or other."""
    opened = {tag: text.rfind(f"<{tag}>") for tag in SEGMENTS}
    inside = [(i, tag) for tag, i in opened.items() if i >= 0 and text.find(f"</{tag}>", i) < 0]
    return max(inside)[1] if inside else "other"


@torch.no_grad()
def token_diagnostics(model, tokenizer, mined, tau_clip, chunk):
    """Over the loss positions of every pair: the share where the teacher's most likely token is
    not the token the student sampled, and the mean clipped KL of a position in each segment."""
    differ, n, kl = 0, 0, {s: [] for s in SEGMENTS + ("other",)}
    for ref, stu, *_ in mined:
        s_ids, t_ids, s_pos, t_pos = pair_sequences(tokenizer, ref, stu)
        if not s_pos:
            continue
        h_s, h_t = _gather_hidden(model, [s_ids], [s_pos]), _gather_hidden(model, [t_ids], [t_pos])  # (n, d)
        for c in range(0, len(s_pos), chunk):
            log_ps = torch.log_softmax(F.linear(h_s[c:c + chunk], model.lm_head_weight).float(), -1)  # (C, V)
            log_pt = torch.log_softmax(F.linear(h_t[c:c + chunk], model.lm_head_weight).float(), -1)
            terms = (log_pt.exp() * (log_pt - log_ps)).clamp(max=tau_clip).sum(-1)  # (C,)
            sampled = torch.tensor([s_ids[p] for p in s_pos[c:c + chunk]], device=log_pt.device)
            differ += (log_pt.argmax(-1) != sampled).sum().item()
            n += len(sampled)
            for p, term in zip(s_pos[c:c + chunk], terms.tolist()):
                kl[segment_of(tokenizer.decode(s_ids[stu.prompt_len:p]))].append(term)
    out = {"disagree": differ / n if n else None}
    out.update({f"kl_{s}": sum(v) / len(v) if v else None for s, v in kl.items()})
    return out


def mined_diagnostics(policy, tokenizer, index, mined, rollout_args, tau_clip, chunk):
    """Before the round: greedy EM from the teacher and the student views (the headroom to distil),
    the teacher/student disagreement and clipped KL by segment."""
    student = greedy_em(policy, tokenizer, index, mined, rollout_args)
    teacher = greedy_em(policy, tokenizer, index, mined, rollout_args, teacher_view=True)
    out = dict(teacher_em=sum(teacher) / len(teacher), student_em=sum(student) / len(student))
    out.update(split_em("mined_em_before", student, mined))
    out.update(token_diagnostics(policy, tokenizer, mined, tau_clip, chunk))
    return out


def distill(model, tokenizer, pairs, *, lora_rank, lora_alpha, lr, epochs, micro_batch, tau_clip,
            max_grad_norm, kl_chunk, seed, log=None):
    """Distill each pair's teacher view into its student view through LoRA, then merge.
    `log(epoch, step, loss)` is called after every optimizer step."""
    data = [pair_sequences(tokenizer, ref, stu) for ref, stu, _ in pairs]
    data = [d for d in data if d[2]]  # a student with no policy token has nothing to learn
    metrics = dict(pairs=len(pairs), incorrect_students=sum(w for _, _, w in pairs), losses=[])
    if not data:
        return metrics
    params = lora.attach(model, lora_rank, lora_alpha)
    broadcast(params)  # every rank trains the same adapter on the same pairs (it is small)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def mean_kl():
        with torch.no_grad():
            return sum(pair_loss(model, data[i:i + micro_batch], tau_clip, kl_chunk).item() * len(data[i:i + micro_batch])
                       for i in range(0, len(data), micro_batch)) / len(data)

    metrics["kl_before"] = mean_kl()
    rng = random.Random(seed)
    for epoch in range(epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        for s in range(0, len(order), micro_batch):
            loss = pair_loss(model, [data[i] for i in order[s:s + micro_batch]], tau_clip, kl_chunk)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            metrics["losses"].append(loss.item())
            if log:
                log(epoch, len(metrics["losses"]), loss.item())
    metrics["kl_after"] = mean_kl()
    broadcast(params)  # guard against non-deterministic kernels: rank 0's adapter for all
    FS.reshard(model)  # a sharded base takes each rank's slice of the merged update
    lora.merge(model)
    for p in model.parameters():
        p.requires_grad_(True)
    return metrics


def broadcast(tensors):
    if dist.is_initialized():
        for t in tensors:
            dist.broadcast(t.data, 0)


def pair_loss(model, batch, tau_clip, kl_chunk):
    """Mean over the pairs of each pair's mean clipped KL over its loss positions."""
    students, teachers, s_pos, t_pos = zip(*batch)
    with torch.no_grad(), lora.disabled(model):
        h_t = _gather_hidden(model, teachers, t_pos)  # (N, d) teacher: frozen base weights
    h_s = _gather_hidden(model, students, s_pos)  # (N, d) student: adapter active
    w = torch.tensor([1.0 / (len(p) * len(batch)) for p in s_pos for _ in p], device=h_s.device)
    return fused_linear_clipped_kl(h_s, h_t, model.lm_head_weight, tau_clip, w, kl_chunk)


# ==============================================================================================
# ----------------------------------------------------------------------------------------------
# 4. the loss, four implementations of one function: the spec, chunked PyTorch, the Triton
#    kernel, and the fused path from hidden states that training uses

# The loss of one position, over the vocabulary v (teacher probabilities carry no gradient):
#     l = sum_v min(Pt(v) log(Pt(v) / Ps(v)), tau_clip),     Ps = softmax(z), Pt = softmax(z_t)
# and its gradient w.r.t. the student logits z (m(v) = [term v not clipped]):
#     dl/dz_j = Ps(j) * S - m(j) * Pt(j),   S = sum_v m(v) Pt(v)
# (from d(-Pt(v) log Ps(v))/dz_j = -Pt(v) (delta_vj - Ps(j)); clipped terms are constant).

def clipped_forward_kl_spec(student_logits, teacher_logits, tau_clip):
    """mean_p sum_v min(Pt log(Pt / Ps), tau_clip); (N, V) logits; the readable spec (autograd)."""
    dt = torch.promote_types(student_logits.dtype, torch.float32)  # float32, or float64 if given
    log_ps = torch.log_softmax(student_logits.to(dt), -1)
    log_pt = torch.log_softmax(teacher_logits.detach().to(dt), -1)
    terms = torch.where(log_pt > -float("inf"), log_pt.exp() * (log_pt - log_ps), 0.0)  # (N, V)
    return terms.clamp(max=tau_clip).sum(-1).mean()


CPU_ROWS = 8  # rows per step of the PyTorch path: its (8, V) temporaries stay in cache (measured)


def _loss_and_grad_torch(zs, zt, tau_clip, row_scale, out):
    """Per-row clipped KL (N,); writes row_scale * dLoss_row/dzs into `out` (N, V), analytically.

    Extra memory is a few (CPU_ROWS, V) float32 temporaries, whatever N is."""
    rows = torch.empty(zs.shape[0], dtype=torch.float32, device=zs.device)
    for c in range(0, zs.shape[0], CPU_ROWS):
        log_ps = torch.log_softmax(zs[c:c + CPU_ROWS].float(), -1)  # (C, V)
        log_pt = torch.log_softmax(zt[c:c + CPU_ROWS].float(), -1)
        pt = log_pt.exp()
        f = log_pt.sub_(log_ps).mul_(pt)  # (C, V) the per-entry KL terms Pt log(Pt / Ps)
        keep = f <= tau_clip
        rows[c:c + CPU_ROWS] = f.clamp_(max=tau_clip).sum(-1)
        pt.mul_(keep)  # m(v) Pt(v)
        S = pt.sum(-1, keepdim=True)  # (C, 1)
        out[c:c + CPU_ROWS] = log_ps.exp_().mul_(S).sub_(pt).mul_(row_scale[c:c + CPU_ROWS, None])
    return rows


if triton is not None:
    @triton.jit
    def _block_terms(s_row, t_row, start, offs, V, lse_s, lse_t):
        """One vocabulary block of a row: (in range, log Ps, Pt, f = Pt (log Pt - log Ps))."""
        msk = start + offs < V
        s = tl.load(s_row + start + offs, mask=msk, other=0.0).to(tl.float32)
        t = tl.load(t_row + start + offs, mask=msk, other=0.0).to(tl.float32)
        log_ps = s - lse_s
        log_pt = t - lse_t
        pt = tl.exp(log_pt)
        return msk, log_ps, pt, pt * (log_pt - log_ps)

    @triton.jit
    def _clipped_kl_kernel(S_ptr, T_ptr, LOSS_ptr, GRAD_ptr, SCALE_ptr, stride_s, stride_t, stride_g,
                           V, tau_clip, BLOCK: tl.constexpr):
        """One program per row. Online softmax over the vocabulary in blocks (nothing (N, V) is
        materialised besides the gradient output):
          pass 1: lse_s = log sum exp(s), lse_t = log sum exp(t)            (running max + sum)
          pass 2: f(v) = Pt(v) (log Pt(v) - log Ps(v)),  loss = sum_v min(f(v), tau_clip),
                  S = sum_v m(v) Pt(v) with m(v) = [f(v) <= tau_clip]
          pass 3: grad(v) = scale * (Ps(v) S - m(v) Pt(v))   (dLoss/ds(v), so backward is a scale)
        """
        row = tl.program_id(0).to(tl.int64)
        s_row, t_row, g_row = S_ptr + row * stride_s, T_ptr + row * stride_t, GRAD_ptr + row * stride_g
        offs = tl.arange(0, BLOCK)
        m_s = tl.full([1], float("-inf"), tl.float32)
        m_t = tl.full([1], float("-inf"), tl.float32)
        d_s = tl.zeros([1], tl.float32)
        d_t = tl.zeros([1], tl.float32)
        for start in range(0, V, BLOCK):
            msk = start + offs < V
            s = tl.load(s_row + start + offs, mask=msk, other=float("-inf")).to(tl.float32)
            t = tl.load(t_row + start + offs, mask=msk, other=float("-inf")).to(tl.float32)
            new_s = tl.maximum(m_s, tl.max(s, 0))
            new_t = tl.maximum(m_t, tl.max(t, 0))
            d_s = d_s * tl.exp(m_s - new_s) + tl.sum(tl.exp(s - new_s), 0)
            d_t = d_t * tl.exp(m_t - new_t) + tl.sum(tl.exp(t - new_t), 0)
            m_s, m_t = new_s, new_t
        lse_s = m_s + tl.log(d_s)
        lse_t = m_t + tl.log(d_t)
        loss = tl.zeros([1], tl.float32)
        S = tl.zeros([1], tl.float32)
        for start in range(0, V, BLOCK):
            msk, log_ps, pt, f = _block_terms(s_row, t_row, start, offs, V, lse_s, lse_t)
            keep = msk & (f <= tau_clip)
            loss += tl.sum(tl.where(msk, tl.minimum(f, tau_clip), 0.0), 0)
            S += tl.sum(tl.where(keep, pt, 0.0), 0)
        scale = tl.load(SCALE_ptr + row)
        for start in range(0, V, BLOCK):
            msk, log_ps, pt, f = _block_terms(s_row, t_row, start, offs, V, lse_s, lse_t)
            g = tl.exp(log_ps) * S - tl.where(f <= tau_clip, pt, 0.0)
            tl.store(g_row + start + offs, (g * scale).to(GRAD_ptr.dtype.element_ty), mask=msk)
        tl.store(LOSS_ptr + row + tl.arange(0, 1), loss)


def _loss_and_grad_triton(zs, zt, tau_clip, row_scale, out):
    N, V = zs.shape
    rows = torch.empty(N, dtype=torch.float32, device=zs.device)  # on the input's device
    _clipped_kl_kernel[(N,)](zs, zt, rows, out, row_scale.float().contiguous(), zs.stride(0),
                             zt.stride(0), out.stride(0), V, float(tau_clip),
                             BLOCK=min(4096, triton.next_power_of_2(V)))
    return rows


def loss_and_grad(zs, zt, tau_clip, row_scale, out, use_triton=None):
    """Per-row clipped KL (N,); writes d(row_scale_r * row_r)/dzs into `out` (N, V), which may be
    zs itself (each element is read before it is overwritten). Triton on CUDA, else PyTorch."""
    if use_triton is None:
        use_triton = zs.is_cuda and triton is not None
    if zs.stride(-1) != 1 or zt.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("loss_and_grad needs rows with unit stride (call .contiguous())")
    return (_loss_and_grad_triton if use_triton else _loss_and_grad_torch)(zs, zt, tau_clip, row_scale, out)


class ClippedForwardKL(torch.autograd.Function):
    """Loss and gradient computed together in the forward (chunked over rows); backward scales."""

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, tau_clip, use_triton):
        s, t = student_logits.contiguous(), teacher_logits.contiguous()
        N = s.shape[0]
        grad = torch.empty_like(s)  # the gradient is the only (N, V) tensor this allocates
        rows = loss_and_grad(s, t, tau_clip, torch.full((N,), 1.0 / N, device=s.device), grad, use_triton)
        ctx.save_for_backward(grad)
        return rows.sum() / N

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        if grad_output.item() != 1.0:  # the usual loss.backward() needs no (N, V) copy
            grad = grad * grad_output.to(grad.dtype)
        return grad, None, None, None


def clipped_forward_kl(student_logits, teacher_logits, tau_clip, use_triton=None):
    """The clipped forward KL of (N, V) logits; the Triton kernel on CUDA, chunked PyTorch off it."""
    return ClippedForwardKL.apply(student_logits, teacher_logits.detach(), tau_clip, use_triton)


class FusedLinearClippedKL(torch.autograd.Function):
    """sum_r w_r * clipped_KL(h_t[r] W^T || h_s[r] W^T) without ever holding the (N, V) logits."""

    @staticmethod
    def forward(ctx, h_student, h_teacher, weight, row_weight, tau_clip, chunk):
        grad_h = torch.empty_like(h_student)
        total = torch.zeros((), device=h_student.device)
        for c in range(0, h_student.shape[0], chunk):
            zs = F.linear(h_student[c:c + chunk], weight)  # (C, V)
            zt = F.linear(h_teacher[c:c + chunk], weight)  # (C, V)
            rows = loss_and_grad(zs, zt, tau_clip, row_weight[c:c + chunk], out=zs)  # zs <- dL/dzs
            total += (rows * row_weight[c:c + chunk]).sum()
            grad_h[c:c + chunk] = zs @ weight  # (C, d)
        ctx.save_for_backward(grad_h)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_output.to(grad_h.dtype), None, None, None, None, None


def fused_linear_clipped_kl(h_student, h_teacher, weight, tau_clip, row_weight=None, chunk=256):
    """Clipped forward KL from hidden states (N, d) and the frozen LM head (V, d); mean by default."""
    N = h_student.shape[0]
    if row_weight is None:
        row_weight = torch.full((N,), 1.0 / N, device=h_student.device)
    return FusedLinearClippedKL.apply(h_student, h_teacher.detach(), weight.detach(), row_weight, tau_clip, chunk)


if __name__ == "__main__":
    torch.manual_seed(0)
    s, t = torch.randn(37, 3001, requires_grad=True), torch.randn(37, 3001)
    spec = clipped_forward_kl_spec(s, t, 0.01)
    (g_spec,) = torch.autograd.grad(spec, s)
    for name, fn in [("chunked", lambda: clipped_forward_kl(s, t, 0.01, use_triton=False)),
                     ("triton", lambda: clipped_forward_kl(s, t, 0.01, use_triton=True))]:
        if name == "triton" and (triton is None or not (torch.cuda.is_available())):
            print("triton: needs CUDA (or TRITON_INTERPRET=1 with CPU tensors in the tests)")
            continue
        loss = fn()
        (g,) = torch.autograd.grad(loss, s)
        print(f"{name}: |loss - spec| = {abs(loss.item() - spec.item()):.2e}  max |grad - spec| = {(g - g_spec).abs().max():.2e}")
