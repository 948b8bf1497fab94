"""The toy backbone's targets on the test split, at the loop's settings (evolve.py's constants).

Prints, as JSON: greedy test EM per question type and overall; the share of test questions whose
group of `group_size` samples at --temperature holds both a correct and an incorrect answer (what
GRPO needs to learn from); mean searches per question, greedy and sampled, against the minimum
(one per hop); and the searches of the correct samples against their minimum (the waste OFSD's
tau_ref trims). The targets and the measured values are in docs/toyworld.md.

    python experiments/backbone.py [--world_dir cache/toyworld] [--temperature 1.0] [--build]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from evolve import DEFAULTS  # noqa: E402  (the loop's settings as written: the backbone is measured with them)
import retriever  # noqa: E402
from worlds import toyagent  # noqa: E402
from eval import evaluate, summarize  # noqa: E402  (the project's greedy evaluation)
from model import load  # noqa: E402
from rollout import RolloutConfig, exact_match, rollout  # noqa: E402
from worlds.toyworld import TYPES, read_jsonl  # noqa: E402


def backbone_stats(world_dir, *, group_size, temperature, max_turns, max_turn_tokens, max_obs_tokens, top_k, seed):
    """The warm start's targets on the test split: greedy EM per type; the share of questions whose
    group of `group_size` samples (at `temperature`) holds both a correct and an incorrect answer;
    mean searches per question, greedy and sampled, against the minimum (one per hop); and the
    searches of the correct samples against their minimum (the waste OFSD's tau_ref trajectories remove)."""
    model, tok = load(os.path.join(world_dir, "backbone"))
    index = retriever.load_index(os.path.join(world_dir, "index"))
    test = read_jsonl(os.path.join(world_dir, "test.jsonl"))
    cfg = RolloutConfig(max_turns=max_turns, max_turn_tokens=max_turn_tokens, max_obs_tokens=max_obs_tokens, top_k=top_k,
                        temperature=temperature)
    greedy = summarize(evaluate(model, tok, index, test, cfg, len(test)), "type")
    trajs = rollout(model, tok, index, [q["question"] for q in test], group_size, cfg, torch.Generator().manual_seed(seed))
    mixed, none_right, right = 0, 0, []  # right: (searches, hops) of each correct sample
    for i, q in enumerate(test):
        group = trajs[i * group_size:(i + 1) * group_size]
        r = [exact_match(t.answer, q["golden_answers"]) for t in group]
        mixed += len(set(r)) == 2
        none_right += not any(r)
        right += [(t.n_search, len(q["hops"])) for t, ok in zip(group, r) if ok]
    out = {f"em_{k}": greedy[k]["em"] for k in TYPES}
    out.update(em=greedy["all"]["em"], mixed_groups=mixed / len(test), all_wrong_groups=none_right / len(test),
               searches=greedy["all"]["searches"],
               sampled_searches=sum(t.n_search for t in trajs) / len(trajs),
               min_searches=sum(len(q["hops"]) for q in test) / len(test),
               correct_searches=sum(n for n, _ in right) / max(len(right), 1),  # right but wasteful:
               correct_min_searches=sum(h for _, h in right) / max(len(right), 1))  # ... what OFSD trims
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world_dir", default=DEFAULTS["world_dir"])
    ap.add_argument("--temperature", type=float, default=DEFAULTS["temperature"],
                    help="sampling temperature of the groups")
    ap.add_argument("--build", action="store_true", help="build the backbone from the code instead of the shipped one")
    args = ap.parse_args()
    world_dir, _ = toyagent.ensure(args.world_dir, DEFAULTS["world_seed"], DEFAULTS["top_k"],
                                   use_shipped=not args.build)
    print(json.dumps(backbone_stats(
        world_dir, group_size=DEFAULTS["group_size"], temperature=args.temperature, seed=0,
        **{k: DEFAULTS[k] for k in ("max_turns", "max_turn_tokens", "max_obs_tokens", "top_k")}),
        indent=1))


if __name__ == "__main__":
    main()
