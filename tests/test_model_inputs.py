"""Tokenizer, chat template, bad checkpoints, and the optional real Qwen2.5 checks."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from generate import generate

import model

from tokenizer import QWEN2_CHAT_TEMPLATE, Tokenizer

QWEN_CHAT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
             "Who wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_exact(tokenizer):
    """A tokenizer trained here renders Qwen2's template, byte for byte."""
    assert tokenizer.chat_prompt("Who wrote Hamlet?") == QWEN_CHAT


def test_encode_decode_roundtrip(tokenizer):
    """decode(encode(s)) == s, chat tokens are single ids, nothing is added implicitly."""
    s = tokenizer.chat_prompt("Ünïcode, numbers 1912 and <search>Paris</search>?")
    ids = tokenizer.encode(s)
    assert tokenizer.decode(ids) == s
    assert ids[0] == tokenizer.tok.token_to_id("<|im_start|>")


@pytest.mark.skipif(not os.environ.get("QWEN_TOKENIZER"), reason="set QWEN_TOKENIZER to Qwen2.5's tokenizer.json")
def test_real_qwen_tokenizer():
    """The real Qwen2.5 tokenizer: known ids, chat tokens, round trip."""
    tok = Tokenizer(os.environ["QWEN_TOKENIZER"], chat_template=QWEN2_CHAT_TEMPLATE)
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.eos_ids == [151645, 151643]
    ids = tok.encode(QWEN_CHAT)
    assert ids[:3] == [151644, 8948, 198] and tok.decode(ids) == QWEN_CHAT


def _edit(path, fn):
    cfg = json.load(open(os.path.join(path, "config.json")))
    fn(cfg)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))


@pytest.mark.parametrize("change,message", [
    (lambda c: c.pop("hidden_size"), "missing config field"),
    (lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
    (lambda c: c.update(rope_scaling={"type": "yarn", "factor": 4.0}), "rope scaling"),
    (lambda c: c.update(model_type="llama"), "model_type"),
])
def test_bad_config_is_a_clear_error(tiny_checkpoint, change, message):
    """Missing or unsupported config fields fail with a message naming the field and file."""
    _edit(tiny_checkpoint, change)
    with pytest.raises(ValueError, match=message) as e:
        model.load(tiny_checkpoint)
    assert "config.json" in str(e.value)


def test_missing_tensor_is_named(tiny_checkpoint):
    """A checkpoint without one tensor fails naming it."""
    f = os.path.join(tiny_checkpoint, "model.safetensors")
    state = load_file(f)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, f)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        model.load(tiny_checkpoint)


def test_wrong_shape_is_named(tiny_checkpoint):
    """A tensor of the wrong shape fails naming the tensor, the file and both shapes."""
    f = os.path.join(tiny_checkpoint, "model.safetensors")
    state = load_file(f)
    state["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(7)
    save_file(state, f)
    with pytest.raises(ValueError, match=r"k_proj.bias.*\(7,\).*\(32,\)") as e:
        model.load(tiny_checkpoint)
    assert "model.safetensors" in str(e.value)


def test_unexpected_tensor_is_named(tiny_checkpoint):
    """An extra tensor in the checkpoint is an error, not silently ignored."""
    f = os.path.join(tiny_checkpoint, "model.safetensors")
    state = load_file(f)
    state["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(state, f)
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.extra.weight'"):
        model.load(tiny_checkpoint)


def test_missing_tokenizer_is_named(tiny_checkpoint):
    """No tokenizer.json: the error names the missing file."""
    os.remove(os.path.join(tiny_checkpoint, "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        model.load(tiny_checkpoint)


REAL = os.environ.get("QWEN_CHECKPOINT")


@pytest.mark.skipif(not REAL, reason="set QWEN_CHECKPOINT to a real Qwen2.5 folder")
def test_real_checkpoint_matches_transformers():
    """Qwen2.5 float32 logits equal transformers' (<= 1e-3) and 64 greedy tokens are identical."""
    transformers = pytest.importorskip("transformers")
    ours, tok = model.load(REAL)
    ref = transformers.Qwen2ForCausalLM.from_pretrained(REAL, dtype=torch.float32).eval()
    ids = tok.encode(tok.chat_prompt("Write a Python function that reverses a string."))
    with torch.no_grad():
        diff = (ours(torch.tensor([ids])) - ref(torch.tensor([ids])).logits).abs().max().item()
    print(f"real checkpoint max |logit diff| = {diff:.2e}")
    assert diff <= 1e-3
    got, _, _ = generate(ours, tok, [ids], 64, stop_ids=[])
    want = ref.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert got[0] == want[0, len(ids):].tolist()
    print(tok.decode(got[0]))
