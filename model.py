"""Qwen2 / Qwen2.5 in plain PyTorch: the network and its Hugging Face checkpoint files.

The architecture is Qwen2ForCausalLM (every Qwen2.5 size, 0.5B to 72B, uses it):
    h = embed(ids)
    for each layer:  h = h + Attn(RMSNorm(h));  h = h + MLP(RMSNorm(h))
    logits = lm_head(RMSNorm(h))            (lm_head = embed^T when tie_word_embeddings)
    RMSNorm(x) = w * x / sqrt(mean(x^2) + eps), computed in float32 (float64 for a float64 model)
    Attn: grouped-query attention, q/k/v with biases, o without; rotary embeddings
          (theta from the config) on q and k; scaled_dot_product_attention. With a mask (a
          cache, left padding) each key-value head's query heads are folded into one batch of
          rows: PyTorch's CPU GQA path repeats K and V per query head, 7x the reads at 0.5B.
    MLP:  down(silu(gate(x)) * up(x))   (SwiGLU)

A forward with a KV cache appends each row's right-padded chunk at that row's own end (the cache
holds how many tokens each row has; padding goes to a scratch slot), so ragged rows share one cache
with no gaps; masks are always "in this row's slots and not in the future". `token_logprobs` is what
a loss reads of a model (nanoGPT's forward with targets): log p at given tokens, the LM head chunked.

Left out on purpose: sliding-window attention and rope scaling (Qwen2.5 does not use them at
<= 32k tokens; such configs are rejected), flash/paged attention, tensor parallelism.

    python model.py CHECKPOINT_DIR        # the checkpoint's config and parameter count
"""

import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tokenizer import Tokenizer


# ----------------------------------------------------------------------------------------------
# config

@dataclass
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    head_dim: int = 0  # 0: hidden_size // num_attention_heads

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_json(cls, path):
        """Read a Hugging Face Qwen2 config.json; unsupported features are a clear error."""
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        if raw.get("architectures", ["Qwen2ForCausalLM"]) != ["Qwen2ForCausalLM"]:
            raise ValueError(f"{path}: architectures is {raw['architectures']!r}, expected ['Qwen2ForCausalLM']")
        if raw.get("model_type", "qwen2") != "qwen2":
            raise ValueError(f"{path}: model_type is {raw['model_type']!r}, expected 'qwen2'")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("use_sliding_window", False):
            raise ValueError(f"{path}: use_sliding_window=true is not supported")
        rope = raw.get("rope_parameters") or {}  # transformers >= 5 writes rope settings here
        if raw.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ValueError(f"{path}: rope scaling is not supported "
                             f"({raw.get('rope_scaling') or rope})")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ValueError(f"{path}: missing config field(s) {missing}")
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            head_dim=raw.get("head_dim") or 0)

    def to_hf_dict(self, dtype):
        d = asdict(self)
        d.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                 use_sliding_window=False, rope_scaling=None, attention_dropout=0.0,
                 torch_dtype=str(dtype).removeprefix("torch."), bos_token_id=None,
                 eos_token_id=None)
        return d


# ----------------------------------------------------------------------------------------------
# model

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))  # float32 at least (float64 stays float64)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, h, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.n_head, self.n_kv, self.head_dim = h, hkv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=True)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache, layer, slots):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:  # the chunk's keys and values go to their slots; it attends to every slot in use
            k, v = cache.write(layer, k, v, slots)  # (B, Hkv, S, D) each
        if mask is None:  # plain causal attention: training passes, a right-padded prefill
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_head != self.n_kv)
        else:  # each key-value head's G query heads folded into its rows (query head h reads key-value
            # head h // G), so K and V are read once per key-value head, not repeated per query head;
            # the mask comes folded the same way from Qwen2.hidden, additive (0 or -inf): (B, 1, G*T, S)
            qf = q.reshape(B, self.n_kv, -1, self.head_dim)  # (B, Hkv, G*T, D), row g*T + t
            y = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask).view(B, self.n_head, T, self.head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # y: (B, H, T, D)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, slots=None, select=None, recompute=False):
        if recompute:  # activation checkpointing: keep x only, recompute the layer in backward
            return checkpoint(self.layer, x, cos, sin, mask, cache, layer, slots, select, use_reentrant=False)
        return self.layer(x, cos, sin, mask, cache, layer, slots, select)

    def layer(self, x, cos, sin, mask, cache, layer, slots, select):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, slots)
        if select is not None:
            x = x[select]  # (n, d): the MLP only where the caller wants an output
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2(nn.Module):
    """Qwen2ForCausalLM; parameter names equal the Hugging Face checkpoint's tensor names."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.checkpoint_layers = False  # True: recompute each decoder layer in backward (activation memory)

    def compute_dtype(self):
        """The dtype the forward computes in (a KV cache's): the weights' (fsdp.shard installs its mixed
        precision's, for weights held in float32 and gathered in the compute dtype)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def lm_head_weight(self):
        """The (V, d) output projection (the embedding matrix when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hidden(self, input_ids, cache=None, valid=None, positions=None, select=None):
        """Final-normed hidden states (B, T, d).

        valid: (B, T) bool, False for padding (default all True). positions: (B, T) rotary
        positions (default: count of valid tokens before). cache: a KV cache (generate.KVCache);
        valid must be right padding; each row's chunk is appended at the row's own end, attending to
        all it holds. select: (B, T) bool; returns only those positions' states, (n, d) in
        row-major order, and the last layer's MLP runs only there (training needs outputs only where
        it has a loss).
        """
        x, cos, sin, mask, slots = self._inputs(input_ids, valid, positions, cache)
        recompute = self.checkpoint_layers and torch.is_grad_enabled() and cache is None
        n = self.config.num_hidden_layers
        for i, block in enumerate(self.model.layers):
            x = block(x, cos, sin, mask, cache, i, slots, select if i == n - 1 else None, recompute)
        if cache is not None:
            cache.end += valid.sum(1) if valid is not None else input_ids.shape[1]
        return self.model.norm(x)

    def _inputs(self, input_ids, valid, positions, cache):
        """A chunk's embeddings (B, T, d), rotary cos and sin (B, 1, T, D), attention mask (None for
        plain causal attention, else additive (B, 1, G*T, S)) and, with a cache, where each token's
        keys and values go: (rows (B, 1), slots (B, T), slots in use S); see `hidden`."""
        B, T = input_ids.shape
        dev = input_ids.device
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=dev)
        q_slot = torch.arange(T, device=dev).expand(B, T)  # (B, T) each query's key slot
        k_slot = torch.arange(T, device=dev)  # (S,) with S = T
        key_valid, slots = valid, None  # (B, S)
        if positions is None:
            positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # (B, T)
        if cache is not None:  # the chunk continues each row at its own end; its padding goes to the scratch
            # slot; it attends to the cache's span of slots (no host sync: a decoding step's shapes are
            # fixed), masked to its row's tokens: the caller sets a span just long enough (KVCache.upto)
            if T > 1 and bool((valid[:, 1:] > valid[:, :-1]).any()):
                raise ValueError("a chunk appended to a KV cache must be right-padded")
            positions = cache.end[:, None] + torch.arange(T, device=dev)  # (B, T) = the slots
            q_slot = torch.where(valid, positions, cache.span)  # (B, T)
            slots = (torch.arange(B, device=dev)[:, None], q_slot)
            k_slot = torch.arange(cache.span, device=dev)  # (S,)
            key_valid = k_slot[None, :] < (cache.end + valid.sum(1))[:, None]  # (B, S)
        cfg = self.config
        x = self.model.embed_tokens(input_ids)  # (B, T, d)
        mask = None  # right padding only, no cache: plain causal attention is exact for every real token
        if cache is not None or not bool((valid[:, 1:] <= valid[:, :-1]).all()):
            S = len(k_slot)
            causal = k_slot[None, None, :] <= q_slot[:, :, None]  # (B, T, S)
            # a padding query attends to itself or (in a cache) to its row's tokens: its output is unused
            allowed = (causal & key_valid[:, None, :]) | (k_slot[None, None, :] == q_slot[:, :, None])  # (B, T, S)
            G = cfg.num_attention_heads // cfg.num_key_value_heads
            allowed = allowed[:, None, None].expand(B, 1, G, T, S).reshape(B, 1, G * T, S)  # (B, 1, G*T, S):
            # row g*T + t is query t of a key-value head's g-th query head (Attention folds them so);
            # additive, in the compute dtype, once: SDPA converts a boolean mask on every call
            mask = torch.zeros((), dtype=x.dtype, device=dev).masked_fill(~allowed, float("-inf"))
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=dev).float() / cfg.head_dim))
        freqs = positions[:, :, None].float() * inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
        return x, emb.cos().to(x.dtype), emb.sin().to(x.dtype), mask, slots

    def forward(self, input_ids, cache=None, valid=None, positions=None):
        """Logits (B, T, V)."""
        return F.linear(self.hidden(input_ids, cache, valid, positions), self.lm_head_weight)


# ----------------------------------------------------------------------------------------------
# log-probabilities at given tokens (as nanoGPT's forward with targets): what a loss reads of a model

HEAD_CHUNK = 512  # loss positions per LM-head chunk at most (memory, not results) ...
HEAD_LOGITS = 1 << 24  # ... and at most this many logits: 110 positions of a 151,936-token vocabulary


def _head(h, weight, targets, temperature):
    """One chunk of the LM head: (C, d) hidden states -> log p(target) and the entropy, each (C,)."""
    logits = F.linear(h, weight)  # (C, V), in float32 at least (float64 stays float64)
    log_p = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def token_logprobs(model, ids, valid, mask, temperature, entropy=False, chunk=None):
    """log p of each token where mask (B, T) is 1, (n,), and with entropy=True each position's entropy,
    (n,): the final hidden states at those positions only, then the LM head a chunk at a time, each
    recomputed in backward (autograd keeps no (n, V) tensor):
        log p(t) = log softmax(h W^T / temperature)[t],   H = -sum_v p(v) log p(v)"""
    chunk = chunk or max(1, min(HEAD_CHUNK, HEAD_LOGITS // model.config.vocab_size))
    pred = mask[:, 1:]  # token t is predicted from position t - 1
    h_sel = model.hidden(ids, valid=valid, select=F.pad(pred, (0, 1)))  # (n, d)
    targets = ids[:, 1:][pred]  # (n,)
    weight, parts = model.lm_head_weight, []  # (V, d), read after hidden(): FSDP2 gathers it there
    for c in range(0, len(targets), chunk):
        args = (h_sel[c:c + chunk], weight, targets[c:c + chunk], temperature)
        parts.append(checkpoint(_head, *args, use_reentrant=False) if torch.is_grad_enabled() else _head(*args))
    logp, ent = (torch.cat(x) for x in zip(*parts)) if parts else (h_sel.new_zeros(0).float(),) * 2  # (n,)
    return (logp, ent) if entropy else logp


# ----------------------------------------------------------------------------------------------
# load / save

def _weight_files(path):
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]  # tensor name -> shard file
        files = {}
        for name, shard in weight_map.items():
            files.setdefault(os.path.join(path, shard), []).append(name)
        return files
    if os.path.isfile(single):
        with _read_safetensors(single) as f:
            return {single: list(f.keys())}
    raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")


def _read_safetensors(file):
    """safe_open, with the file named when it is not a readable safetensors file."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}): truncated or corrupt?") from None


def read_tensors(path, names=None):
    """(file, name, tensor) for each tensor of a checkpoint folder (or those in `names`), the file opened
    per tensor: a safetensors mapping open for a whole load keeps every page it read resident."""
    for file, in_file in _weight_files(path).items():
        for name in in_file if names is None else [n for n in in_file if n in names]:
            with _read_safetensors(file) as f:
                try:
                    t = f.get_tensor(name)
                except SafetensorError as e:
                    raise ValueError(f"{file}: tensor {name!r} cannot be read ({e}): truncated or corrupt?") from None
            yield file, name, t


def load(path, device="cpu", dtype=torch.float32):
    """Load a Hugging Face Qwen2 checkpoint folder -> (model, tokenizer). Strict on every tensor."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: config.json not found")
    cfg = Qwen2Config.from_json(cfg_path)
    tokenizer = Tokenizer(os.path.join(path, "tokenizer.json"))
    with torch.device("meta"):
        model = Qwen2(cfg)
    model = model.to(dtype).to_empty(device=device)  # allocated in `dtype` (the meta model casts for free), filled below
    params = dict(model.named_parameters())
    filled = set()
    for file, name, t in read_tensors(path):
        if name not in params:
            raise ValueError(f"{file}: unexpected tensor {name!r} (not a Qwen2 parameter"
                             f"{'; lm_head is tied' if name == 'lm_head.weight' else ''})")
        if tuple(t.shape) != tuple(params[name].shape):
            raise ValueError(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(t)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return model.eval(), tokenizer


CHECKPOINT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "generation_config.json"}  # what `save` may replace


def save(model, tokenizer, path, state=None, also=()):
    """Write config.json, model.safetensors and tokenizer.json to `path` (temp folder, then rename).
    state: the tensors to write (default: the model's parameters; a sharded model's full state
    dict, gathered on one rank). also: file names besides a checkpoint's that a folder being
    replaced may hold (a caller's own stamp); any other file there makes it an error."""
    state = state if state is not None else {n: p.detach() for n, p in model.named_parameters()}
    names = set(state)
    with torch.device("meta"):
        expected = {n for n, _ in Qwen2(model.config).named_parameters()}
    if names != expected:
        raise ValueError(f"cannot save: parameters {sorted(names ^ expected)[:4]} are not plain Qwen2 "
                         "(merge or remove the LoRA adapter first)")
    allowed = CHECKPOINT_FILES | set(also)
    if os.path.isdir(path) and not set(os.listdir(path)) <= allowed:
        raise ValueError(f"cannot save to {path}: it holds files that are not a checkpoint's "
                         f"({sorted(set(os.listdir(path)) - allowed)[:4]}); nothing was changed")
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    dtype = state["model.embed_tokens.weight"].dtype
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(model.config.to_hf_dict(dtype), f, indent=2)
    state = {n: t.contiguous().cpu() for n, t in state.items()}
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    old = path.rstrip("/") + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)  # what a kill left of the last save's cleanup
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# the batch layout

def pad_right(seqs, pad_id=0, device="cpu"):
    """Token lists -> right-padded ids (B, T) and valid (B, T), the batch layout used everywhere."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        valid[i, :len(s)] = True
    return ids.to(device), valid.to(device)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python model.py CHECKPOINT_DIR")
    net, _ = load(sys.argv[1])
    print(json.dumps(asdict(net.config), indent=1))
    print(f"{sum(p.numel() for p in net.parameters()):,} parameters")
