"""The clipped forward-KL loss: Triton kernel (TRITON_INTERPRET=1) and chunked paths vs float64."""

import pytest
import torch

import ofsd

triton_cases = pytest.mark.skipif(ofsd.triton is None, reason="triton not installed")


def reference64(s, t, tau):
    """Loss and gradient in float64 through the plain PyTorch spec."""
    s64 = s.detach().double().requires_grad_(True)
    loss = ofsd.clipped_forward_kl_spec(s64, t.double(), tau)
    (g,) = torch.autograd.grad(loss, s64)
    return loss, g


def case(n, v, dtype, spread=3.0, seed=0):
    g = torch.Generator().manual_seed(seed + n * 7919 + v)
    s = (torch.randn(n, v, generator=g) * spread).to(dtype)
    t = (torch.randn(n, v, generator=g) * spread).to(dtype)
    return s, t


TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-3, 2e-3)}  # (loss rel, grad abs)


@pytest.mark.parametrize("path", [pytest.param(True, marks=triton_cases, id="triton"),
                                  pytest.param(False, id="chunked")])
@pytest.mark.parametrize("n,v", [(1, 7), (5, 1000), (13, 3001), (37, 4097)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tau", [1e9, 0.002])  # clip inactive, clip active
def test_matches_float64_reference(path, n, v, dtype, tau):
    """Loss and gradient equal the float64 reference on odd shapes, clip on and off, both dtypes."""
    s, t = case(n, v, dtype)
    want, g_want = reference64(s, t, tau)
    x = s.clone().requires_grad_(True)
    loss = ofsd.clipped_forward_kl(x, t, tau, use_triton=path)
    (g,) = torch.autograd.grad(loss, x)
    rel, atol = TOL[dtype]
    assert abs(loss.item() - want.item()) <= rel * max(1.0, abs(want.item()))
    assert g.dtype == dtype
    assert (g.double() - g_want).abs().max() <= atol / n + 1e-7 if dtype == torch.float32 \
        else (g.double() - g_want).abs().max() <= atol


@pytest.mark.parametrize("path", [pytest.param(True, marks=triton_cases, id="triton"),
                                  pytest.param(False, id="chunked")])
def test_clip_is_active(path):
    """With a small tau_clip the loss is below the unclipped KL and still matches the reference."""
    s, t = case(9, 513, torch.float32, spread=4.0)
    clipped = ofsd.clipped_forward_kl(s, t, 0.001, use_triton=path).item()
    full = ofsd.clipped_forward_kl(s, t, 1e9, use_triton=path).item()
    assert clipped < 0.5 * full
    assert abs(clipped - reference64(s, t, 0.001)[0].item()) <= 1e-5


@pytest.mark.parametrize("path", [pytest.param(True, marks=triton_cases, id="triton"),
                                  pytest.param(False, id="chunked")])
def test_teacher_equals_student_gives_zero(path):
    """Teacher = student: loss 0 and gradient 0."""
    s, _ = case(11, 777, torch.float32)
    x = s.clone().requires_grad_(True)
    loss = ofsd.clipped_forward_kl(x, s, 0.05, use_triton=path)
    (g,) = torch.autograd.grad(loss, x)
    assert abs(loss.item()) <= 1e-6 and g.abs().max() <= 1e-7


@pytest.mark.parametrize("path", [pytest.param(True, marks=triton_cases, id="triton"),
                                  pytest.param(False, id="chunked")])
def test_non_unit_grad_output(path):
    """backward scales the stored gradient by grad_output."""
    s, t = case(6, 301, torch.float32)
    x = s.clone().requires_grad_(True)
    (ofsd.clipped_forward_kl(x, t, 0.01, use_triton=path) * -2.5).backward()
    assert torch.allclose(x.grad.double(), -2.5 * reference64(s, t, 0.01)[1], atol=1e-6)


def test_analytic_gradient_formula():
    """dL/dz = Ps * S - m * Pt (per row, over N) equals autograd of the reference, float64."""
    s, t = case(4, 50, torch.float64)
    tau = 0.01
    ps, pt = s.softmax(-1), t.softmax(-1)
    m = (pt * (pt.log() - ps.log()) <= tau).double()
    S = (m * pt).sum(-1, keepdim=True)
    assert torch.allclose((ps * S - m * pt) / 4, reference64(s, t, tau)[1], atol=1e-12)


def test_fused_linear_equals_logits_path():
    """Hidden states + LM head (no (N, V) logits kept) give the logits path's loss and gradient."""
    g = torch.Generator().manual_seed(0)
    hs, ht = torch.randn(19, 32, generator=g), torch.randn(19, 32, generator=g)
    w = torch.randn(1001, 32, generator=g) * 0.3
    x = hs.clone().requires_grad_(True)
    loss = ofsd.fused_linear_clipped_kl(x, ht, w, 0.01, chunk=5)
    (gx,) = torch.autograd.grad(loss, x)
    y = hs.clone().requires_grad_(True)
    want = ofsd.clipped_forward_kl_spec(y @ w.T, ht @ w.T, 0.01)
    (gy,) = torch.autograd.grad(want, y)
    assert abs(loss.item() - want.item()) <= 1e-5 and torch.allclose(gx, gy, atol=1e-6)
