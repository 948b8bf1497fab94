"""OFSD's loss: the token-level forward KL(teacher || student), clipped, in four implementations.

For one loss position with student logits z and teacher logits z_t over the vocabulary v
(Ps = softmax(z), Pt = softmax(z_t); the teacher carries no gradient), the per-term KL is
    f(v) = Pt(v) log(Pt(v) / Ps(v)),        KL = sum_v f(v)      (f(v) = 0 where Pt(v) = 0: 0 log 0 = 0,
                                                                 so a -inf teacher logit is no NaN)
and `clip` picks how tau_clip caps it:
    "vocab"     l = sum_v min(f(v), tau_clip)      each (position, vocabulary) term (the paper's formula)
    "position"  l = min(KL, tau_clip)              each position's KL
    "none"      l = KL                             plain forward KL
Gradient w.r.t. the student logits (from d(-Pt(v) log Ps(v))/dz_j = -Pt(v) (delta_vj - Ps(j));
a clipped term or position is a constant):
    dl/dz_j = g * (Ps(j) S - m(j) Pt(j)),   S = sum_v m(v) Pt(v)
    vocab:    m(v) = [f(v) <= tau_clip], g = 1
    position: m(v) = 1 (S = 1),          g = [KL <= tau_clip]
    none:     m(v) = 1 (S = 1),          g = 1
Why "vocab" pushes the student away from its teacher: a clipped term (m(j) = 0) gets +Ps(j) S,
so descent lowers Ps(j), and the term most likely to be clipped is the teacher's favourite
token's. Its minimum gives that token no mass: with one clipped token of teacher probability p
the loss falls to tau_clip + (1 - p) log(1 - p) < 0 as Ps(top) -> 0 (METHOD.md has the numbers).
"position" never pushes away (its gradient is the KL's or zero); "none" is the KL's.

The loss is a mean over positions (or a weighted sum, `row_weight`). Implementations:
  clipped_forward_kl_spec   plain PyTorch + autograd: the readable spec (builds several (N, V))
  _loss_and_grad_torch      the loss and its analytic gradient, CPU_ROWS rows at a time
  _clipped_kl_kernel        the same in one Triton program per row (CUDA; TRITON_INTERPRET=1 on CPU)
  fused_linear_clipped_kl   from hidden states and the frozen LM head, chunk rows at a time, so
                            the (N, V) logits never exist: what OFSD training uses

Left out: reverse KL and JSD (the method is forward KL), a backward kernel (the gradient is
computed in the forward pass, backward only scales it).

    python clipped_kl.py      # each path against the spec, every clip mode (Triton needs CUDA)
"""

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheel on this platform: the PyTorch paths still work
    triton = None

CLIPS = ("vocab", "position", "none")


def check_clip(clip):
    if clip not in CLIPS:
        raise ValueError(f"clip={clip!r}: must be one of {', '.join(CLIPS)}")


def clipped_forward_kl_spec(student_logits, teacher_logits, tau_clip, clip="vocab"):
    """mean over positions of the clipped forward KL; (N, V) logits; the readable spec (autograd)."""
    check_clip(clip)
    dt = torch.promote_types(student_logits.dtype, torch.float32)  # float32, or float64 if given
    log_ps = torch.log_softmax(student_logits.to(dt), -1)
    log_pt = torch.log_softmax(teacher_logits.detach().to(dt), -1)
    pt = log_pt.exp()
    terms = torch.where(pt > 0, pt * (log_pt - log_ps), 0.0)  # (N, V) f(v); Pt(v) = 0 -> 0 (0 log 0 = 0)
    if clip == "vocab":
        return terms.clamp(max=tau_clip).sum(-1).mean()
    kl = terms.sum(-1)  # (N,)
    return (kl.clamp(max=tau_clip) if clip == "position" else kl).mean()


CPU_ROWS = 8  # rows per step of the PyTorch path: its (8, V) temporaries stay in the CPU's cache


def _loss_and_grad_torch(zs, zt, tau_clip, clip, row_scale, out):
    """Per-row loss (N,); writes row_scale * dLoss_row/dzs into `out` (N, V), analytically.

    Extra memory is a few (CPU_ROWS, V) float32 temporaries (float64 for float64 logits), whatever N is."""
    dt = torch.promote_types(zs.dtype, torch.float32)
    rows = torch.empty(zs.shape[0], dtype=dt, device=zs.device)
    for c in range(0, zs.shape[0], CPU_ROWS):
        log_ps = torch.log_softmax(zs[c:c + CPU_ROWS].to(dt), -1)  # (C, V)
        log_pt = torch.log_softmax(zt[c:c + CPU_ROWS].to(dt), -1)
        pt = log_pt.exp()
        f = log_pt.sub_(log_ps).mul_(pt).masked_fill_(pt == 0, 0.0)  # (C, V) f(v); Pt(v) = 0 -> 0, not 0 * inf
        scale = row_scale[c:c + CPU_ROWS, None].to(dt)  # (C, 1)
        if clip == "vocab":
            pt.mul_(f <= tau_clip)  # m(v) Pt(v)
            rows[c:c + CPU_ROWS] = f.clamp_(max=tau_clip).sum(-1)
        else:
            kl = f.sum(-1)  # (C,)
            rows[c:c + CPU_ROWS] = kl.clamp(max=tau_clip) if clip == "position" else kl
            if clip == "position":
                scale = scale * (kl <= tau_clip)[:, None]  # g: a clipped position has no gradient
        S = pt.sum(-1, keepdim=True)  # (C, 1)
        out[c:c + CPU_ROWS] = log_ps.exp_().mul_(S).sub_(pt).mul_(scale)
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
        return msk, log_ps, pt, tl.where(pt > 0, pt * (log_pt - log_ps), 0.0)  # Pt(v) = 0 -> 0 (0 log 0 = 0)

    @triton.jit
    def _clipped_kl_kernel(S_ptr, T_ptr, LOSS_ptr, GRAD_ptr, SCALE_ptr, stride_s, stride_t, stride_g,
                           V, tau_clip, CLIP: tl.constexpr, BLOCK: tl.constexpr):
        """One program per row; CLIP 0 = "vocab", 1 = "position", 2 = "none". Online softmax over
        the vocabulary in blocks (nothing (N, V) is materialised besides the gradient output):
          pass 1: lse_s = log sum exp(s), lse_t = log sum exp(t)            (running max + sum)
          pass 2: f(v) = Pt(v) (log Pt(v) - log Ps(v)); vocab: loss = sum_v min(f(v), tau_clip),
                  m(v) = [f(v) <= tau_clip]; else loss = KL = sum_v f(v), m(v) = 1;
                  S = sum_v m(v) Pt(v); position: g = [KL <= tau_clip], loss = min(KL, tau_clip)
          pass 3: grad(v) = scale * g * (Ps(v) S - m(v) Pt(v))   (dLoss/ds(v): backward is a scale)
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
            if CLIP == 0:
                loss += tl.sum(tl.where(msk, tl.minimum(f, tau_clip), 0.0), 0)
                S += tl.sum(tl.where(msk & (f <= tau_clip), pt, 0.0), 0)
            else:
                loss += tl.sum(tl.where(msk, f, 0.0), 0)
                S += tl.sum(tl.where(msk, pt, 0.0), 0)
        scale = tl.load(SCALE_ptr + row)
        if CLIP == 1:
            scale = tl.where(loss <= tau_clip, scale, 0.0)
            loss = tl.minimum(loss, tau_clip)
        for start in range(0, V, BLOCK):
            msk, log_ps, pt, f = _block_terms(s_row, t_row, start, offs, V, lse_s, lse_t)
            if CLIP == 0:
                g = tl.exp(log_ps) * S - tl.where(f <= tau_clip, pt, 0.0)
            else:
                g = tl.exp(log_ps) * S - pt
            tl.store(g_row + start + offs, (g * scale).to(GRAD_ptr.dtype.element_ty), mask=msk)
        tl.store(LOSS_ptr + row + tl.arange(0, 1), loss)


def _loss_and_grad_triton(zs, zt, tau_clip, clip, row_scale, out):
    N, V = zs.shape
    rows = torch.empty(N, dtype=torch.float32, device=zs.device)  # on the input's device
    _clipped_kl_kernel[(N,)](zs, zt, rows, out, row_scale.float().contiguous(), zs.stride(0),
                             zt.stride(0), out.stride(0), V, float(tau_clip), CLIP=CLIPS.index(clip),
                             BLOCK=min(4096, triton.next_power_of_2(V)))
    return rows


def loss_and_grad(zs, zt, tau_clip, clip, row_scale, out, use_triton=None):
    """Per-row loss (N,); writes d(row_scale_r * row_r)/dzs into `out` (N, V), which may be zs
    itself (each element is read before it is overwritten). Triton on CUDA, else PyTorch."""
    check_clip(clip)
    if use_triton is None:
        use_triton = zs.is_cuda and triton is not None
    if use_triton and triton is None:
        raise RuntimeError("use_triton=True, but Triton is not installed (requirements.txt installs it on "
                           "Linux x86-64 only): pass use_triton=None for the PyTorch path")
    if zs.stride(-1) != 1 or zt.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("loss_and_grad needs rows with unit stride (call .contiguous())")
    return (_loss_and_grad_triton if use_triton else _loss_and_grad_torch)(zs, zt, tau_clip, clip, row_scale, out)


class ClippedForwardKL(torch.autograd.Function):
    """Loss and gradient computed together in the forward (chunked over rows); backward scales."""

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, tau_clip, clip, use_triton):
        s, t = student_logits.contiguous(), teacher_logits.contiguous()
        N = s.shape[0]
        grad = torch.empty_like(s)  # the gradient is the only (N, V) tensor this allocates
        rows = loss_and_grad(s, t, tau_clip, clip, torch.full((N,), 1.0 / N, device=s.device), grad, use_triton)
        ctx.save_for_backward(grad)
        return rows.sum() / N

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        if grad_output.item() != 1.0:  # the usual loss.backward() needs no (N, V) copy
            grad = grad * grad_output.to(grad.dtype)
        return grad, None, None, None, None


def clipped_forward_kl(student_logits, teacher_logits, tau_clip, clip="vocab", use_triton=None):
    """The clipped forward KL of (N, V) logits; the Triton kernel on CUDA, chunked PyTorch off it."""
    return ClippedForwardKL.apply(student_logits, teacher_logits.detach(), tau_clip, clip, use_triton)


class FusedLinearClippedKL(torch.autograd.Function):
    """sum_r w_r * loss(h_t[r] W^T || h_s[r] W^T) without ever holding the (N, V) logits."""

    @staticmethod
    def forward(ctx, h_student, h_teacher, weight, row_weight, tau_clip, clip, chunk, use_triton):
        grad_h = torch.empty_like(h_student)
        total = torch.zeros((), dtype=torch.promote_types(h_student.dtype, torch.float32), device=h_student.device)
        for c in range(0, h_student.shape[0], chunk):
            zs = F.linear(h_student[c:c + chunk], weight)  # (C, V)
            zt = F.linear(h_teacher[c:c + chunk], weight)  # (C, V)
            rows = loss_and_grad(zs, zt, tau_clip, clip, row_weight[c:c + chunk], zs, use_triton)  # zs <- dL/dzs
            total += (rows * row_weight[c:c + chunk]).sum()
            grad_h[c:c + chunk] = zs @ weight  # (C, d)
        ctx.save_for_backward(grad_h)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_output.to(grad_h.dtype), None, None, None, None, None, None, None


def fused_linear_clipped_kl(h_student, h_teacher, weight, tau_clip, clip="vocab", row_weight=None, chunk=256,
                            use_triton=None):
    """The loss from hidden states (N, d) and the frozen LM head (V, d); mean over rows by default.
    use_triton: None = the kernel on CUDA, PyTorch off it (as loss_and_grad)."""
    N = h_student.shape[0]
    if row_weight is None:
        row_weight = torch.full((N,), 1.0 / N, device=h_student.device)
    return FusedLinearClippedKL.apply(h_student, h_teacher.detach(), weight.detach(), row_weight, tau_clip, clip,
                                      chunk, use_triton)


@torch.no_grad()
def position_stats(h_student, h_teacher, weight, tau_clip, clip, chunk=256):
    """What the loss sees at each position (N,) each, from hidden states and the LM head:
    loss (the clipped value), kl (the true, unclipped forward KL), clipped (the clip changed this
    position's loss), p_top (the student's probability of the teacher's most likely token),
    teacher_top (that token)."""
    check_clip(clip)
    out = {k: [] for k in ("loss", "kl", "clipped", "p_top", "teacher_top")}
    for c in range(0, h_student.shape[0], chunk):
        log_ps = torch.log_softmax(F.linear(h_student[c:c + chunk], weight).float(), -1)  # (C, V)
        log_pt = torch.log_softmax(F.linear(h_teacher[c:c + chunk], weight).float(), -1)
        pt = log_pt.exp()
        f = torch.where(pt > 0, pt * (log_pt - log_ps), 0.0)  # (C, V), the same rule as every loss path
        kl = f.sum(-1)  # (C,)
        if clip == "vocab":
            loss, clipped = f.clamp(max=tau_clip).sum(-1), (f > tau_clip).any(-1)
        else:
            loss = kl.clamp(max=tau_clip) if clip == "position" else kl
            clipped = kl > tau_clip if clip == "position" else torch.zeros_like(kl, dtype=torch.bool)
        top = log_pt.argmax(-1)  # (C,)
        for k, v in (("loss", loss), ("kl", kl), ("clipped", clipped.float()),
                     ("p_top", log_ps.gather(-1, top[:, None]).squeeze(-1).exp()), ("teacher_top", top)):
            out[k].append(v)
    return {k: torch.cat(v) for k, v in out.items()}


if __name__ == "__main__":
    torch.manual_seed(0)
    s, t = torch.randn(37, 3001, requires_grad=True), torch.randn(37, 3001)
    for clip in CLIPS:
        spec = clipped_forward_kl_spec(s, t, 0.01, clip)
        (g_spec,) = torch.autograd.grad(spec, s)
        for name, use_triton in (("chunked", False), ("triton", True)):
            if use_triton and (triton is None or not torch.cuda.is_available()):
                print(f"{clip:8s} triton: needs CUDA (or TRITON_INTERPRET=1 with CPU tensors in the tests)")
                continue
            x = s.cuda() if use_triton else s
            loss = clipped_forward_kl(x, t.to(x.device), 0.01, clip, use_triton=use_triton)
            (g,) = torch.autograd.grad(loss, s)
            print(f"{clip:8s} {name}: |loss - spec| = {abs(loss.item() - spec.item()):.2e}  "
                  f"max |grad - spec| = {(g - g_spec).abs().max():.2e}")
