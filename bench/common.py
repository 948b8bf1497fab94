"""What the speed and memory benches share: made trajectories (the same in every code version a bench
compares) and the peak resident set."""


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
