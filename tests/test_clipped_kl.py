"""OFSD's loss (clipped_kl.py), every clip mode through every path: Triton kernel (TRITON_INTERPRET=1)
and chunked against float64, the fused hidden-state path through both, -inf teacher logits, and
which modes move a student toward its teacher."""

import pytest
import torch

import clipped_kl

triton_cases = pytest.mark.skipif(clipped_kl.triton is None, reason="triton not installed")
PATHS = [pytest.param(True, marks=triton_cases, id="triton"), pytest.param(False, id="chunked")]
# bfloat16 keeps 8 significant bits: one step of its grid (an ulp) at x is at most 2^-7 |x|. Writing
# a float32 result as bfloat16 rounds once: to nearest on CUDA (half an ulp), toward zero under
# TRITON_INTERPRET=1 (under one ulp: the interpreter truncates), so either is within 2^-7 |x|.
BF16_ULP = 2.0 ** -7


def reference64(s, t, tau, clip):
    """Loss and gradient in float64 through the plain PyTorch spec (of the same, possibly rounded, inputs)."""
    s64 = s.detach().double().requires_grad_(True)
    loss = clipped_kl.clipped_forward_kl_spec(s64, t.double(), tau, clip)
    (g,) = torch.autograd.grad(loss, s64)
    return loss, g


def case(n, v, dtype, spread=3.0, seed=0):
    g = torch.Generator().manual_seed(seed + n * 7919 + v)
    s = (torch.randn(n, v, generator=g) * spread).to(dtype)
    t = (torch.randn(n, v, generator=g) * spread).to(dtype)
    return s, t


def row_kl(s, t):
    return torch.stack([clipped_kl.clipped_forward_kl_spec(s[i:i + 1].double(), t[i:i + 1].double(), 0.0, "none")
                        for i in range(s.shape[0])])


def grad_bound(g_want, dtype, n):
    """What may separate a path's gradient from the float64 one: one rounding to bfloat16 of each
    element, or float32 arithmetic, plus a floor of 1e-6 / n (bench/gpu_check.py uses it too)."""
    return (BF16_ULP if dtype == torch.bfloat16 else 1e-5) * g_want.abs() + 1e-6 / n


def tau_between(kl):
    """A tau_clip halfway between the two middle row KLs: about half the rows clipped, none on the
    edge (bench/gpu_check.py uses it too)."""
    k = kl.sort().values
    return (k[len(k) // 2 - 1] + k[len(k) // 2]).item() / 2 if len(k) > 1 else k[0].item() / 2


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clip", clipped_kl.CLIPS)
@pytest.mark.parametrize("n,v", [(1, 7), (5, 1000), (13, 3001), (37, 4097)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("active", [False, True], ids=["clip-off", "clip-on"])
def test_matches_float64_reference(path, clip, n, v, dtype, active):
    """Loss and gradient equal float64 on odd shapes, each clip mode, clip active or not, both dtypes."""
    s, t = case(n, v, dtype)
    # "position" clips about half the rows; "vocab" at 0.002 clips terms
    tau = (tau_between(row_kl(s, t)) if clip == "position" else 0.002) if active else 1e9
    want, g_want = reference64(s, t, tau, clip)
    x = s.clone().requires_grad_(True)
    loss = clipped_kl.clipped_forward_kl(x, t, tau, clip, use_triton=path)
    (g,) = torch.autograd.grad(loss, x)
    # the loss is a float32 sum whatever the input dtype; the gradient is written in the input's
    # dtype, so bfloat16 rounds each element once after float32 arithmetic (an all-zero gradient fails)
    assert abs(loss.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    assert g.dtype == dtype
    assert ((g.double() - g_want).abs() <= grad_bound(g_want, dtype, n)).all()
    if active and clip == "position":  # some rows clipped (zero gradient), some not
        assert 0 < int((g.abs().sum(-1) == 0).sum()) < n or n == 1 and not g.any()


@pytest.mark.parametrize("path", PATHS)
def test_clip_modes_differ_as_defined(path):
    """With a small tau_clip, against the definitions written out in float64 (not the spec):
    vocab = mean_p sum_v min(f, tau) < KL, position = mean_p min(KL, tau), none = mean_p KL."""
    s, t = case(9, 513, torch.float32, spread=4.0)
    ps, pt = torch.softmax(s.double(), -1), torch.softmax(t.double(), -1)
    f = pt * (pt.log() - ps.log())  # (N, V) the per-term KL
    tau = 0.001
    want = dict(vocab=f.clamp(max=tau).sum(-1).mean(), position=f.sum(-1).clamp(max=tau).mean(), none=f.sum(-1).mean())
    got = {clip: clipped_kl.clipped_forward_kl(s, t, tau, clip, use_triton=path).item() for clip in clipped_kl.CLIPS}
    for clip in clipped_kl.CLIPS:
        assert abs(got[clip] - want[clip].item()) <= 1e-5 * want[clip].item(), clip
    assert want["vocab"] < 0.5 * want["none"] and want["position"] < 0.5 * want["none"]  # both clips act here


@pytest.mark.parametrize("path", PATHS + [pytest.param("spec", id="spec")])
@pytest.mark.parametrize("clip", clipped_kl.CLIPS)
def test_minus_inf_teacher_logits(path, clip):
    """A teacher logit of -inf (Pt = 0) adds a term of 0 (0 log 0 = 0) in every path and mode: the
    loss and gradient equal the definitions in float64, never NaN."""
    s, t = case(6, 1031, torch.float32)
    t[:, ::7] = -float("inf")  # every seventh entry of every row: impossible for the teacher
    keep = torch.ones(t.shape[1], dtype=torch.bool)
    keep[::7] = False
    tau = tau_between(row_kl(s[:, keep], t[:, keep])) if clip == "position" else 0.002
    x = s.clone().requires_grad_(True)
    loss = (clipped_kl.clipped_forward_kl_spec(x, t, tau, clip) if path == "spec"
            else clipped_kl.clipped_forward_kl(x, t, tau, clip, use_triton=path))
    (g,) = torch.autograd.grad(loss, x)
    ps, pt = torch.softmax(s.double(), -1), torch.softmax(t.double(), -1)
    f = torch.where(pt > 0, pt * (pt.log() - ps.log()), 0.0)
    want = dict(vocab=f.clamp(max=tau).sum(-1), position=f.sum(-1).clamp(max=tau), none=f.sum(-1))[clip].mean()
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert abs(loss.item() - want.item()) <= 1e-5 * max(1.0, want.item())
    g_want = reference64(s, t, tau, clip)[1]
    assert ((g.double() - g_want).abs() <= 1e-5 * g_want.abs() + 1e-6).all()


def test_position_stats_refuses_an_unknown_clip():
    """position_stats names an unknown clip mode instead of reporting "none"'s numbers under it."""
    h = torch.randn(3, 8)
    with pytest.raises(ValueError, match="clip='token'"):
        clipped_kl.position_stats(h, h, torch.randn(11, 8), 0.05, "token")


def test_kernel_without_triton_is_a_named_error(monkeypatch):
    """Asking for the Triton kernel where Triton is not installed says so (no NameError)."""
    monkeypatch.setattr(clipped_kl, "triton", None)
    s, t = case(2, 9, torch.float32)
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        clipped_kl.clipped_forward_kl(s, t, 0.05, "vocab", use_triton=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clip", clipped_kl.CLIPS)
def test_teacher_equals_student_gives_zero(path, clip):
    """Teacher = student: loss 0 and gradient 0, every mode."""
    s, _ = case(11, 777, torch.float32)
    x = s.clone().requires_grad_(True)
    loss = clipped_kl.clipped_forward_kl(x, s, 0.05, clip, use_triton=path)
    (g,) = torch.autograd.grad(loss, x)
    assert abs(loss.item()) <= 1e-6 and g.abs().max() <= 1e-7


@pytest.mark.parametrize("path", PATHS)
def test_non_unit_grad_output(path):
    """backward scales the stored gradient by grad_output."""
    s, t = case(6, 301, torch.float32)
    x = s.clone().requires_grad_(True)
    (clipped_kl.clipped_forward_kl(x, t, 0.01, "vocab", use_triton=path) * -2.5).backward()
    assert torch.allclose(x.grad.double(), -2.5 * reference64(s, t, 0.01, "vocab")[1], atol=1e-6)


@pytest.mark.parametrize("clip", clipped_kl.CLIPS)
def test_analytic_gradient_formula(clip):
    """dL/dz = g * (Ps * S - m * Pt) (per row, over N) equals autograd of the reference, float64."""
    s, t = case(4, 50, torch.float64)
    ps, pt = s.softmax(-1), t.softmax(-1)
    f = pt * (pt.log() - ps.log())  # (N, V)
    tau = tau_between(f.sum(-1)) if clip == "position" else 0.01
    m = (f <= tau).double() if clip == "vocab" else torch.ones_like(f)
    gate = (f.sum(-1, keepdim=True) <= tau).double() if clip == "position" else 1.0
    S = (m * pt).sum(-1, keepdim=True)
    assert torch.allclose(gate * (ps * S - m * pt) / 4, reference64(s, t, tau, clip)[1], atol=1e-12)


def test_direction_from_a_start_near_the_teacher():
    """300 gradient steps from a student near its teacher: "position" and "none" reach the teacher;
    "vocab" (its top-token term clipped) drives the teacher's favourite token out of the student."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1, 50, generator=g)
    t[0, 0] += 7.5  # the teacher's top token: P 0.85
    start = t.clone()
    start[0, 0] -= 0.5  # the student gives it 0.77: its term 0.85 log(0.85 / 0.77) > tau_clip
    true_kl = {}
    for clip in clipped_kl.CLIPS:
        s = start.clone().requires_grad_(True)
        for _ in range(300):
            (grad,) = torch.autograd.grad(clipped_kl.clipped_forward_kl(s, t, 0.05, clip), s)
            with torch.no_grad():
                s -= grad
        true_kl[clip] = clipped_kl.clipped_forward_kl_spec(s.detach(), t, 0.0, "none").item()
        if clip == "vocab":
            assert s.softmax(-1)[0, 0] < 0.1  # the teacher's favourite, abandoned
    kl0 = clipped_kl.clipped_forward_kl_spec(start, t, 0.0, "none").item()  # 0.018
    assert true_kl["position"] < 0.01 * kl0 and true_kl["none"] < 0.01 * kl0
    assert true_kl["vocab"] > 100 * kl0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clip", clipped_kl.CLIPS)
def test_fused_linear_equals_logits_path(path, clip):
    """Hidden states + LM head (no (N, V) logits kept) give the logits path's loss and gradient."""
    g = torch.Generator().manual_seed(0)
    hs, ht = torch.randn(19, 32, generator=g), torch.randn(19, 32, generator=g)
    w = torch.randn(1001, 32, generator=g) * 0.3
    tau = tau_between(row_kl(hs @ w.T, ht @ w.T)) if clip == "position" else 0.01
    x = hs.clone().requires_grad_(True)
    loss = clipped_kl.fused_linear_clipped_kl(x, ht, w, tau, clip, chunk=5, use_triton=path)
    (gx,) = torch.autograd.grad(loss, x)
    y = hs.clone().requires_grad_(True)
    want = clipped_kl.clipped_forward_kl_spec(y @ w.T, ht @ w.T, tau, clip)
    (gy,) = torch.autograd.grad(want, y)
    assert abs(loss.item() - want.item()) <= 1e-5 and torch.allclose(gx, gy, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clip", clipped_kl.CLIPS)
def test_fused_row_weights_are_a_weighted_sum(path, clip):
    """With per-row weights (the per-pair 1 / (|R| B)) the fused loss is sum_r w_r l_r, gradient included."""
    g = torch.Generator().manual_seed(1)
    hs, ht = torch.randn(11, 24, generator=g), torch.randn(11, 24, generator=g)
    w = torch.randn(613, 24, generator=g) * 0.3
    rw = torch.tensor([1 / 6] * 3 + [1 / 16] * 8)  # two pairs of 3 and 8 positions, a batch of 2
    x = hs.clone().requires_grad_(True)
    loss = clipped_kl.fused_linear_clipped_kl(x, ht, w, 0.2, clip, row_weight=rw, chunk=4, use_triton=path)
    (gx,) = torch.autograd.grad(loss, x)
    y = hs.double().requires_grad_(True)
    want = sum(rw[r].double() * clipped_kl.clipped_forward_kl_spec(y[r:r + 1] @ w.T.double(), ht[r:r + 1].double() @ w.T.double(),
                                                          0.2, clip) for r in range(11))
    (gy,) = torch.autograd.grad(want, y)
    assert abs(loss.item() - want.item()) <= 1e-6 and (gx.double() - gy).abs().max() <= 1e-6


@pytest.mark.parametrize("path", PATHS)
def test_gradient_written_into_its_input(path):
    """loss_and_grad with out = the student logits themselves gives the separate buffer's result."""
    s, t = case(7, 1030, torch.float32)
    scale = torch.linspace(0.1, 1.0, 7)
    sep = torch.empty_like(s)
    rows = clipped_kl.loss_and_grad(s, t, 0.01, "vocab", scale, sep, use_triton=path)
    inplace = s.clone()
    rows2 = clipped_kl.loss_and_grad(inplace, t, 0.01, "vocab", scale, inplace, use_triton=path)
    assert torch.equal(rows, rows2) and torch.equal(sep, inplace)
    assert (sep.double() - reference64(s, t, 0.01, "vocab")[1] * 7 * scale[:, None].double()).abs().max() <= 1e-6


def test_unknown_clip_is_refused():
    """A clip mode that does not exist is a named error, not a silent default."""
    s, t = case(2, 9, torch.float32)
    with pytest.raises(ValueError, match="clip='token'"):
        clipped_kl.clipped_forward_kl(s, t, 0.05, "token")
