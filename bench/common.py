"""What the speed and memory benches share: model shapes, made trajectories (the same in every code
version a bench compares), the peak resident set and the machine's matmul rate."""

import time

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
