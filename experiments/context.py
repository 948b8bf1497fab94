"""The premise per teacher context, before any training: on the same mined pairs, what each
`ofsd_context` (ofsd.privileged) gives the teacher view (#48 item 4).

For a checkpoint (the policy that was mined) and its pairs (a pairs file that real_ofsd.py
wrote, or `--questions` train questions drawn with random.Random(--seed), G samples each at the
loop's sampling settings, mined by the paper's rule and written to --pairs), one greedy rollout per
mined question from the student view, then for each context: one greedy rollout per mined question
from that teacher view (EM, searches a question) and, over tau_stu's policy tokens, the true KL by
segment and each view's probability of the student's choices to search (teacher_gap.token_diagnostics).
Prints one row per context and writes it as a JSON line to --out. "Kept" marks a context whose
teacher is ahead of the student (EM) and still searches (at least half the student's searches a
question): the declared experiment's arms are the kept contexts. A pairs file written before #48
holds no group, so it has no `group_queries` row (say so, and mine again for it). Resumable: the
pairs are written once mined, and a context with a row in --out for the same pairs file is skipped.

    python experiments/context.py --checkpoint runs/grpo05/checkpoint/model \\
        --pairs docs/data/real_ofsd_p2.jsonl.pairs-seed1.json --max_turn_tokens=200 --top_p=0.95 \\
        --rollout_rows=160 --out runs/context_p1.jsonl
"""

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PROTOCOL, mined_pairs, policy, provenance  # noqa: E402
from rollout import RolloutConfig, rollout  # noqa: E402
from eval import read_questions  # noqa: E402
from evolve import DEFAULTS  # noqa: E402
import fsdp  # noqa: E402
import ofsd  # noqa: E402
import retriever  # noqa: E402
import checkpoint  # noqa: E402
import teacher_gap  # noqa: E402
from worlds import toyagent  # noqa: E402
from model import Qwen2Config  # noqa: E402


def premise(model, tok, index, mined, rollout_args, kl_chunk, contexts):
    """Yields one row per context (a dict): the student view once, then each teacher view."""
    student, student_searches = teacher_gap.greedy_scores(model, tok, index, mined, rollout_args)
    base = dict(pairs=len(mined), student_em=sum(student) / len(mined),
                student_searches=sum(student_searches) / len(mined))
    for context in contexts:
        t0 = time.time()
        teacher, searches = teacher_gap.greedy_scores(model, tok, index, mined, rollout_args, context)
        row = dict(base, context=context, teacher_em=sum(teacher) / len(mined),
                   teacher_searches=sum(searches) / len(mined),
                   **teacher_gap.token_diagnostics(model, tok, mined, kl_chunk, context))
        row["kept"] = row["teacher_em"] > row["student_em"] and row["teacher_searches"] >= row["student_searches"] / 2
        yield dict(row, seconds=time.time() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True, help="the policy that was mined (a model folder)")
    ap.add_argument("--pairs", required=True, help="its pairs file: read when it exists, else mined and written")
    ap.add_argument("--contexts", default=",".join(ofsd.CONTEXTS))
    ap.add_argument("--world_dir", default=DEFAULTS["world_dir"])
    ap.add_argument("--questions", type=int, default=128, help="train questions rolled out to mine (no pairs file)")
    ap.add_argument("--seed", type=int, default=1, help="mining seed (no pairs file)")
    ap.add_argument("--group_size", type=int, default=DEFAULTS["group_size"])
    for k in PROTOCOL + ("kl_chunk",):
        ap.add_argument(f"--{k}", type=type(DEFAULTS[k]), default=DEFAULTS[k])
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--out", default="", help="JSON lines, one per context")
    args = ap.parse_args()
    contexts = args.contexts.split(",")
    if set(contexts) - set(ofsd.CONTEXTS):
        sys.exit(f"unknown contexts {sorted(set(contexts) - set(ofsd.CONTEXTS))}; known: {', '.join(ofsd.CONTEXTS)}")
    world_dir, _ = toyagent.ensure(args.world_dir, DEFAULTS["world_seed"], DEFAULTS["top_k"])
    index = retriever.load_index(os.path.join(world_dir, "index"))
    width = Qwen2Config.from_json(os.path.join(checkpoint.base_dir(args.checkpoint), "config.json")).hidden_size
    _, _, dev, dt = fsdp.setup("auto", args.dtype, width)
    rollout_args = RolloutConfig(**{k: getattr(args, k) for k in PROTOCOL})
    model, tok = policy(args.checkpoint, dev, dt)

    def mine_them():
        train = read_questions(os.path.join(world_dir, "train.jsonl"))
        questions = random.Random(args.seed).sample(train, min(args.questions, len(train)))
        return ofsd.mine(rollout(model, tok, index, [q["question"] for q in questions], args.group_size, rollout_args,
                                 torch.Generator(device=dev).manual_seed(args.seed)), questions, args.group_size), {}

    mined, _, _ = mined_pairs(args.pairs, mine_them)
    if args.out and os.path.exists(args.out):  # resumed: the contexts this pairs file already has a row for
        done = {r["context"] for r in map(json.loads, open(args.out)) if r["pairs_file"] == args.pairs}
        contexts = [c for c in contexts if c not in done]
    if "group_queries" in contexts and not all(p.group for p in mined):
        print(f"{args.pairs} holds no group (mined before #48): no group_queries row", file=sys.stderr)
        contexts.remove("group_queries")
    print(f"{args.checkpoint} | {dt} | {torch.get_num_threads()} threads | {len(mined)} pairs | {rollout_args}")
    print("| context | teacher EM | student EM | searches/q teacher / student | P(search) teacher / student "
          "| true KL think / search / answer / other | kept | s |\n|---|---|---|---|---|---|---|---|")
    num = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for row in premise(model, tok, index, mined, rollout_args, args.kl_chunk, contexts):
        print(f"| {row['context']} | {row['teacher_em']:.3f} | {row['student_em']:.3f} | {row['teacher_searches']:.2f} "
              f"/ {row['student_searches']:.2f} | {num(row['p_search_teacher'])} / {num(row['p_search_student'])} | "
              + " / ".join(num(row[f"kl_{s}"]) for s in ("think", "search", "answer", "other"))
              + f" | {'yes' if row['kept'] else 'no'} | {row['seconds']:.0f} |", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(dict(row, checkpoint=args.checkpoint, pairs_file=args.pairs,
                                        made=provenance(args.checkpoint, args.pairs, None))) + "\n")


if __name__ == "__main__":
    main()
