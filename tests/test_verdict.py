"""The declared paired rule: eval.sign_test pinned against an independent sign test, and
experiments/verdict.py, run as a user runs it, on made rows and on the committed rows."""

import glob
import json
import os
import re
import subprocess
import sys
from fractions import Fraction

import pytest

from eval import sign_test

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def verdict(*paths):
    """What `python experiments/verdict.py PATHS` prints."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "verdict.py"), *map(str, paths)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def binomial_two_sided(wins_a, wins_b):
    """The exact two-sided sign test by Pascal's triangle in exact fractions (no math.comb): p."""
    n, row = wins_a + wins_b, [Fraction(1)]
    for _ in range(n):
        row = [a + b for a, b in zip([Fraction(0)] + row, row + [Fraction(0)])]
    tail = sum(row[:min(wins_a, wins_b) + 1]) / 2 ** n
    return float(min(Fraction(1), 2 * tail))


def ems(only_a, only_b, both=0, neither=0):
    """Two per-question EM lists with `only_a` questions only A gets right, `only_b` only B, and ties."""
    a = [1.0] * only_a + [0.0] * only_b + [1.0] * both + [0.0] * neither
    b = [0.0] * only_a + [1.0] * only_b + [1.0] * both + [0.0] * neither
    return a, b


def row(arm, seed, em):
    return dict(policy="P", seed=seed, arm=arm, test_em_by_question=em, ofsd_context="full", ofsd_positions="policy",
                test=dict(all=dict(em=sum(em) / len(em), searches=1.0)))


@pytest.mark.parametrize("wins", [(13, 4), (12, 4), (9, 1), (20, 9), (0, 0), (5, 5)])
def test_sign_test_is_the_exact_binomial(wins):
    """eval.sign_test equals the exact two-sided binomial test computed independently."""
    assert sign_test(*wins) == pytest.approx(binomial_two_sided(*wins), abs=1e-12)


def test_rule_gains_at_p_just_under_005_and_not_just_over(tmp_path):
    """An arm 13:4 ahead on two draws (p 0.049) gains; one 12:4 ahead (p 0.077) does not; ties never count;
    one beaten draw forbids a gain; one beat alone is not enough."""
    assert binomial_two_sided(13, 4) < 0.05 < binomial_two_sided(12, 4)
    beat, short, level = ems(13, 4, both=40, neither=60), ems(12, 4, both=40, neither=60), ems(0, 0, 20, 97)
    lost = ems(4, 13, both=40, neither=60)  # 100 ties in each: counting them would make every p tiny

    def line(pairs):
        """The rule's line for an arm against none-round with (arm EM, base EM) on each draw."""
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(row(arm, k, p[j])) + "\n" for k, p in enumerate(pairs)
                                for j, arm in enumerate(("arm", "none-round"))))
        return next(x for x in verdict(path).splitlines() if x.startswith("  arm over none-round"))
    under = line([beat, beat, level])
    assert under.endswith("-> GAIN") and under.count("BEATS") == 2 and "p 0.049" in under
    over = line([short, short, level])
    assert over.endswith("-> no gain") and "BEATS" not in over and "p 0.077" in over
    once = line([beat, level, level])
    assert once.endswith("-> no gain") and once.count("BEATS") == 1
    beaten = line([beat, beat, lost])
    assert beaten.count("BEATS") == 2 and beaten.count("BEATEN") == 1 and beaten.endswith("-> no gain")


def test_a_reused_row_never_replaces_an_evaluated_one(tmp_path):
    """verdict.py keeps the evaluated row of an arm and draw over a row that copied another's test."""
    fresh, copied = row("none-round", 0, [1.0, 0.0]), row("none-round", 0, [0.0, 0.0])
    fresh["test_from"], copied["test_from"] = "evaluated", "reused: (P, 1)"
    for order in ((fresh, copied), (copied, fresh)):
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in order))
        assert "| none-round | 0.500 EM, 1.00 searches |" in verdict(path)


def test_committed_rows_give_the_committed_verdict():
    """verdict.py over docs/data/p-lora-arms/*.jsonl prints docs/data/p-lora-arms/verdict.txt exactly."""
    folder = os.path.join(ROOT, "docs", "data", "p-lora-arms")
    out = verdict(*sorted(glob.glob(os.path.join(folder, "*.jsonl"))))
    with open(os.path.join(folder, "verdict.txt")) as f:
        assert out == f.read()
    assert re.search(r"ofsd-none over none-round \(3 draws\).*BEATEN.*BEATEN.*BEATEN.*no gain", out)


def credit_verdict(path):
    """What `python experiments/credit.py verdict PATH` prints."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "credit.py"), "verdict", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_credit_verdict_reproduces_the_committed_one():
    """experiments/credit.py on docs/data/credit-toy/rows.jsonl prints docs/ablation.md's verdict: MDE 0.0146,
    no difference this design can see for either credit arm."""
    out = credit_verdict(os.path.join(ROOT, "docs", "data", "credit-toy", "rows.jsonl"))
    assert "smallest detectable difference 0.0146" in out
    assert "rlsd: mean EM 0.6607, d = -0.0133 over 10 seeds (5 up, 5 down, sign test p = 1.000)" in out
    assert out.count("no difference this design can see") == 2


def test_credit_rule_calls_a_gain_on_made_rows(tmp_path):
    """The rule on made rows: an arm 0.02 above none on 9 seeds of 10 gains; one 0.02 below on every seed is worse."""
    base = [0.67, 0.68, 0.66, 0.67, 0.69, 0.67, 0.68, 0.66, 0.67, 0.68]
    rows = [dict(arm="none", seed=s, em=e) for s, e in enumerate(base)]
    rows += [dict(arm="up", seed=s, em=e + (0.02 if s else -0.001)) for s, e in enumerate(base)]
    rows += [dict(arm="down", seed=s, em=e - 0.02) for s, e in enumerate(base)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = credit_verdict(path)
    assert re.search(r"up: .*GAIN", out) and re.search(r"down: .*WORSE", out)
