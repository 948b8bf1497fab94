"""The declared paired rule and cause test over experiments/real_ofsd.py's rows (docs/ablation.md,
"what the teacher sees"; #57 item 6). Reads the row files, computes nothing of a model.

The paired rule, per draw (a (policy, mining seed) pair): arm A beats arm B if A answers more of the
held-out questions than B and the exact two-sided sign test over the questions where exactly one of
the two is right gives p < 0.05:
    n = wins_A + wins_B,  p = min(1, 2 * sum_{k <= min(wins_A, wins_B)} C(n, k) / 2^n)
A **gains** over B if it beats B on at least two draws and B beats it on none. Every arm is set
against `none-round` and `rft` on the draws both have.
The cause: an arm whose teacher context holds no answer (`queries`, `group_queries`) keeps the
student's searches (test searches a question >= 0.8 of none-round's on every draw) where `ofsd-none`
with `full` stops them (< 0.5 of none-round's on the same draws): then "the answer in the context
teaches the student to answer without looking" holds.
An arm is its row's arm, teacher view and loss positions (real_ofsd.label). A draw missing
a row is left out of that comparison and the line says on how many draws it stands.

    python experiments/verdict.py docs/data/p-lora-arms/*.jsonl
"""

import json
import sys

from real_ofsd import draw, label  # puts the repository on sys.path (experiments/common.py)
from eval import paired  # noqa: E402  (the exact paired sign test)

BASES = ("none-round", "rft")
NO_ANSWER_VIEWS = ("queries", "group_queries")


def read_rows(paths):
    """{arm label: {draw: row}} from JSON-lines files: a later row of the same arm and draw wins, except
    that a row whose test results were copied from another ("test_from": "reused ...") never replaces one."""
    arms = {}
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}, line {n}: not JSON ({e})")
                if "test_em_by_question" not in row:
                    raise SystemExit(f"{path}, line {n}: no test_em_by_question (a row from before the paired rule)")
                held = arms.setdefault(label(row), {})
                if not (row.get("test_from", "").startswith("reused") and draw(row) in held):
                    held[draw(row)] = row  # an evaluated row is never replaced by one that copied its test
    return arms


def compare(arms, a, b):
    """The rule's line for arm a against arm b on the draws both have."""
    common = [d for d in arms[a] if d in arms[b]]
    parts, won, lost = [], 0, 0
    for d in common:
        ea, eb = arms[a][d]["test_em_by_question"], arms[b][d]["test_em_by_question"]
        wa, wb, p = paired(ea, eb)
        a_beats, b_beats = wa > wb and p < 0.05, wb > wa and p < 0.05
        won, lost = won + a_beats, lost + b_beats
        parts.append(f"{d}: {sum(ea):g} vs {sum(eb):g} right, {wa}:{wb} where one is, p {p:.3f}"
                     + (" BEATS" if a_beats else " BEATEN" if b_beats else ""))
    gain = won >= 2 and lost == 0
    return f"  {a} over {b} ({len(common)} draws): " + "; ".join(parts) + f" -> {'GAIN' if gain else 'no gain'}"


def cause(arms):
    """The declared cause test's line, or None when the rows for it are missing."""
    base, full = arms.get("none-round", {}), arms.get("ofsd-none", {})
    searches = lambda arm, d: arms[arm][d]["test"]["all"]["searches"] / base[d]["test"]["all"]["searches"]  # noqa: E731
    without_answer = [a for a in arms if any(f"[{v}/" in a for v in NO_ANSWER_VIEWS) and set(base) <= set(arms[a])]
    if not base or not set(base) <= set(full) or not without_answer:
        return None
    keeping = [a for a in without_answer if all(searches(a, d) >= 0.8 for d in base)]
    stops = all(searches("ofsd-none", d) < 0.5 for d in base)
    holds = bool(keeping) and stops
    return (f"  the cause: ofsd-none with full {'stops' if stops else 'does not stop'} the searches (below 0.5 of "
            f"none-round's on every draw); arms without the answer that keep them: {', '.join(keeping) or 'none'} "
            f"-> the explanation {'holds' if holds else 'does not hold'}")


def main(paths):
    if not paths:
        sys.exit("usage: python experiments/verdict.py ROWS.jsonl [...]")
    arms = read_rows(paths)
    print("| arm | " + " | ".join(f"draw {d}" for d in sorted({d for r in arms.values() for d in r})) + " |")
    draws = sorted({d for r in arms.values() for d in r})
    print("|---|" + "---|" * len(draws))
    for a, rows in arms.items():
        print(f"| {a} | " + " | ".join(f"{rows[d]['test']['all']['em']:.3f} EM, {rows[d]['test']['all']['searches']:.2f} "
                                       f"searches" if d in rows else "-" for d in draws) + " |")
    print("\nthe paired rule, on the held-out questions:")
    for a in arms:
        for b in BASES:
            if a != b and b in arms and not (a == "none-round" and b == "rft"):
                print(compare(arms, a, b))
    line = cause(arms)
    print(line or "  the cause: not yet (it needs none-round, ofsd-none with full and an arm whose context holds no "
                  "answer on the same draws)")


if __name__ == "__main__":
    main(sys.argv[1:])
