"""Batched generation with a preallocated KV cache: prefill, sampling, and turns that stop on
ids or strings, each sampled token's log-probability recorded (what GRPO's pi_old is).

    KVCache                        keys/values of every layer, (L, B, H_kv, max_len + 1, D), and per
                                   row how many tokens it holds; model.hidden appends at each row's end

    extend(model, cache, chunks)   append token lists (one per row, ragged) to the cache: the
                                   prefill, the forced tokens of retrieved text, a decoding step
    sample(logits, T, top_p, gen)  one token per row from softmax(logits / T) restricted to the
                                   smallest set of mass >= top_p (renormalised), by inverse CDF
                                   (over the vocabulary, or over the nucleus in descending order);
                                   the recorded log-prob is log softmax(logits / T) of the token;
                                   `draw` is the same given each row's uniform
    sample_turn(...)               sample until a stop id, a stop string, or max_new_tokens; the
                                   forward runs over the rows still writing (moved to the cache's front)
    generate(...)                  prompts -> new tokens, log-probs, stop reasons

Left out: beam search, speculative decoding, repetition penalties, paged attention.

    python generate.py CHECKPOINT_DIR "Why is the sky blue?"     # greedy chat demo
"""

import sys

import torch
import torch.nn.functional as F

from model import load, pad_right


class KVCache:
    """Preallocated keys/values for every layer, (L, B, H_kv, max_len + 1, D), and per row the number
    of tokens it holds (`end`, (B,)): row b's tokens are in slots 0 .. end[b]-1, in order, and slot i
    holds the token at rotary position i. The last slot is scratch, where padding is written."""

    def __init__(self, cfg, batch, max_len, device, dtype):
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len + 1, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.end = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)

    @property
    def max_len(self):
        return self.k.shape[3] - 1

    def write(self, layer, k, v, where):
        """Write a chunk's keys and values (B, Hkv, T, D) where Qwen2.hidden says: `where` = (rows (B, 1),
        slots (B, T), slots in use S); returns every slot in use, (B, Hkv, S, D) each."""
        rows, slots, S = where
        self.k[layer, rows, :, slots] = k.transpose(1, 2)  # (B, T, Hkv, D) into (B, T) slots
        self.v[layer, rows, :, slots] = v.transpose(1, 2)
        return self.k[layer, :, :, :S], self.v[layer, :, :, :S]

    @property
    def length(self):
        """Slots in use: the longest row's tokens."""
        return int(self.end.max()) if len(self.end) else 0

    def keep(self, rows):
        """Keep only the listed rows, in that order, as rows 0 .. len(rows)-1 (finished ones leave)."""
        self.reorder(rows)
        n = len(rows)
        self.k, self.v, self.end = self.k[:, :n], self.v[:, :n], self.end[:n]

    def take(self, rows, room):
        """A new cache holding copies of the listed rows, with `room` free slots after its longest
        row: a forward over a few rows of a big cache (`put` writes them back)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.end.device)
        s = int(self.end[idx].max())
        L, _, H, _, D = self.k.shape
        k = self.k.new_zeros(L, len(rows), H, s + room + 1, D)  # (L, b, H, s + room + 1, D)
        v = self.v.new_zeros(L, len(rows), H, s + room + 1, D)
        k[:, :, :, :s], v[:, :, :, :s] = self.k[:, idx, :, :s], self.v[:, idx, :, :s]
        return KVCache._of(k, v, self.end[idx].clone())

    def put(self, rows, sub, of=None):
        """Write rows of `sub` (a cache from `take(rows, ...)`, or a prefill) into the listed rows:
        sub's row of[j] into rows[j] (default: sub's rows in order)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.end.device)
        src = slice(None) if of is None else torch.tensor(of, dtype=torch.long, device=self.end.device)
        s = sub.length
        if s > self.max_len:
            raise ValueError(f"KV cache full: a row would hold {s} tokens > max_len {self.max_len}")
        self.k[:, idx, :, :s], self.v[:, idx, :, :s] = sub.k[:, src, :, :s], sub.v[:, src, :, :s]
        self.end[idx] = sub.end[src]

    def front(self, n):
        """A cache over rows 0..n-1 of this one: views of the same buffers, so what the model appends
        to it lands here."""
        return KVCache._of(self.k[:, :n], self.v[:, :n], self.end[:n])

    @staticmethod
    def _of(k, v, end):
        """A cache over the given tensors (views of another cache's, or new ones)."""
        new = object.__new__(KVCache)
        new.k, new.v, new.end = k, v, end
        return new

    def reorder(self, order):
        """Rows 0..len(order)-1 become the rows `order` (distinct rows of this cache), in place."""
        idx = torch.tensor(order, dtype=torch.long, device=self.end.device)
        n, s = len(order), self.length
        self.k[:, :n, :, :s] = self.k[:, idx, :, :s]  # (L, n, H, s, D); the index makes a copy first
        self.v[:, :n, :, :s] = self.v[:, idx, :, :s]
        self.end[:n] = self.end[idx]


def new_cache(model, batch, max_len):
    """An empty cache for `batch` rows of up to `max_len` tokens, on the model's device and dtype."""
    w = model.model.embed_tokens.weight
    return KVCache(model.config, batch, max_len, w.device, w.dtype)

@torch.no_grad()
def extend(model, cache, chunks, logits=None):
    """Append token lists (one per row, any length, possibly empty) to the cache, each at its row's end.

    Returns next-token logits (B, V) for every row: from its last new token, or the given
    `logits` row when its chunk is empty. This is the prefill, the forced-token path and (chunks of
    one token) a decoding step. The last layer's MLP and the LM head run at each row's last token only.
    """
    dev = cache.end.device
    if max(len(c) for c in chunks) == 0:
        return logits
    ids, valid = pad_right(chunks, 0, dev)  # (B, T) each
    n = valid.sum(1)  # (B,)
    last = F.one_hot((n - 1).clamp(min=0), ids.shape[1]).bool() & (n > 0)[:, None]  # (B, T)
    h = model.hidden(ids, cache, valid, select=last)  # (b, d): the rows with a chunk, in order
    new = F.linear(h, model.lm_head_weight).float()  # (b, V)
    if logits is None:
        return new
    out = logits.clone()
    out[n > 0] = new
    return out


NUCLEUS_CANDIDATES = 256  # top-p looks for its nucleus among this many most likely tokens first


def sample(logits, temperature, top_p, generator, rows=None):
    """Pick one token per row; returns (tokens (B,), log p(token) under softmax(logits / T)).
    `rows` (b,): draw for those rows only (returns (b,) each); the generator still advances by one
    uniform per row of `logits`, so what a row draws does not depend on which others are drawn."""
    u = None
    if temperature > 0:  # one uniform per row, drawn for every row
        u = torch.rand(logits.shape[0], 1, generator=generator, device=logits.device, dtype=logits.dtype)  # (B, 1)
    if rows is not None:
        logits, u = logits[rows], (u[rows] if u is not None else None)  # (b, V), (b, 1)
    return draw(logits, temperature, top_p, u)


def draw(logits, temperature, top_p, u):
    """`sample` given each row's uniform u (B, 1) (None when temperature is 0: the argmax)."""
    if temperature == 0:
        tok = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1)
    else:
        # inverse-CDF sampling, one uniform per row (torch.multinomial is ~15x slower at V = 152k);
        # CPU cumsum accumulates in float64, so each float32 CDF entry is off by < 1e-7
        logp = torch.log_softmax(logits / temperature, -1)  # (B, V)
        probs = logp.exp()
        if top_p < 1.0:
            # the nucleus lies among the k most likely tokens when they hold more than top_p: a top-k
            # (B, k) instead of a sort of the whole vocabulary (B, V), 20x faster at V = 152k on CPU;
            # the rows where it may not (a flat distribution) are sorted whole
            sp, si = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[1]), -1)  # (B, k), descending
            tok = _nucleus_draw(sp, si, top_p, u)
            wide = sp.sum(-1) <= top_p  # (B,)
            if wide.any():
                tok[wide] = _nucleus_draw(*probs[wide].sort(-1, descending=True), top_p, u[wide])
        else:
            tok = _inverse_cdf(probs, u).squeeze(-1)  # (B,) over the whole vocabulary
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _inverse_cdf(p, u):
    """The index (B, 1) at quantile u (B, 1) of each row of (unnormalised) probabilities p (B, k)."""
    cdf = p.cumsum(-1)  # (B, k)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1)


def _nucleus_draw(sp, si, top_p, u):
    """The token at quantile u (B, 1) of the nucleus: sp (B, k) probabilities in descending order
    and si (B, k) their token ids; the nucleus is the smallest prefix with mass >= top_p,
    renormalised. Returns (B,) token ids."""
    sp = sp.masked_fill(sp.cumsum(-1) - sp > top_p, 0.0)  # (B, k)
    return si.gather(-1, _inverse_cdf(sp, u)).squeeze(-1)


@torch.no_grad()
def sample_turn(model, tokenizer, cache, logits, active, max_new_tokens, *, temperature=0.0, top_p=1.0,
                generator=None, stop_ids=(), stop_strings=()):
    """Sample up to `max_new_tokens` per active row, each appended to the cache as it is drawn.

    A row stops after a stop id, once its new text contains a stop string (the token that
    completes it is kept), or at the cap. Returns (tokens, logprobs, reasons, logits): per row the
    new token ids, the log-probability of each (see `sample`), why it stopped ("stop_id",
    "stop_string", "length" or None for inactive rows), and next-token logits (B, V).

    The forward pass runs only over the front of the cache: when at most half of the rows it
    computes are still going, those rows are moved to the front (`KVCache.reorder`), so a row that
    closed its search after 40 tokens does not decode on while another writes 200. The rows are put
    back in order before returning. The generator still advances by one uniform per row and step, as
    if no row had stopped, so what a row draws does not depend on when the others stop.
    """
    B = logits.shape[0]
    active = list(active)
    toks, lps, reasons = [[] for _ in range(B)], [[] for _ in range(B)], [None] * B
    stop_ids = set(stop_ids)
    window = max((len(s) for s in stop_strings), default=0) + 1
    dev = cache.end.device
    held = list(range(B))  # the batch row in each cache row; the forward computes the first n
    n, work, logits = B, cache, logits.clone()  # (B, V)
    for _ in range(max_new_tokens):
        going = [i for i in held[:n] if active[i]]
        if not going:
            break
        if len(going) <= n // 2:  # compact: the going rows to the front, the forward over them only
            pos = {r: j for j, r in enumerate(held[:n])}
            held[:n] = going + [i for i in held[:n] if not active[i]]
            cache.reorder([pos[r] for r in held[:n]])
            n, work = len(going), cache.front(len(going))
        fed = torch.tensor([active[i] for i in held[:n]], device=dev)  # (n,) the going rows
        tok, lp = sample(logits, temperature, top_p, generator, rows=torch.tensor(going, device=dev))  # (g,) each
        for i, t, lp_i in zip(going, tok.tolist(), lp.tolist()):
            toks[i].append(t)
            lps[i].append(lp_i)
            if t in stop_ids:
                reasons[i] = "stop_id"
            elif stop_strings and any(s in tokenizer.decode(toks[i][-window:]) for s in stop_strings):
                reasons[i] = "stop_string"
            elif len(toks[i]) == max_new_tokens:
                reasons[i] = "length"
            active[i] = reasons[i] is None
        ids = torch.zeros(n, 1, dtype=torch.long, device=dev)  # (n, 1): padding in the rows not going
        ids[fed, 0] = tok
        h = model.hidden(ids, work, fed[:, None])  # (n, 1, d)
        logits[going] = F.linear(h[fed, 0], model.lm_head_weight).float()  # (g, V)
    if n < B:  # every row back to its own place
        cache.reorder(sorted(range(B), key=held.__getitem__))  # row i <- the cache row that holds i
    return toks, lps, reasons, logits


def generate(model, tokenizer, prompts, max_new_tokens, *, temperature=0.0, top_p=1.0, generator=None,
             stop_ids=None, stop_strings=()):
    """Batched generation for ragged prompts (lists of token ids) -> (tokens, logprobs, reasons)."""
    cache = new_cache(model, len(prompts), max(len(p) for p in prompts) + max_new_tokens + 1)
    logits = extend(model, cache, prompts)
    toks, lps, reasons, _ = sample_turn(
        model, tokenizer, cache, logits, [True] * len(prompts), max_new_tokens,
        temperature=temperature, top_p=top_p, generator=generator,
        stop_ids=tokenizer.eos_ids if stop_ids is None else stop_ids, stop_strings=stop_strings)
    return toks, lps, reasons


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python generate.py CHECKPOINT_DIR MESSAGE")
    model, tok = load(sys.argv[1])
    out, _, _ = generate(model, tok, [tok.encode(tok.chat_prompt(sys.argv[2]))], 64)
    print(tok.decode(out[0]))
