"""lora.py: identity at attach, the disabled switch, merge, and PEFT compatibility."""

import pytest
import torch

import lora
from model import load, save


def _randomize_b(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora._wrapped(model):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)


IDS = torch.tensor([[5, 9, 13, 40, 77, 120, 3], [8, 8, 9, 200, 31, 2, 1]])


@torch.no_grad()
def test_fresh_adapter_is_identity(tiny_checkpoint):
    """Attaching an adapter (B = 0) leaves the logits unchanged exactly."""
    model, _ = load(tiny_checkpoint)
    before = model(IDS)
    trainable = lora.attach(model, r=4, alpha=8)
    assert torch.equal(model(IDS), before)
    assert all(p.requires_grad for p in trainable)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    assert len(trainable) == 2 * 7 * model.config.num_hidden_layers


@torch.no_grad()
def test_disabled_adapter_is_base(tiny_checkpoint):
    """Inside lora.disabled the trained adapter has no effect; outside it does."""
    model, _ = load(tiny_checkpoint)
    base = model(IDS)
    lora.attach(model, r=4, alpha=8)
    _randomize_b(model)
    adapted = model(IDS)
    with lora.disabled(model):
        assert torch.equal(model(IDS), base)
    assert (adapted - base).abs().max() > 1e-3
    assert torch.equal(model(IDS), adapted)


@torch.no_grad()
def test_merge_equals_adapter(tiny_checkpoint):
    """The merged model equals the adapted one (<= 1e-5) and is plain Qwen2 again."""
    model, tok = load(tiny_checkpoint)
    lora.attach(model, r=4, alpha=8)
    _randomize_b(model)
    adapted = model(IDS)
    lora.merge(model)
    assert not lora._wrapped(model)
    assert (model(IDS) - adapted).abs().max() <= 1e-5


def test_a_bfloat16_adapter_keeps_float32_weights_and_gradients(tiny_checkpoint):
    """On a bfloat16 base the adapter's matmuls run in bfloat16, its weights and gradients stay float32,
    and the gradients are within 4% of the same step in float64 (the base's bfloat16 rounding: 2.2% here,
    as much with the adapter's matmuls in float32)."""
    model, _ = load(tiny_checkpoint)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).float()  # weights that bfloat16 holds exactly
    exact, _ = load(tiny_checkpoint, dtype=torch.float64)
    exact.load_state_dict(model.state_dict())
    grads, target = [], torch.randn(*IDS.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    for m, dt in ((model, torch.bfloat16), (exact, torch.float64)):
        adapter = lora.attach(m.to(dt), r=4, alpha=8)
        _randomize_b(m)
        with torch.no_grad():
            for p, q in zip(adapter, grads[0] if grads else adapter):
                p.copy_(q)  # the same adapter in both
        (m(IDS).double() * target).sum().backward()  # (B, T, V)
        assert all(p.dtype == p.grad.dtype == torch.promote_types(dt, torch.float32) for p in adapter)
        grads.append(adapter)
    for a, b in zip(*grads):
        assert (a.grad.double() - b.grad).norm() <= 0.04 * b.grad.norm()


def test_save_refused_while_adapter_attached(tmp_path, tiny_checkpoint):
    """model.save refuses a model with an unmerged adapter."""
    model, tok = load(tiny_checkpoint)
    lora.attach(model, r=8, alpha=16)
    with pytest.raises(ValueError, match="LoRA"):
        save(model, tok, str(tmp_path / "x"))


@torch.no_grad()
def test_adapter_roundtrip(tmp_path, tiny_checkpoint):
    """save_adapter -> load_adapter on a fresh base reproduces the adapted logits exactly."""
    model, _ = load(tiny_checkpoint)
    lora.attach(model, r=4, alpha=8, targets=("q_proj", "v_proj"))
    _randomize_b(model)
    lora.save_adapter(model, str(tmp_path / "ad"))
    fresh, _ = load(tiny_checkpoint)
    lora.load_adapter(fresh, str(tmp_path / "ad"))
    assert torch.equal(fresh(IDS), model(IDS))


@torch.no_grad()
def test_peft_loads_our_adapter(tmp_path, tiny_checkpoint):
    """peft.PeftModel loads our saved adapter onto transformers' Qwen2 with the same logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model, _ = load(tiny_checkpoint)
    lora.attach(model, r=4, alpha=16)
    _randomize_b(model)
    lora.save_adapter(model, str(tmp_path / "ad"))
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    assert (hf(input_ids=IDS).logits - model(IDS)).abs().max() <= 1e-5
