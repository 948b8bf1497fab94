"""OFSD's headroom, per checkpoint: greedy EM from the teacher view against the student view on
the questions an OFSD round would mine (what #24's backbone target and #34's premise measure).

For each checkpoint (the toy backbone, or a run's `checkpoint/model`, or a real Qwen2.5 folder):
`group_size` samples per question at the loop's sampling settings, one pair mined per question with
a correct sample (the paper's rule: tau_ref = the correct sample with the fewest searches), then one
greedy rollout per mined question from each view (teacher_gap.greedy_scores, the diagnostic every OFSD round
prints; both views are ofsd.py's prompts). Prints a table: mined questions, student EM, teacher EM
and the gap, overall, per question type, and split by the mined student sample's outcome (an
incorrect sibling, or only correct ones: ofsd_students="any").

The protocol defaults to evolve.py's (the toy's: 4 turns of 80 tokens, top_p 1); a real checkpoint
needs longer turns (it thinks in prose before it searches) and the anchor's top_p, e.g.
--max_turn_tokens=200 --top_p=0.95, and --rollout_rows to bound its KV cache (160 rows of a 0.5B at
that protocol: 4.4 GB in bfloat16). Another world: --index_dir and --questions_file (wikiworld's
test.jsonl, and its followups.jsonl for more pairs).
The dtype is fsdp.device_and_dtype's "auto" (bfloat16 for a real checkpoint on a CPU that has it).

    python experiments/teacher.py [--world_dir cache/toyworld] [--questions 96] [CHECKPOINT_DIR ...]
    python experiments/teacher.py --questions 160 --max_turn_tokens=200 --top_p=0.95 --rollout_rows=160 \\
        ~/.cache/qwen2.5-coder-0.5b-instruct
"""

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PROTOCOL  # noqa: E402
from eval import read_questions  # noqa: E402
from evolve import DEFAULTS  # noqa: E402  (the loop's settings as written, whatever main() did since)
import fsdp  # noqa: E402
import retriever  # noqa: E402
from worlds import toyagent  # noqa: E402
from model import Qwen2Config, load  # noqa: E402
from ofsd import mine  # noqa: E402
from teacher_gap import greedy_scores  # noqa: E402
from rollout import RolloutConfig, rollout  # noqa: E402



def headroom(folder, index, questions, rollout_args, group_size, seed, dtype):
    """[(split, mined, student EM, teacher EM)] for one checkpoint, and the seconds it took."""
    t0 = time.time()
    width = Qwen2Config.from_json(os.path.join(folder, "config.json")).hidden_size
    model, tok = load(folder, *fsdp.device_and_dtype("auto", dtype, width))
    trajs = rollout(model, tok, index, [q["question"] for q in questions], group_size, rollout_args,
                    torch.Generator().manual_seed(seed))
    mined = mine(trajs, questions, group_size)
    kind_of = {q["question"]: q.get("type", "-") for q in questions}
    student, _ = greedy_scores(model, tok, index, mined, rollout_args)
    teacher, _ = greedy_scores(model, tok, index, mined, rollout_args, "full")  # the paper's teacher view
    splits = [("all", lambda p: True)]
    splits += [(f"type {k}", lambda p, k=k: kind_of[p.stu.question] == k) for k in sorted(set(kind_of.values()))]
    splits += [("student incorrect", lambda p: p.incorrect), ("student correct", lambda p: not p.incorrect)]
    out = []
    for name, keep in splits:
        rows = [(s, t) for p, s, t in zip(mined, student, teacher) if keep(p)]
        if rows:
            out.append((name, len(rows), sum(s for s, _ in rows) / len(rows), sum(t for _, t in rows) / len(rows)))
    return out, time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoints", nargs="*", help="model folders (default: the world's backbone)")
    ap.add_argument("--world_dir", default=DEFAULTS["world_dir"])
    ap.add_argument("--index_dir", default="", help="another world's BM25 index (default: the toy world's)")
    ap.add_argument("--questions_file", default="", help="that world's questions, comma-separated files (default: the toy train.jsonl)")
    ap.add_argument("--questions", type=int, default=96, help="questions rolled out (evolve: ofsd_questions)")
    ap.add_argument("--group_size", type=int, default=DEFAULTS["group_size"])
    for k in PROTOCOL:
        ap.add_argument(f"--{k}", type=type(DEFAULTS[k]), default=DEFAULTS[k])
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.index_dir and args.questions_file:
        index_dir, questions_file, backbone = args.index_dir, args.questions_file, None
    else:
        world_dir, backbone = toyagent.ensure(args.world_dir, DEFAULTS["world_seed"], DEFAULTS["top_k"])
        index_dir, questions_file = os.path.join(world_dir, "index"), os.path.join(world_dir, "train.jsonl")
    index = retriever.load_index(index_dir)
    pool = [q for path in questions_file.split(",") for q in read_questions(path)]
    questions = random.Random(args.seed).sample(pool, min(args.questions, len(pool)))
    rollout_args = RolloutConfig(**{k: getattr(args, k) for k in PROTOCOL})
    print(f"{len(questions)} questions of {questions_file} x {args.group_size} samples; {rollout_args}")
    print("| checkpoint | split | mined | student EM | teacher EM | teacher - student |\n|---|---|---|---|---|---|")
    for folder in args.checkpoints or [backbone]:
        found, seconds = headroom(folder, index, questions, rollout_args, args.group_size, args.seed, args.dtype)
        for name, n, s, t in found:
            print(f"| {folder} | {name} | {n} | {s:.3f} | {t:.3f} | {t - s:+.3f} |", flush=True)
        print(f"({folder}: {seconds:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
