"""Exact-match evaluation under the Search-R1 protocol: greedy search rollouts, the paper's table.

For every question: one greedy rollout (rollout.py), the answer is the last <answer> the model
wrote, EM as in grpo.py (normalised, any gold answer). Reported per data set (or, for files whose
questions carry a `type`, per type too): EM, mean searches per question, and the share of
answers in the right format (an <answer> tag was written). Per-question JSON lines (question,
gold answers, full trajectory text, answer, EM, searches) go to --out.

Left out: sampling-based metrics (pass@k), LLM-as-judge or F1 scoring.

    python eval.py --model DIR --index DIR --data nq_test.jsonl,hotpotqa_dev.jsonl [--limit N] [--show 2]
"""

import argparse
import json
import os
import sys

import torch

import model as M
from grpo import exact_match
from retriever import load_index
from rollout import rollout


def evaluate(model, tokenizer, index, questions, *, batch, max_turns, max_turn_tokens, max_obs_tokens, top_k):
    """Greedy rollouts for FlashRAG-format questions -> one result dict per question."""
    out = []
    for s in range(0, len(questions), batch):
        part = questions[s:s + batch]
        trajs = rollout(model, tokenizer, index, [q["question"] for q in part], 1, max_turns=max_turns,
                        max_turn_tokens=max_turn_tokens, max_obs_tokens=max_obs_tokens, top_k=top_k,
                        temperature=0.0, top_p=1.0, generator=None)
        for q, t in zip(part, trajs):
            out.append(dict(question=q["question"], golden_answers=q["golden_answers"], type=q.get("type"),
                            answer=t.answer, em=exact_match(t.answer, q["golden_answers"]),
                            searches=t.n_search, formatted=t.answer is not None,
                            trajectory=t.render(tokenizer)))
    return out


def summarize(results, key=None):
    """{group: dict(n, em, searches, format)} grouped by results[key] (plus "all")."""
    groups = {"all": results}
    if key:
        for r in results:
            if r.get(key):
                groups.setdefault(r[key], []).append(r)
    return {g: dict(n=len(rs), em=sum(r["em"] for r in rs) / len(rs),
                    searches=sum(r["searches"] for r in rs) / len(rs),
                    format=sum(r["formatted"] for r in rs) / len(rs)) for g, rs in groups.items() if rs}


def read_questions(path, limit=0):
    """FlashRAG JSON lines with `question` and `golden_answers`; errors name file and line."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                if not isinstance(r["question"], str) or not isinstance(r["golden_answers"], list):
                    raise TypeError("question must be a string and golden_answers a list")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: bad question line ({type(e).__name__}: {e})") from None
            rows.append(r)
            if limit and len(rows) == limit:
                break
    return rows


def main():
    ap = argparse.ArgumentParser(description="exact-match evaluation with greedy search rollouts")
    ap.add_argument("--model", required=True)
    ap.add_argument("--index", required=True)
    ap.add_argument("--data", required=True, help="comma-separated FlashRAG .jsonl files")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--show", type=int, default=0, help="print this many trajectories per file")
    ap.add_argument("--out", default="eval_results.jsonl")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-turn-tokens", type=int, default=500)
    ap.add_argument("--max-obs-tokens", type=int, default=500)
    ap.add_argument("--top-k", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    args = ap.parse_args()
    model, tok = M.load(args.model, args.device, getattr(torch, args.dtype))
    index = load_index(args.index)
    table, everything = [], []
    for path in args.data.split(","):
        qs = read_questions(path, args.limit)
        res = evaluate(model, tok, index, qs, batch=args.batch, max_turns=args.max_turns,
                       max_turn_tokens=args.max_turn_tokens, max_obs_tokens=args.max_obs_tokens, top_k=args.top_k)
        name = os.path.splitext(os.path.basename(path))[0]
        for r in res[:args.show]:
            print(f"\n=== {name}: {r['question']}  gold={r['golden_answers']}  EM={r['em']:.0f}\n{r['trajectory']}")
        for group, s in summarize(res, "type").items():
            table.append((name if group == "all" else f"{name}/{group}", s))
        everything += [dict(r, data=name) for r in res]
    with open(args.out + ".tmp", "w") as f:
        for r in everything:
            f.write(json.dumps(r) + "\n")
    os.replace(args.out + ".tmp", args.out)
    print("\n| data | n | EM | searches/q | format |\n|---|---|---|---|---|")
    for name, s in table:
        print(f"| {name} | {s['n']} | {s['em']:.3f} | {s['searches']:.2f} | {s['format']:.2f} |")
    sets = [s for name, s in table if "/" not in name]
    print(f"| average | {sum(s['n'] for s in sets)} | {sum(s['em'] for s in sets) / len(sets):.3f} | "
          f"{sum(s['searches'] for s in sets) / len(sets):.2f} | {sum(s['format'] for s in sets) / len(sets):.2f} |")
    print(f"per-question results: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
