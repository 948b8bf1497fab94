"""rollout.py: masks, recorded log-probs, batching, turn limits and the invalid-action message."""

import pytest
import torch

import generate

from rollout import INVALID, RolloutConfig, extract_answer, make_prompt, observation, rollout
from conftest import AGENT_QUESTION, random_model, tiny_config


def run(model, tok, index, questions, G=1, generator=None, contexts=None, uniforms=None, **kw):
    """rollout with the tests' settings, `kw` over them."""
    cfg = RolloutConfig(**dict(dict(max_turns=4, max_turn_tokens=40, max_obs_tokens=400, top_k=3), **kw))
    return rollout(model, tok, index, questions, G, cfg, generator, contexts, uniforms)


def segments(t):
    """[(sampled, start, end)] runs of equal loss_mask over the response."""
    out, s = [], t.prompt_len
    for i in range(t.prompt_len + 1, len(t.tokens) + 1):
        if i == len(t.tokens) or t.loss_mask[i] != t.loss_mask[s]:
            out.append((t.loss_mask[s], s, i))
            s = i
    return out


def test_prompt_is_search_r1s():
    """The user message is Search-R1's instruction; '?' is appended when missing."""
    p = make_prompt("  who founded Paris ")
    assert p.startswith("Answer the given question. You must conduct reasoning inside <think>")
    assert p.endswith("<answer> Beijing </answer>. Question: who founded Paris?\n")
    assert make_prompt("why?").endswith("Question: why?\n")


def test_trained_agent_searches_then_answers(agent, tokenizer, search_index):
    """Greedy rollout of the tiny agent: one search, the observation block, then an answer."""
    (t,) = run(agent, tokenizer, search_index, [AGENT_QUESTION])
    assert t.queries == ["river Paris"] and t.answer == "Paris" and t.stop == "answer"
    assert "[env>>\n\n<information>Doc 1(Title: " in t.render(tokenizer)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masks_split_model_text_from_environment(agent, tokenizer, search_index, seed):
    """Masked-in tokens decode to the model's own text; masked-out ones to prompt + observations."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION], G=4, temperature=1.0,
                generator=torch.Generator().manual_seed(seed))
    for t in trajs:
        assert t.loss_mask[:t.prompt_len] == [0] * t.prompt_len
        mine = [x for x, m in zip(t.tokens, t.loss_mask) if m]
        assert tokenizer.decode(mine) == t.model_text
        queries = iter(t.queries)
        for sampled, s, e in segments(t):
            if not sampled:
                text = tokenizer.decode(t.tokens[s:e])
                if text != INVALID:
                    hits = search_index.search([next(queries)], 3)[0]
                    assert text == observation([search_index.doc(i) for i, _ in hits])
        assert tokenizer.decode(t.tokens[:t.prompt_len]) == tokenizer.chat_prompt(make_prompt(AGENT_QUESTION))


def test_logprobs_equal_full_forward(agent, tokenizer, search_index):
    """Log-probs recorded while sampling equal a fresh forward over the whole trajectory (1e-4)."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "who founded Tokyo"], G=3, temperature=1.0,
                generator=torch.Generator().manual_seed(0))
    for t in trajs:
        with torch.no_grad():
            logp = torch.log_softmax(agent(torch.tensor([t.tokens]))[0].float(), -1)  # (T, V)
        ids = torch.tensor(t.tokens)
        want = logp[:-1].gather(-1, ids[1:, None])[:, 0]
        m = torch.tensor(t.loss_mask[1:]).bool()
        assert (torch.tensor(t.logprobs[1:])[m] - want[m]).abs().max() <= 1e-4


def test_batch_equals_rows_alone(agent, tokenizer, search_index):
    """A ragged batch gives each row exactly what it gives alone (greedy)."""
    qs = [AGENT_QUESTION, "Turing", "Paris 1815 river and the lake mountain"]
    together = run(agent, tokenizer, search_index, qs, G=2)
    for i, q in enumerate(qs):
        (alone,) = run(agent, tokenizer, search_index, [q])
        for t in together[2 * i:2 * i + 2]:
            assert t.tokens == alone.tokens and t.loss_mask == alone.loss_mask
            assert t.queries == alone.queries and t.answer == alone.answer


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollout_rows_decodes_in_batches_with_the_same_result(agent, tokenizer, search_index, temperature):
    """rollout_rows=4 with G=2 holds two questions at a time (the third enters when two rows are free)
    and returns the same trajectories, in order: sampled too, as what a trajectory draws does not
    depend on which rows share its batch."""
    qs = [AGENT_QUESTION, "Turing", "Paris 1815 river and the lake mountain"]
    whole, parts = (run(agent, tokenizer, search_index, qs, G=2, temperature=temperature, rollout_rows=rows,
                        generator=torch.Generator().manual_seed(4)) for rows in (0, 4))
    assert [(t.question, t.tokens, t.loss_mask) for t in parts] == [(t.question, t.tokens, t.loss_mask) for t in whole]
    if temperature:
        assert len({tuple(t.tokens) for t in whole}) > 3  # the samples differ from each other


def test_a_question_enters_as_soon_as_its_rows_are_free(agent, tokenizer, search_index, monkeypatch):
    """With room for two of three questions, the third starts once G rows are free, beside the rows
    still writing: the batch samples fewer times than two batches one after the other would."""
    qs = [AGENT_QUESTION, "Turing", "Paris 1815 river and the lake mountain"]
    draws = []
    monkeypatch.setattr(generate, "draw", lambda *a, f=generate.draw: draws.append(len(a[0])) or f(*a))
    u = torch.rand(len(qs) * 2, 5 * 40, generator=torch.Generator().manual_seed(4))  # what rollout draws
    count = []
    for questions, rows, rows_u in ((qs, 4, u), (qs[:2], 0, u[:4]), (qs[2:], 0, u[4:])):
        draws.clear()
        run(agent, tokenizer, search_index, questions, 2, uniforms=rows_u, rollout_rows=rows, temperature=1.0)
        count.append(len(draws))
        if rows:
            assert max(draws) == rows  # never more rows than rollout_rows
    assert count[0] < count[1] + count[2]


def test_rows_go_on_to_their_next_turn_alone(agent, tokenizer, search_index, monkeypatch):
    """A row whose turn ends reads its observation and writes on while others still write theirs (the
    batch samples as many times as its longest row, not the sum of each turn's longest), and each
    trajectory equals the one it samples alone with the same uniforms."""
    qs = [AGENT_QUESTION, "Turing", "who founded Tokyo"]
    g = torch.Generator().manual_seed(1)
    draws = []
    monkeypatch.setattr(generate, "draw", lambda *a, f=generate.draw: draws.append(1) or f(*a))
    together = run(agent, tokenizer, search_index, qs, G=3, temperature=1.0, generator=g)
    assert len(draws) <= max(sum(t.loss_mask) + t.n_turns for t in together)  # (+1 a turn: a dropped end token)
    lengths = {len(t.tokens) - t.prompt_len for t in together}
    assert len(lengths) > 3 and sum(t.n_turns > 1 for t in together) > 3  # rows really were out of step
    u = torch.rand(len(qs) * 3, 5 * 40, generator=torch.Generator().manual_seed(1))  # what rollout drew
    for i, t in enumerate(together):
        (alone,) = rollout_rows_alone(agent, tokenizer, search_index, qs[i // 3], u[i])
        assert alone.tokens == t.tokens and alone.loss_mask == t.loss_mask
        assert max(abs(a - b) for a, b in zip(alone.logprobs, t.logprobs)) <= 1e-4


def rollout_rows_alone(agent, tokenizer, search_index, question, u):
    """One trajectory of `question`, decoded alone with the uniforms u."""
    return run(agent, tokenizer, search_index, [question], 1, uniforms=u[None], temperature=1.0)


def test_turn_and_token_caps_hold(agent, tokenizer, search_index):
    """At most max_turns searches + one final turn; turns and observations respect their caps."""
    trajs = run(agent, tokenizer, search_index, [AGENT_QUESTION, "Ada"], G=5, temperature=1.5,
                max_turns=2, max_turn_tokens=12, max_obs_tokens=20,
                generator=torch.Generator().manual_seed(0))
    for t in trajs:
        assert t.n_search <= 2 and t.n_turns <= 3
        for sampled, s, e in segments(t):
            assert e - s <= (12 if sampled else max(20, len(tokenizer.encode(INVALID))))


def test_invalid_actions_get_the_message(tokenizer, search_index):
    """Turns with no tag get the fixed invalid-action message; the last turn ends the trajectory."""
    noise = random_model(tiny_config(), seed=5)
    trajs = run(noise, tokenizer, search_index, ["Ada"], G=2, max_turns=3, max_turn_tokens=4,
                temperature=1.0, generator=torch.Generator().manual_seed(0))
    for t in trajs:
        env = [tokenizer.decode(t.tokens[s:e]) for m, s, e in segments(t) if not m]
        assert env == [INVALID] * 3 and t.n_turns == 4
        assert t.stop == "final_turn_without_answer" and t.answer is None


def test_answer_is_taken_from_model_text_only():
    """The answer is the last <answer> the model wrote, never the prompt's example."""
    assert extract_answer("<answer> a </answer> then <answer> b </answer>") == "b"
    assert extract_answer("no tags") is None
    assert "<answer> Beijing </answer>" in make_prompt("q")


def test_a_stop_id_uses_up_its_uniform(tokenizer):
    """Trajectory i's k-th draw is at uniforms[i, k], a dropped stop id's draw included: replayed by full
    forwards, each sampled token (and each stop) is the draw at the next uniform in order."""
    model = random_model(tiny_config(), seed=3)
    prompt = tokenizer.encode(tokenizer.chat_prompt("which river"))
    stops = set(range(0, model.config.vocab_size, 3))  # a third of the vocabulary ends a turn
    u = torch.rand(1, 64, generator=torch.Generator().manual_seed(0))
    turns, feed = [], [7, 8]

    def turn_end(ended):
        (i, toks, _, why), = ended
        turns.append((list(toks), why))
        return {i: None if len(turns) == 5 else feed}
    generate.decode(model, tokenizer, [prompt], 1, turn_end,
                    generate.Turns(max_len=200, max_turn_tokens=6, temperature=1.0, stop_ids=stops), u)
    assert sum(why == "stop_id" for _, why in turns) >= 2
    ctx, k = list(prompt), 0
    with torch.no_grad():
        for toks, why in turns:
            for t in toks + ([None] if why == "stop_id" else []):
                tok, _ = generate.draw(model(torch.tensor([ctx]))[0, -1:].float(), 1.0, 1.0, u[:, k:k + 1])
                assert (tok.item() in stops) if t is None else tok.item() == t
                ctx, k = ctx + ([] if t is None else [t]), k + 1
            ctx += feed


def test_a_full_kv_cache_is_refused(tokenizer):
    """A row that would outgrow the cache is refused ("KV cache full"), never written past its end."""
    model = random_model(tiny_config())
    cache = generate.new_cache(model, 1, 8)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.upto(9)
    prompt = tokenizer.encode(tokenizer.chat_prompt("which river"))
    with pytest.raises(ValueError, match="KV cache full"):
        generate.decode(model, tokenizer, [prompt], 1, lambda ended: {i: None for i, *_ in ended},
                        generate.Turns(max_len=len(prompt) + 2, max_turn_tokens=8, stop_ids=()))
