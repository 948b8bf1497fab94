"""What the speed and memory benches share: model shapes and their state's size, made trajectories (the
same in every code version a bench compares), the peak resident set, the machine's matmul rate, and
the phases bench_dtype and bench_limit time (prefill, decode, a GRPO pass). Modules of the repository
are imported inside the functions: bench_side_by_side runs them over another checkout's code."""

import time

import torch

SHAPES = {  # random-weight models of real and toy shape (the 0.5B's: Qwen2.5-0.5B's config.json)
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6),
    "tiny": dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6),
}


def peak():
    """This process's peak resident set in bytes since it started or since /proc/self/clear_refs was written 5."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def made_trajectories(tok, questions, group, turns, cap, seed, R):
    """`group` trajectories a question, made without sampling: the chat prompt, then `turns` turns of
    `cap` random policy tokens each followed by 256 random tokens of "observation", then a 20-token
    answer (training's cost depends on lengths only). R: the rollout module of the code measured."""
    import torch
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for q in questions:
        prompt = tok.encode(tok.chat_prompt(R.make_prompt(q)))
        for _ in range(group):
            t = R.Trajectory(q, len(prompt))
            t.add(prompt, sampled=False)
            for n, sampled in [(cap, True), (256, False)] * turns + [(20, True)]:
                ids = torch.randint(0, 150000, (n,), generator=g).tolist()
                t.add(ids, sampled=sampled, logprobs=[-2.0] * n if sampled else None)
            t.stop = "answer"
            trajs.append(t)
    return trajs


def matmul_rate(rows, d, inner, dtype, seconds=2.0):
    """FLOP/s of x (rows, d) @ W (d, inner), repeated for about `seconds` after one warm call."""
    import torch
    x, w = torch.randn(rows, d, dtype=dtype), torch.randn(d, inner, dtype=dtype)
    x @ w
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x @ w
        n += 1
    return 2 * rows * d * inner * n / (time.perf_counter() - t0)


SIZES = {  # Qwen2.5-*-Instruct config.json values
    "0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "3B": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "7B": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}


def n_params(cfg):
    """Parameters of a Qwen2 of this config (built on the meta device: no memory)."""
    from model import Qwen2
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen2(cfg).parameters())


def state_formula(P, ranks):
    """float32 parameters, gradients, two AdamW moments (+ step counters) and the float32 KL model,
    each split over the ranks."""
    return dict(params=4 * P / ranks, grads=4 * P / ranks, optimizer=8 * P / ranks, reference=4 * P / ranks)


def prompts(vocab, batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab - 1000, (batch, length), generator=g).tolist()


def warm(measure):
    """The second of two identical calls of `measure` (the first warms weights and kernels)."""
    measure()
    return measure()


@torch.no_grad()
def prefill(model, batch, length):
    """Prompt tokens/s of one prefill of `batch` prompts of `length` tokens."""
    import generate
    p = prompts(model.config.vocab_size, batch, length, 0)
    cache = generate.new_cache(model, batch, length + 1)
    t0 = time.perf_counter()
    generate.extend(model, cache, p)
    return batch * length / (time.perf_counter() - t0)


@torch.no_grad()
def decode(model, tokenizer, batch, steps, prompt=256):
    """New tokens/s of `steps` sampled tokens per row, every row generating (the prefill's time, measured
    alone on the same prompts, taken off)."""
    import generate
    p = prompts(model.config.vocab_size, batch, prompt, 1)
    cache = generate.new_cache(model, batch, prompt + 1)
    t0 = time.perf_counter()
    generate.extend(model, cache, p)
    t1 = time.perf_counter()
    generate.generate(model, tokenizer, p, steps, temperature=1.0, top_p=0.95,
                      generator=torch.Generator().manual_seed(0), stop_ids=())
    return batch * steps / (time.perf_counter() - t1 - (t1 - t0))


def grpo_pass(model, batch, length):
    """Seconds of one forward + backward of the policy's log-probs and entropy (model.token_logprobs)."""
    ids = torch.tensor(prompts(model.config.vocab_size, batch, length, 2))
    valid = torch.ones_like(ids, dtype=torch.bool)
    mask = torch.zeros_like(valid)
    mask[:, -length // 6:] = True  # the policy's tokens: a sixth of a search trajectory
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    logp, entropy = token_logprobs()(model, ids, valid, mask, 1.0, entropy=True)
    (-logp.mean() - 0.001 * entropy.mean()).backward()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# the method's calls in the checkout on sys.path[0], whichever side of #69 (settings by name before
# it; one group, rollout.RolloutConfig / grpo.GRPOConfig / ofsd.OFSDConfig, from it on)

def token_logprobs():
    """model.token_logprobs (rollout's, then grpo's, then logprobs.py's before)."""
    import importlib.util
    import grpo
    import model
    import rollout
    if hasattr(model, "token_logprobs"):
        return model.token_logprobs
    if importlib.util.find_spec("logprobs"):
        import logprobs
        return logprobs.token_logprobs
    return getattr(rollout, "token_logprobs", None) or grpo.token_logprobs


def group(cls, **settings):
    """A settings group from evolve.py's constants, `settings` first (evolve.settings before it moved)."""
    import configurator
    import evolve
    if hasattr(evolve, "settings"):
        return evolve.settings(cls, **settings)
    return configurator.group(cls, evolve.DEFAULTS, **settings)


def rollout(model, tok, index, questions, group, generator=None, **settings):
    """rollout.rollout with its settings by name."""
    import rollout as R
    if not hasattr(R, "RolloutConfig"):
        return R.rollout(model, tok, index, questions, group, generator=generator, **settings)
    return R.rollout(model, tok, index, questions, group, R.RolloutConfig(**settings), generator)


def grpo_step(model, kl_model, optimizer, trajs, adv, pad_id, **settings):
    """grpo.grpo_step with its settings by name (temperature among them)."""
    import grpo
    if not hasattr(grpo, "GRPOConfig"):
        return grpo.grpo_step(model, kl_model, optimizer, trajs, adv, pad_id=pad_id, **settings)
    return grpo.grpo_step(model, kl_model, optimizer, trajs, adv, group(grpo.GRPOConfig, **settings), pad_id)


def distill(model, tok, pairs, seed, **settings):
    """An OFSD round's distillation with its settings by name (kl_weight: ofsd_kl_weight from #69 on; the
    adapter attached and merged by the caller from #78 on, as evolve.ofsd_round does)."""
    import ofsd
    if not hasattr(ofsd, "OFSDConfig"):
        return ofsd.distill(model, tok, pairs, seed=seed, **settings)
    settings["ofsd_kl_weight"] = settings.pop("kl_weight")
    if not hasattr(ofsd, "prepare"):
        return ofsd.distill(model, tok, pairs, group(ofsd.OFSDConfig, **settings), seed)
    import checkpoint
    import lora
    cfg = group(ofsd.OFSDConfig, **settings)
    lesson = ofsd.prepare(model, tok, pairs, cfg)
    adapter = lora.attach(model, cfg.ofsd_lora_rank, cfg.ofsd_lora_alpha)
    m = ofsd.distill(model, adapter, tok, lesson, cfg, seed)
    checkpoint.merge_adapter(model, adapter)
    return m


def max_response_tokens(tok, **settings):
    """rollout.max_response_tokens with its settings by name."""
    import rollout as R
    if not hasattr(R, "RolloutConfig"):
        return R.max_response_tokens(tok, **settings)
    return R.max_response_tokens(tok, R.RolloutConfig(**settings, top_k=3))
