"""OFSD's headroom, per checkpoint: greedy EM from the teacher view against the student view on
the questions an OFSD round would mine (what #24's backbone target measures).

For each checkpoint (the toy backbone, or a run's `checkpoint/model`): `group_size` samples per
train question at evolve.py's settings, one pair mined per question with a correct sample (the
paper's rule: tau_ref = the correct sample with the fewest searches), then one greedy rollout per
mined question from each view (ofsd.greedy_em, the diagnostic every OFSD round prints). Prints a
table: mined questions, student EM, teacher EM and the gap, overall and per question type.

    python bench/bench_teacher.py [--world_dir cache/toyworld] [--questions 96] [CHECKPOINT_DIR ...]
"""

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from evolve import DEFAULTS  # noqa: E402  (the loop's settings as written, whatever main() did since)
import retriever  # noqa: E402
import toyagent  # noqa: E402
from model import load  # noqa: E402
from ofsd import greedy_em, mine  # noqa: E402
from rollout import rollout  # noqa: E402
from toyworld import TYPES, read_jsonl  # noqa: E402


def headroom(folder, index, questions, rollout_args, group_size, seed):
    """{type or "all": (mined, student EM, teacher EM)} for one checkpoint."""
    model, tok = load(folder)
    with torch.no_grad():
        trajs = rollout(model, tok, index, [q["question"] for q in questions], group_size,
                        generator=torch.Generator().manual_seed(seed), **rollout_args)
    mined = mine(trajs, questions, group_size)
    kind_of = {q["question"]: q["type"] for q in questions}
    student = greedy_em(model, tok, index, mined, rollout_args)
    teacher = greedy_em(model, tok, index, mined, rollout_args, teacher_view=True)
    out = {}
    for kind in ("all",) + TYPES:
        rows = [(s, t) for (_, stu, _, _), s, t in zip(mined, student, teacher)
                if kind == "all" or kind_of[stu.question] == kind]
        if rows:
            out[kind] = (len(rows), sum(s for s, _ in rows) / len(rows), sum(t for _, t in rows) / len(rows))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoints", nargs="*", help="model folders (default: the world's backbone)")
    ap.add_argument("--world_dir", default=DEFAULTS["world_dir"])
    ap.add_argument("--questions", type=int, default=96, help="train questions rolled out (evolve: ofsd_questions)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    world_dir, backbone = toyagent.ensure(args.world_dir, DEFAULTS["world_seed"], DEFAULTS["top_k"])
    index = retriever.load_index(os.path.join(world_dir, "index"))
    train = read_jsonl(os.path.join(world_dir, "train.jsonl"))
    questions = random.Random(args.seed).sample(train, args.questions)
    rollout_args = {k: DEFAULTS[k] for k in ("max_turns", "max_turn_tokens", "max_obs_tokens", "top_k", "temperature",
                                             "top_p")}
    print("| checkpoint | type | mined | student EM | teacher EM | teacher - student |\n|---|---|---|---|---|---|")
    for folder in args.checkpoints or [backbone]:
        found = headroom(folder, index, questions, rollout_args, DEFAULTS["group_size"], args.seed)
        for kind, (n, s, t) in found.items():
            print(f"| {folder} | {kind} | {n} | {s:.3f} | {t:.3f} | {t - s:+.3f} |")


if __name__ == "__main__":
    main()
