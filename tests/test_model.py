"""model.py against transformers' Qwen2ForCausalLM (the independent reference)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from generate import Turns, compile_missing, decode, draw, extend, generate, new_cache

from model import load, save
from conftest import random_model, tiny_config

transformers = pytest.importorskip("transformers")


def hf_model(path):
    return transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def padded_batch(lengths, vocab, seed=0):
    """Left-padded ids, attention mask and positions, as transformers expects them."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, T - n:] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, pos


@pytest.mark.parametrize("tied,heads,kv", [(False, 4, 4), (True, 4, 2), (False, 7, 1), (True, 14, 2)])
def test_logits_match_transformers(tmp_path, tokenizer, tied, heads, kv):
    """Logits equal Qwen2ForCausalLM (tied/untied, kv ratios 1, 2, 7) on a padded batch, <= 1e-4."""
    cfg = tiny_config(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=16 * heads,
                      tie_word_embeddings=tied)
    ours = random_model(cfg, seed=heads + kv)
    save(ours, tokenizer, str(tmp_path / "m"))
    ref = hf_model(str(tmp_path / "m"))
    ids, mask, pos = padded_batch([9, 5, 1], cfg.vocab_size)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, valid=mask.bool())
    keep = mask.bool()
    assert (got[keep] - want[keep]).abs().max() <= 1e-4


def test_selected_hidden_states_equal_full_ones(tmp_path, tokenizer):
    """hidden(select=) returns transformers' last hidden states at the selected positions, <= 1e-4."""
    cfg = tiny_config(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    ours = random_model(cfg, seed=3)
    save(ours, tokenizer, str(tmp_path / "m"))
    ref = hf_model(str(tmp_path / "m"))
    ids, mask, pos = padded_batch([9, 5, 7], cfg.vocab_size)
    select = mask.bool() & (torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) < 0.4)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True).hidden_states[-1]
        got = ours.hidden(ids, valid=mask.bool(), select=select)
    assert got.shape == (int(select.sum()), 64)
    assert (got - want[select]).abs().max() <= 1e-4


def test_load_checkpoint_written_by_transformers(tmp_path, tokenizer):
    """A checkpoint saved by transformers loads strictly and gives its logits."""
    hcfg = transformers.Qwen2Config(vocab_size=400, hidden_size=64, intermediate_size=96,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    rope_theta=5000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.Qwen2ForCausalLM(hcfg).eval()
    ref.save_pretrained(str(tmp_path))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ours, _ = load(str(tmp_path))
    assert ours.config.rope_theta == 5000.0
    ids = torch.randint(0, 400, (2, 11))
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max() <= 1e-4


def test_kv_cache_matches_full_forward(tiny_checkpoint):
    """Prefill + one-token steps through the KV cache give the full forward's logits."""
    model, _ = load(tiny_checkpoint)
    ids = torch.randint(3, 400, (3, 20))
    with torch.no_grad():
        full = model(ids)
        cache = new_cache(model, 3, 32)
        steps = [model(ids[:, :7], cache)] + [model(ids[:, t:t + 1], cache) for t in range(7, 20)]
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-5


def test_a_cache_reads_no_slot_before_clearing_it(tiny_checkpoint):
    """A fresh cache is allocated empty (here: NaN everywhere) and zeroed as forwards reach its slots:
    ragged rows, whose padding slots are read masked, still equal each row run alone."""
    model, _ = load(tiny_checkpoint)
    rows, more = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], [[20, 21], [], [22, 23, 24, 25]]
    cache = new_cache(model, 3, 64)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    logits = extend(model, cache, more, extend(model, cache, rows))  # (3, V)
    for i in range(3):
        with torch.no_grad():
            alone = model(torch.tensor([rows[i] + more[i]]))[0, -1]
        assert (logits[i] - alone).abs().max() <= 1e-5
    assert cache.cleared[0] == 8 and cache.k[:, :, :, 8:].isnan().all()  # (L, B, H, S, D): the rest untouched


def test_ragged_extend_matches_single_rows(tiny_checkpoint):
    """Right-padded ragged chunks appended to a cache equal each row run alone."""
    model, _ = load(tiny_checkpoint)
    rows = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    more = [[20, 21], [], [22, 23, 24, 25]]
    cache = new_cache(model, 3, 20)
    logits = extend(model, cache, rows)
    logits = extend(model, cache, more, logits)
    for i in range(3):
        with torch.no_grad():
            alone = model(torch.tensor([rows[i] + more[i]]))[0, -1]
        assert (logits[i] - alone).abs().max() <= 1e-5


def test_greedy_generation_matches_transformers(tiny_checkpoint, tokenizer):
    """32 greedy tokens on a ragged batch equal transformers' generate, token for token."""
    model, _ = load(tiny_checkpoint)
    ref = hf_model(tiny_checkpoint)
    prompts = [tokenizer.encode(tokenizer.chat_prompt(q)) for q in
               ["who founded Paris?", "which river", "Ada Lovelace was born in which year and where?"]]
    ours, lps, reasons = generate(model, tokenizer, prompts, 32, stop_ids=[])
    ids, mask, _ = padded_batch([len(p) for p in prompts], 400)
    for i, p in enumerate(prompts):
        ids[i, ids.shape[1] - len(p):] = torch.tensor(p)
    out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32,
                       do_sample=False, pad_token_id=0, eos_token_id=None)
    assert ours == out[:, ids.shape[1]:].tolist()
    assert reasons == ["length"] * 3 and all(len(lp) == 32 for lp in lps)


def test_sampled_logprobs_equal_full_forward(tiny_checkpoint, tokenizer):
    """The log-probability recorded for each sampled token equals a fresh forward's."""
    model, _ = load(tiny_checkpoint)
    prompt = tokenizer.encode(tokenizer.chat_prompt("who was born in 1815?"))
    g = torch.Generator().manual_seed(3)
    toks, lps, _ = generate(model, tokenizer, [prompt], 20, temperature=1.0, generator=g, stop_ids=[])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + toks[0]]))[0].float(), -1)
    want = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(toks[0])[:, None])[:, 0]
    assert (torch.tensor(lps[0]) - want).abs().max() <= 1e-4


def test_sampling_is_seeded(tiny_checkpoint, tokenizer):
    """The same generator seed gives the same samples; top-p < 1 still samples valid tokens."""
    model, _ = load(tiny_checkpoint)
    p = [tokenizer.encode("the answer")]
    runs = [generate(model, tokenizer, p * 2, 16, temperature=1.0, top_p=0.9,
                       generator=torch.Generator().manual_seed(7), stop_ids=[])[0] for _ in range(2)]
    assert runs[0] == runs[1]


def test_stop_strings_and_ids(tiny_checkpoint, tokenizer):
    """A row stops once its text contains a stop string; other rows go on."""
    model, _ = load(tiny_checkpoint)
    p = [tokenizer.encode("the answer")] * 4
    free, _, _ = generate(model, tokenizer, p, 24, temperature=1.0,
                            generator=torch.Generator().manual_seed(1), stop_ids=[])
    text = tokenizer.decode(free[0])
    stop = text[len(text) // 2: len(text) // 2 + 2]  # a string this row is known to produce
    toks, _, reasons = generate(model, tokenizer, p, 24, temperature=1.0,
                                  generator=torch.Generator().manual_seed(1), stop_ids=[],
                                  stop_strings=[stop])
    assert reasons[0] == "stop_string" and stop in tokenizer.decode(toks[0])
    assert stop not in tokenizer.decode(toks[0][:-1])
    toks, _, reasons = generate(model, tokenizer, p, 24, temperature=1.0,
                                  generator=torch.Generator().manual_seed(1), stop_ids=[free[1][3]])
    assert reasons[1] == "stop_id" and len(toks[1]) <= 4


def test_engine_rows_equal_each_row_alone(tiny_checkpoint, tokenizer):
    """decode over 4 cache rows for 8 trajectories (4 prompts x 2) of two turns each, an environment chunk
    between them, gives each trajectory the tokens and log-probs it samples alone with its own uniforms:
    no row reads another row's cache, uniforms or turn."""
    model, _ = load(tiny_checkpoint)
    prompts = [tokenizer.encode(tokenizer.chat_prompt(q)) for q in
               ["who founded Paris?", "which river", "Ada Lovelace was born where?", "a lake"]]
    u = torch.rand(8, 40, generator=torch.Generator().manual_seed(2))

    def run(ps, G, uniforms, rows):
        turns = {}

        def turn_end(ended):
            nxt = {}
            for i, toks, lps, why in ended:
                turns.setdefault(i, []).append((toks, [round(x, 4) for x in lps], why))
                nxt[i] = [7, 8, 9] if len(turns[i]) == 1 else None  # a chunk after the first turn, then stop
            return nxt
        decode(model, tokenizer, ps, G, turn_end, Turns(max_len=max(map(len, ps)) + 2 * 21 + 3, max_turn_tokens=20,
                                                        temperature=1.0, top_p=0.9, rows=rows,
                                                        stop_ids=range(0, 400, 9)), uniforms)
        return turns
    together = run(prompts, 2, u, 4)
    assert len({len(t[0][0]) for t in together.values()}) > 2  # turns of different lengths: rows out of step
    assert {why for t in together.values() for _, _, why in t} == {"stop_id", "length"}
    for i in range(8):
        assert run([prompts[i // 2]], 1, u[i:i + 1], 0)[0] == together[i], i
    assert together[1] != together[0]  # two samples of one prompt differ: each drew from its own uniforms


def test_save_roundtrip_and_sharded_load(tmp_path, tiny_checkpoint):
    """save -> load is exact; the same tensors split over two shards with an index load too."""
    model, tok = load(tiny_checkpoint)
    state = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    names = sorted(state)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    weight_map = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fname = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, str(shard_dir / fname))
        weight_map.update({n: fname for n in part})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (shard_dir / f).write_text(open(os.path.join(tiny_checkpoint, f)).read())
    sharded, _ = load(str(shard_dir))
    ids = torch.randint(0, 400, (1, 9))
    with torch.no_grad():
        assert torch.equal(sharded(ids), model(ids))


def test_bf16_stays_bf16(tiny_checkpoint):
    """Loading with dtype=bfloat16 gives bfloat16 parameters."""
    model, _ = load(tiny_checkpoint, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.8), (0.7, 0.95), (1.3, 1.0)])
def test_sampler_draws_the_renormalised_nucleus(temperature, top_p):
    """draw(): tokens follow softmax(logits / T) restricted to the smallest set of mass >= top_p,
    renormalised; nothing outside it is drawn (200,000 draws, each frequency within 5 sigma)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.0, -1.0, -3.0])
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[(p[order].cumsum(0) - p[order]) < top_p]] = True  # the nucleus (top_p = 1: every token)
    want = torch.where(keep, p, 0.0) / p[keep].sum()
    n = 200_000
    tok, logp = draw(logits.repeat(n, 1), temperature, top_p, torch.rand(n, 1, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(tok, minlength=len(logits)).double() / n
    assert (freq[~keep] == 0).all()
    assert ((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-12).all(), (freq, want)
    assert torch.allclose(logp.double(), torch.log(p)[tok], atol=1e-5)  # recorded: log p under the full softmax


@pytest.mark.parametrize("candidates", [2, 4, 7])
def test_sampler_nucleus_beyond_its_candidates(monkeypatch, candidates):
    """draw(): the nucleus is the same whether it lies among the top-k candidates or past them
    (those rows sorted whole), in one batch that mixes both kinds of row (5 sigma)."""
    monkeypatch.setattr("generate.NUCLEUS_CANDIDATES", candidates)
    rows = torch.tensor([[4.0, 3.0, 0.5, 0.2, 0.0, -1.0, -3.0],   # peaked: a nucleus of 2 tokens
                         [0.3, 0.2, 0.2, 0.1, 0.0, -0.1, -0.2]])  # flat: a nucleus of 6 tokens
    top_p, n = 0.9, 100_000
    tok, _ = draw(rows.repeat(n, 1), 1.0, top_p, torch.rand(2 * n, 1, generator=torch.Generator().manual_seed(0)))
    for r, logits in enumerate(rows):
        p = torch.softmax(logits.double(), -1)
        order = p.argsort(descending=True)
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order[(p[order].cumsum(0) - p[order]) < top_p]] = True
        want = torch.where(keep, p, 0.0) / p[keep].sum()
        freq = torch.bincount(tok[r::2], minlength=len(logits)).double() / n
        assert (freq[~keep] == 0).all(), (candidates, r, freq)
        assert ((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-12).all(), (freq, want)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (1.0, 0.5)])
def test_draw_of_some_rows_is_their_draw_in_the_whole_batch(temperature, top_p):
    """draw(): rows drawn alone with their own uniforms give the tokens and log-probs they draw in the whole batch."""
    logits = torch.randn(9, 50, generator=torch.Generator().manual_seed(1)) * 3
    u = torch.rand(9, 1, generator=torch.Generator().manual_seed(5))
    rows = torch.tensor([7, 2, 3])
    tok, logp = draw(logits, temperature, top_p, u)
    part, part_logp = draw(logits[rows], temperature, top_p, u[rows])
    assert torch.equal(part, tok[rows]) and torch.equal(part_logp, logp[rows])


@pytest.mark.skipif(compile_missing() is not None, reason=str(compile_missing()))
def test_compiled_decoding_step_gives_the_eager_tokens(tiny_checkpoint, tokenizer):
    """decode with compile=True (torch.compile of decode_step, rows of several lengths, a chunk read
    between turns, rows leaving) samples the tokens eager decoding samples, log-probs within 1e-4."""
    model, _ = load(tiny_checkpoint)
    prompts = [tokenizer.encode(tokenizer.chat_prompt(q)) for q in ["who founded Paris?", "a lake", "which river"]]
    u = torch.rand(6, 60, generator=torch.Generator().manual_seed(3))

    def run(compile):
        turns = {}

        def turn_end(ended):
            for i, toks, lps, why in ended:
                turns.setdefault(i, []).append((toks, lps, why))
            return {i: [7, 8, 9] if len(turns[i]) == 1 else None for i, *_ in ended}
        decode(model, tokenizer, prompts, 2, turn_end, Turns(max_len=max(map(len, prompts)) + 2 * 31 + 3,
                                                             max_turn_tokens=30, temperature=1.0,
                                                             stop_ids=range(0, 400, 11), compile=compile), u)
        return turns
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = run(False), run(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it ran compiled, not eager again
    assert not torch._dynamo.utils.counters["graph_break"]  # the whole step, one graph per shape set
    assert len({len(t[0][0]) for t in eager.values()}) > 2  # rows out of step
    for i in range(6):
        assert [(t, why) for t, _, why in compiled[i]] == [(t, why) for t, _, why in eager[i]], i
        for (_, a, _), (_, b, _) in zip(compiled[i], eager[i]):
            assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) <= 1e-4
