"""eval.py's greedy evaluation of a real checkpoint in float32 and in bfloat16, at a small batch and at
one batch of every question, on the same questions in one run (#34 item 1's evaluation target).

For each DTYPE:BATCH in --runs (default float32:16, bfloat16:16, float32:0, bfloat16:0, where 0 means
every question in one batch): the checkpoint loaded in that dtype, as eval.py loads it, then
eval.evaluate on the first --limit questions of --data with the anchor's protocol. Prints a table:
seconds, decode steps (forward calls of one token a row), rows decoded over those steps, EM, format,
searches per question, and how many answers and trajectories differ from the first run's.

Why the batch matters as much as the dtype: a greedy batch decodes each turn until its last row
stops, and a row that never closes its tag runs to the turn's cap (500 tokens) alone, at one row a
step, where a step is bound by reading the weights (bfloat16 halves those bytes: 2x at most). With
16 questions a batch, 132 questions pay that tail in each of 9 batches; in one batch, once. The KV
cache of one batch holds every row: 132 rows at the anchor's protocol are about 4.5 GB in bfloat16
and 9 GB in float32 for the 0.5B; docs/benchmarks.md gives the whole run's measured peak.

    python bench/bench_eval.py --checkpoint ~/.cache/qwen2.5-coder-0.5b-instruct --index wiki/index \\
        --data wiki/test.jsonl [--limit 0] [--runs float32:16,bfloat16:16,float32:0,bfloat16:0]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eval import evaluate, read_questions, summarize  # noqa: E402
from model import load  # noqa: E402
from retriever import load_index  # noqa: E402
from rollout import SEARCH_R1  # noqa: E402


def counted(model):
    """Counts the model's decode steps and the rows they decode: {"steps": n, "rows": n}."""
    count = {"steps": 0, "rows": 0}
    hidden = model.hidden

    def wrapper(input_ids, *args, **kwargs):
        if input_ids.shape[1] == 1:  # a decode step: one new token a row
            count["steps"] += 1
            count["rows"] += input_ids.shape[0]
        return hidden(input_ids, *args, **kwargs)
    model.hidden = wrapper  # an instance attribute: this model only
    return count


def one_run(checkpoint, dtype, batch, index, questions, protocol):
    """(seconds, decode counts, eval.evaluate's results) for one dtype and batch (0: all questions)."""
    model, tok = load(checkpoint, "cpu", dtype)
    count = counted(model)
    t0 = time.perf_counter()
    results = evaluate(model, tok, index, questions, protocol, batch or len(questions))
    seconds = time.perf_counter() - t0
    del model.hidden  # the wrapper holds the model: without it the next run's load waits for the GC
    return seconds, count, results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=os.environ.get("QWEN_CHECKPOINT", ""), help="a Qwen2.5 model folder")
    ap.add_argument("--index", required=True, help="the world's BM25 index folder")
    ap.add_argument("--data", required=True, help="a FlashRAG .jsonl of questions")
    ap.add_argument("--limit", type=int, default=0, help="the first N questions (0: all)")
    ap.add_argument("--runs", default="float32:16,bfloat16:16,float32:0,bfloat16:0",
                    help="DTYPE:BATCH, comma-separated (batch 0: every question at once); the first is the reference")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    args = ap.parse_args()
    if not args.checkpoint:
        sys.exit("give --checkpoint (or set QWEN_CHECKPOINT) to a Qwen2.5 model folder")
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = []
    for spec in args.runs.split(","):
        name, _, batch = spec.partition(":")
        if name not in ("float32", "bfloat16") or not batch.isdigit():
            sys.exit(f"--runs: {spec!r} is not DTYPE:BATCH with DTYPE float32 or bfloat16 and BATCH >= 0")
        runs.append((name, int(batch)))
    questions = read_questions(args.data, args.limit)
    index = load_index(args.index)
    protocol = SEARCH_R1
    print(f"{args.checkpoint} | {len(questions)} questions of {args.data} | {torch.get_num_threads()} threads "
          f"| {protocol}", flush=True)
    print("| dtype | batch | seconds | speed vs first | decode steps | rows decoded | EM | format | searches/q "
          "| answers differing | trajectories differing |\n|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    first = None
    for name, batch in runs:
        seconds, count, res = one_run(args.checkpoint, getattr(torch, name), batch, index, questions, protocol)
        first = first or (seconds, res)
        s = summarize(res)["all"]
        answers = sum(a["answer"] != b["answer"] for a, b in zip(res, first[1]))
        texts = sum(a["trajectory"] != b["trajectory"] for a, b in zip(res, first[1]))
        print(f"| {name} | {batch or len(questions)} | {seconds:.1f} | {first[0] / seconds:.2f}x | {count['steps']} "
              f"| {count['rows']} | {s['em']:.3f} | {s['format']:.2f} | {s['searches']:.2f} | {answers} | {texts} |",
              flush=True)


if __name__ == "__main__":
    main()
