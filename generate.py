"""Decoding: a preallocated KV cache, prefill, sampling, and turns that stop on ids or strings, each
sampled token's log-probability recorded (what GRPO's pi_old is), behind one call (`decode`).

    KVCache                        keys/values of every layer, (L, B, H_kv, max_len + 1, D), and per
                                   row how many tokens it holds; model.hidden appends at each row's end

    extend(model, cache, chunks)   append token lists (one per row, ragged) to the cache: the
                                   prefill, the forced tokens of retrieved text
    decode_step(model, cache, ...) one token for every row of the cache, rows not writing masked:
                                   static shapes, no host sync, so `compile` can wrap it
                                   (torch.compile; on CUDA as CUDA graphs)
    draw(logits, T, top_p, u)      one token per row from softmax(logits / T) restricted to the
                                   smallest set of mass >= top_p (renormalised), by inverse CDF at
                                   the row's own uniform; the recorded log-prob is log softmax(logits / T)
    decode(...)                    the engine: G continuations of each prompt, turn by turn, each
                                   trajectory drawing from its own row of uniforms; the caller's
                                   turn_end says what each row reads next (an observation) or stop;
                                   continuous batching over a bounded number of cache rows
    generate(...)                  prompts -> one turn each: new tokens, log-probs, stop reasons

Left out: beam search, speculative decoding, repetition penalties, paged attention.

    python generate.py CHECKPOINT_DIR "Why is the sky blue?"     # greedy chat demo
"""

import functools
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import load, pad_right


class KVCache:
    """Preallocated keys/values for every layer, (L, B, H_kv, max_len + 1, D), and per row the number
    of tokens it holds (`end`, (B,)): row b's tokens are in slots 0 .. end[b]-1, in order, and slot i
    holds the token at rotary position i. A forward reads slots 0 .. span - 1 and writes padding to
    slot `span`, a scratch slot it does not read (span = max_len, or less through `upto`). The tensors
    are allocated empty and zeroed slot by slot as forwards first reach them (`_clear`): a cache sized
    for the longest possible row takes memory only for the slots its rows have reached."""

    def __init__(self, cfg, batch, max_len, device, dtype):
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len + 1, cfg.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.end = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)
        self.span = max_len
        self.cleared = [0]  # slots 0 .. cleared[0] - 1 are zero or written, in every row; shared with views

    def _clear(self, n):
        """Zero slots cleared .. n - 1 of every row, the first time a forward or a copy reaches them."""
        c = self.cleared[0]
        if n > c:
            self.k[:, :, :, c:n].zero_()
            self.v[:, :, :, c:n].zero_()
            self.cleared[0] = n

    @property
    def max_len(self):
        return self.k.shape[3] - 1

    def write(self, layer, k, v, where):
        """Write a chunk's keys and values (B, Hkv, T, D) where Qwen2.hidden says: `where` = (rows (B, 1),
        slots (B, T)); returns slots 0 .. span - 1 of the layer, (B, Hkv, span, D) each. The write is an
        in-place index_put_ on the whole cache tensor, which torch.compile keeps in place (on a view of
        it, a compiled step would copy the whole cache back)."""
        if not torch.compiler.is_compiling():  # (a compiled step's caller cleared them: `upto`)
            self._clear(self.span + 1)
        rows, slots = where
        heads = torch.arange(k.shape[1], device=k.device)
        at = (torch.full_like(rows, layer)[:, :, None], rows[:, :, None], heads[None, :, None], slots[:, None, :])
        self.k.index_put_(at, k)  # (B, Hkv, T) positions of (L, B, Hkv, S, D), each a (D,) vector
        self.v.index_put_(at, v)
        return self.k[layer, :, :, :self.span], self.v[layer, :, :, :self.span]

    def upto(self, span):
        """The same cache (its tensors, not copies) with forwards reading slots 0 .. span - 1 only, so
        they read no more than the rows hold; span must be at least every row's length after the
        forward. Slot span is then the scratch slot: no row holds it yet, and the forward does not read it."""
        if span > self.max_len:
            raise ValueError(f"KV cache full: a row would hold {span} tokens > max_len {self.max_len}")
        self._clear(span + 1)
        view = KVCache._of(self.k, self.v, self.end)
        view.span, view.cleared = span, self.cleared
        return view

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
        sub = KVCache._of(k, v, self.end[idx].clone())
        sub._copy_rows(slice(None), self, idx, s)
        return sub

    def put(self, rows, sub, of=None):
        """Write rows of `sub` (a cache from `take(rows, ...)`, or a prefill) into the listed rows:
        sub's row of[j] into rows[j] (default: sub's rows in order)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.end.device)
        src = slice(None) if of is None else torch.tensor(of, dtype=torch.long, device=self.end.device)
        s = sub.length
        if s > self.max_len:
            raise ValueError(f"KV cache full: a row would hold {s} tokens > max_len {self.max_len}")
        self._clear(s)
        self._copy_rows(idx, sub, src, s)
        self.end[idx] = sub.end[src]

    def _copy_rows(self, rows, src, src_rows, s):
        """Slots :s of `rows` <- those of src's `src_rows`, a layer at a time: an index copies what it
        reads, so a copy of every layer at once would hold those rows' whole span twice."""
        for i in range(self.k.shape[0]):
            self.k[i, rows, :, :s], self.v[i, rows, :, :s] = src.k[i, src_rows, :, :s], src.v[i, src_rows, :, :s]

    @staticmethod
    def _of(k, v, end):
        """A cache over the given tensors (views of another cache's, or new ones)."""
        new = object.__new__(KVCache)
        new.k, new.v, new.end, new.span, new.cleared = k, v, end, k.shape[3] - 1, [k.shape[3]]
        return new

    def reorder(self, order):
        """Rows 0..len(order)-1 become the rows `order` (distinct rows of this cache), in place."""
        idx = torch.tensor(order, dtype=torch.long, device=self.end.device)
        n, s = len(order), self.length
        self._copy_rows(slice(0, n), self, idx, s)  # the index reads its rows before they are written
        self.end[:n] = self.end[idx]


def new_cache(model, batch, max_len):
    """An empty cache for `batch` rows of up to `max_len` tokens, on the model's device and dtype."""
    return KVCache(model.config, batch, max_len, model.model.embed_tokens.weight.device, model.compute_dtype())

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
    h = model.hidden(ids, cache.upto(int((cache.end + n).max())), valid, select=last)  # (b, d): rows with a chunk
    new = F.linear(h, model.lm_head_weight).float()  # (b, V)
    if logits is None:
        return new
    out = logits.clone()
    out[n > 0] = new
    return out


NUCLEUS_CANDIDATES = 256  # top-p looks for its nucleus among this many most likely tokens first


def draw(logits, temperature, top_p, u):
    """One token per row and its log-probability, (B,) each: from softmax(logits / T) restricted to
    the smallest set of mass >= top_p (renormalised), by inverse CDF at each row's uniform u (B, 1);
    the log-prob is log softmax(logits / T) of the token. temperature 0 (u None): the argmax."""
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


SPAN_STEP = 64  # a compiled decoding step reads the cache's first k * SPAN_STEP slots: a few shapes, each compiled once
CACHE_STEP = 4 * SPAN_STEP  # a compiled decode's cache length is a multiple of this: few strides


def round_up(n, step):
    """n rounded up to a multiple of step."""
    return -(-n // step) * step


def decode_step(model, cache, tok, writing, every_row=True):
    """One token for each cache row that is writing, (B,) each: the next-token logits of every row,
    (B, V). Static shapes, no host sync: a row not writing writes its token to the scratch slot and
    keeps its length (its logits are unused). This is what `compile` wraps. every_row=False (eager):
    the last layer's MLP and the LM head run for the writing rows only, whose logits it returns, (n, V)."""
    h = model.hidden(tok[:, None], cache, writing[:, None], select=None if every_row else writing[:, None])
    return F.linear(h.reshape(-1, h.shape[-1]), model.lm_head_weight).float()  # (B or n, V)


@functools.cache
def compiled(device_type):
    """decode_step through torch.compile, made once per process and device type: on CUDA with CUDA
    graphs (one recorded per shape), on a CPU as generated C++. A shape that changes for the first
    time compiles it again (dynamic after that): a few compiles a run (TORCH_LOGS=recompiles)."""
    return torch.compile(decode_step, mode="reduce-overhead" if device_type == "cuda" else None, fullgraph=True)


def compile_missing():
    """Why torch.compile cannot build a CPU step here (it needs a C++ compiler and Python.h), or None."""
    if not (shutil.which("c++") or shutil.which("g++")):
        return "torch.compile needs a C++ compiler"
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return "torch.compile needs Python's headers (Python.h)"
    return None


@dataclass(frozen=True)
class Turns:
    """How `decode` runs each turn (the engine's settings)."""
    max_len: int  # the most tokens a row may hold: its prompt and every turn and observation
    max_turn_tokens: int  # a turn's cap
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling
    rows: int = 0  # KV-cache rows, whole groups; 0 = every trajectory
    stop_strings: tuple = ()  # a turn ends once its text holds one
    stop_ids: tuple = None  # a turn ends at one (dropped); None: the tokenizer's end-of-turn ids
    compile: bool = False  # decoding steps through torch.compile


@torch.no_grad()
def decode(model, tokenizer, prompts, group_size, turn_end, turns, uniforms=None):
    """The engine: `group_size` continuations of each prompt (trajectory i continues prompt i // G),
    decoded turn by turn (`turns`: a Turns) through one KV cache of turns.rows rows (whole groups;
    0 = every trajectory).

    Trajectory i samples its k-th token at its own uniform uniforms[i, k] (None: greedy), whichever
    rows share its batch and whenever they stop. A turn ends at a stop id (default: the tokenizer's
    end-of-turn ids; the token is dropped, never in the cache or the turn), once the turn's text
    holds a stop string, or after max_turn_tokens. Then `turn_end([(i, tokens, logprobs, reason)])`
    is called with every trajectory whose turn ended at this step and returns {i: the tokens it reads
    next (the environment's: fed to the cache, and the next turn starts), or None (finished)}.
    A question's G rows enter as soon as G rows are free (its prompt prefilled once, copied to them),
    so the cache stays full while questions wait; when none waits and half the rows are done, they
    leave. Each decoding step is decode_step over every row of the cache, reading
    the slots its longest row holds (`compile`: through torch.compile, that many rounded up to SPAN_STEP,
    so that the shapes are few). max_len: the most tokens a row may hold."""
    max_len, max_turn_tokens, temperature, top_p, rows, stop_strings, stop_ids, compile = (
        turns.max_len, turns.max_turn_tokens, turns.temperature, turns.top_p, turns.rows, turns.stop_strings,
        turns.stop_ids, turns.compile)
    G, N = group_size, len(prompts) * group_size
    stop_ids = set(tokenizer.eos_ids if stop_ids is None else stop_ids)
    size = max(G, rows // G * G) if rows else N
    if compile:  # a few cache lengths, so that the compiled step sees few strides
        max_len = round_up(max_len, CACHE_STEP)
    cache = new_cache(model, min(size, N), max_len)
    dev = cache.end.device

    def pin():  # CUDA graphs replay on fixed addresses: the cache's tensors are marked so
        for t in (cache.k, cache.v, cache.end) if compile and dev.type == "cuda" else ():
            torch._dynamo.mark_static_address(t)
    pin()
    step = compiled(dev.type) if compile else None
    # compiled, a few spans (few shapes); eager on CUDA too, since cuDNN's attention plans each new key
    # length anew (2.5 ms of host time a call, bench/gpu_check.py); eager on a CPU reads no slot it need not
    span_step = SPAN_STEP if compile or dev.type == "cuda" else 1
    held = [None] * len(cache.end)  # the trajectory in each cache row; None when free or finished
    length = [0] * len(held)  # the tokens each cache row holds (cache.end, known here without a sync)
    logits = torch.zeros(len(held), model.config.vocab_size, device=dev)  # (rows, V) next-token logits
    waiting = 0  # the first prompt not yet in the cache
    drawn = [0] * N  # tokens each trajectory has sampled
    turn_toks, turn_lps = [[] for _ in range(N)], [[] for _ in range(N)]  # its turn so far
    window = max((len(x) for x in stop_strings), default=0) + 1
    while waiting < len(prompts) or any(i is not None for i in held):
        free = [r for r, i in enumerate(held) if i is None] if waiting < len(prompts) else []
        k = min(len(free) // G, len(prompts) - waiting)  # prompts that enter now, G rows each
        if k:
            entering = prompts[waiting:waiting + k]
            sub = new_cache(model, k, max(map(len, entering)))
            new = extend(model, sub, entering)  # (k, V): each prompt prefilled once
            at = free[:k * G]
            cache.put(at, sub, [j // G for j in range(k * G)])  # copied to its G rows
            logits[at] = new.repeat_interleave(G, dim=0)  # (k*G, V)
            for j, r in enumerate(at):
                held[r], length[r] = waiting * G + j, len(entering[j // G])
            waiting += k
        going = [r for r, i in enumerate(held) if i is not None]
        if waiting == len(prompts) and len(going) <= len(held) // 2:  # finished rows leave; compiled, the
            # cache keeps exactly half its rows (finished ones fill it up), so that its shapes stay few
            order = going + [r for r, i in enumerate(held) if i is None][:(len(held) // 2 - len(going)) * compile]
            cache.keep(order)
            pin()  # the same storage, seen through new tensors
            logits, held, length = logits[order], [held[r] for r in order], [length[r] for r in order]  # (b, V)
            going = list(range(len(going)))
        ids = [held[r] for r in going]
        u = None if uniforms is None else uniforms[ids, [drawn[i] for i in ids]][:, None]  # (g, 1)
        tok, lp = draw(logits[going], temperature, top_p, u)  # (g,) each
        writing = [False] * len(held)  # per cache row: it decodes its token now (else: turn over, or finished)
        ended = {}  # cache row -> (the sampled token its cache still needs before what follows, the reason)
        for r, i, t, l in zip(going, ids, tok.tolist(), lp.tolist()):
            drawn[i] += 1
            if t in stop_ids:
                ended[r] = ([], "stop_id")
                continue
            turn_toks[i].append(t)
            turn_lps[i].append(l)
            if stop_strings and any(x in tokenizer.decode(turn_toks[i][-window:]) for x in stop_strings):
                ended[r] = ([t], "stop_string")
            elif len(turn_toks[i]) == max_turn_tokens:
                ended[r] = ([t], "length")
            else:
                writing[r] = True
                length[r] += 1
        chunks = {}  # cache rows that go on: what they read next
        if ended:
            nxt = turn_end([(held[r], turn_toks[held[r]], turn_lps[held[r]], why) for r, (_, why) in ended.items()])
            for r in ended:
                i = held[r]
                turn_toks[i], turn_lps[i] = [], []
                if nxt[i] is None:
                    held[r] = None
                else:
                    chunks[r] = nxt[i]
        if any(writing):  # a decoding step of every row, those not writing masked
            need = max(length)  # the longest row after this step (more than max_len: upto refuses it)
            span = max(need, min(round_up(need, span_step), max_len))
            toks = torch.zeros(len(held), dtype=torch.long, device=dev)
            toks[going] = tok  # (rows,)
            w = torch.tensor(writing, device=dev)  # (rows,)
            if compile:
                logits = torch.where(w[:, None], step(model, cache.upto(span), toks, w), logits)  # (rows, V)
            else:
                logits[w] = decode_step(model, cache.upto(span), toks, w, every_row=False)  # (writing, V)
        if chunks:  # rows whose turn ended read what follows, in a cache of their own
            at = sorted(chunks)
            feed = [ended[r][0] + chunks[r] for r in at]  # (the turn's last token when the cache lacks it)
            sub = cache.take(at, max(map(len, feed)))
            logits[at] = extend(model, sub, feed)  # (b, V)
            cache.put(at, sub)
            for r, f in zip(at, feed):
                length[r] += len(f)


def generate(model, tokenizer, prompts, max_new_tokens, *, temperature=0.0, top_p=1.0, generator=None,
             stop_ids=None, stop_strings=(), compile=False):
    """One turn for each of the ragged prompts (lists of token ids) -> (tokens, logprobs, reasons):
    `decode` with one row a prompt and a turn_end that finishes every row."""
    u = None if temperature == 0 else torch.rand(len(prompts), max_new_tokens, generator=generator,
                                                   device=model.model.embed_tokens.weight.device)
    out = {}

    def turn_end(ended):
        out.update({i: (toks, lps, why) for i, toks, lps, why in ended})
        return {i: None for i, *_ in ended}
    decode(model, tokenizer, prompts, 1, turn_end, Turns(max(map(len, prompts)) + max_new_tokens + 1, max_new_tokens,
                                                          temperature, top_p, 0, tuple(stop_strings), stop_ids, compile), u)
    return tuple(list(x) for x in zip(*(out[i] for i in range(len(prompts)))))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python generate.py CHECKPOINT_DIR MESSAGE")
    model, tok = load(sys.argv[1])
    out, _, _ = generate(model, tok, [tok.encode(tok.chat_prompt(sys.argv[2]))], 64)
    print(tok.decode(out[0]))
