"""The toy backbone's targets on the test split, at the loop's settings (evolve.py's constants).

Prints, as JSON: greedy test EM per question type and overall; the share of test questions whose
group of `group_size` samples at --temperature holds both a correct and an incorrect answer (what
GRPO needs to learn from); mean searches per question, greedy and sampled, against the minimum
(one per hop); and the searches of the correct samples against their minimum (the waste OFSD's
tau_ref trims). The targets and the measured values are in docs/toyworld.md.

    python bench/bench_backbone.py [--world_dir cache/toyworld] [--temperature 1.0] [--build]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import evolve  # noqa: E402  (the loop's settings: the backbone is measured with them)
import toyagent  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world_dir", default=evolve.world_dir)
    ap.add_argument("--temperature", type=float, default=evolve.temperature, help="sampling temperature of the groups")
    ap.add_argument("--build", action="store_true", help="build the backbone from the code instead of the shipped one")
    args = ap.parse_args()
    world_dir, _ = toyagent.ensure(args.world_dir, evolve.world_seed, evolve.top_k, use_shipped=not args.build)
    print(json.dumps(toyagent.backbone_stats(
        world_dir, group_size=evolve.group_size, temperature=args.temperature, max_turns=evolve.max_turns,
        max_turn_tokens=evolve.max_turn_tokens, max_obs_tokens=evolve.max_obs_tokens, top_k=evolve.top_k, seed=0),
        indent=1))


if __name__ == "__main__":
    main()
