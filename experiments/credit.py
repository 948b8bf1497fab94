"""The teacher inside GRPO on the toy world (#79): GRPO alone with and without RLSD's token credit.

Declared in docs/ablation.md ("the teacher inside GRPO") before its first run. `run` starts evolve.py
once per (arm, seed), two at a time on one thread each, each into OUT/ARM-seedS (a finished run is
kept, so a killed experiment resumes; OUT/ARM-seedS.made.json says what ran it: machine, commit),
then writes one row per run to ROWS: the end test EM, per type and searches, the mean over steps of
the credit's statistics, the run's seconds and its provenance. `--arms` runs some arms only. `verdict` prints the declared rule from the rows alone:
    d_s = EM(arm, s) - EM(none, s);  MDE = (t(.975, 9) + t(.80, 9)) / sqrt(n) * sqrt(2) * sd_none
    an arm gains if mean(d) > MDE and the exact sign test over the seeds gives p < 0.05 (worse: the
    same with the signs reversed)
(t quantiles for n = 10 seeds; another n is refused).

    python3 experiments/credit.py run --seeds 0-9 --rows docs/data/credit-toy/rows.jsonl
    python3 experiments/credit.py verdict docs/data/credit-toy/rows.jsonl
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import provenance  # noqa: E402  (puts the repository on sys.path)
from eval import sign_test  # noqa: E402
import checkpoint  # noqa: E402

COMMON = ["--ofsd_rounds=false", "--iterations=1"]  # GRPO alone, one round of the default 12 steps
ARMS = {  # pre-declared in docs/ablation.md; the first is the baseline
    "none": [],
    "rlsd": ["--credit_lambda=0.5", "--credit_eps=0.2", "--credit_decay_steps=50"],
    "strong": ["--credit_lambda=1", "--credit_eps=1", "--credit_decay_steps=0"],
}
T_SUM = {10: 2.262 + 0.883}  # t(0.975, n - 1) + t(0.80, n - 1): a paired test at alpha 0.05, 80% power


def run(args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "worlds.toyagent", "cache/toyworld", "--shipped"], cwd=ROOT, check=True)  # once
    seeds = expand(args.seeds)
    jobs = [(arm, s, os.path.join(args.out, f"{arm}-seed{s}")) for s in seeds for arm in args.arms.split(",")]
    todo = [j for j in jobs if not os.path.exists(os.path.join(ROOT, j[2], "results.md"))]
    made = provenance(os.path.join(ROOT, "cache/toyworld/backbone"), None, threads=1,
                      training=dict(common=COMMON, arms=ARMS))
    running = []
    while todo or running:
        while todo and len(running) < args.parallel:
            arm, s, out = todo.pop(0)
            cmd = [sys.executable, "evolve.py", f"--seed={s}", f"--out_dir={out}", "--overwrite=true", *COMMON, *ARMS[arm]]
            os.makedirs(os.path.join(ROOT, args.out), exist_ok=True)
            checkpoint.write_atomic(os.path.join(ROOT, out + ".made.json"), json.dumps(made))  # what ran it
            log = open(os.path.join(ROOT, out + ".log"), "w")
            running.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), out, time.time()))
        time.sleep(2)
        for p, out, t0 in [r for r in running if r[0].poll() is not None]:
            running.remove((p, out, t0))
            if p.returncode:
                sys.exit(f"{' '.join(p.args)} failed: see {out}.log")
            print(f"{out}: {time.time() - t0:.0f}s", flush=True)
    rows = [dict(row(arm, s, os.path.join(ROOT, out)), made=json.load(open(os.path.join(ROOT, out + ".made.json"))))
            for arm, s, out in jobs]
    checkpoint.write_atomic(args.rows, "".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} rows -> {args.rows}")


def expand(seeds):
    a, _, b = seeds.partition("-")
    return list(range(int(a), int(b) + 1)) if b else [int(x) for x in seeds.split(",")]


def row(arm, seed, out):
    """One run's row: its end evaluation and the mean over its steps of the credit statistics."""
    records = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    end = [r for r in records if r["kind"] == "eval"][-1]
    steps = [r for r in records if r["kind"] == "grpo_step"]
    credit = {}
    for k in sorted({k for r in steps for k in r.get("credit", {})}):
        vals = [r["credit"][k] for r in steps if r.get("credit", {}).get(k) is not None]
        credit[k] = sum(vals) / len(vals) if vals else None
    return dict(arm=arm, seed=seed, command=ARMS[arm], em=end["summary"]["all"]["em"],
                n=end["summary"]["all"]["n"], searches=end["summary"]["all"]["searches"], summary=end["summary"],
                reward=sum(r["reward"] for r in steps) / len(steps), credit=credit,
                seconds=sum(r["seconds"] for r in records if r["kind"] == "eval"))


def verdict(args):
    rows = [json.loads(x) for x in open(args.rows)]
    em = {}
    for r in rows:
        em.setdefault(r["arm"], {})[r["seed"]] = r["em"]
    base = em["none"]
    n = len(base)
    if n not in T_SUM:
        sys.exit(f"the rule is declared for {sorted(T_SUM)} seeds; the rows have {n} for none")
    mean = sum(base.values()) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in base.values()) / (n - 1))
    mde = T_SUM[n] / math.sqrt(n) * math.sqrt(2) * sd
    print(f"none: end test EM {mean:.4f} (sd over {n} seeds {sd:.4f}); smallest detectable difference {mde:.4f}")
    for arm in [a for a in em if a != "none"]:
        seeds = sorted(set(em[arm]) & set(base))
        d = [em[arm][s] - base[s] for s in seeds]
        up, down = sum(x > 0 for x in d), sum(x < 0 for x in d)
        p, md = sign_test(up, down), sum(d) / len(d)
        word = "GAIN" if md > mde and p < 0.05 and up > down else \
            "WORSE" if -md > mde and p < 0.05 and down > up else "no difference this design can see"
        print(f"{arm}: mean EM {sum(em[arm][s] for s in seeds) / len(seeds):.4f}, d = {md:+.4f} over {len(seeds)} "
              f"seeds ({up} up, {down} down, sign test p = {p:.3f}) against MDE {mde:.4f}: {word}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seeds", default="0-9")
    r.add_argument("--out", default="runs/credit")
    r.add_argument("--parallel", type=int, default=2)
    r.add_argument("--arms", default=",".join(ARMS))
    r.add_argument("--rows", default="docs/data/credit-toy/rows.jsonl")
    v = sub.add_parser("verdict")
    v.add_argument("rows")
    a = ap.parse_args()
    run(a) if a.what == "run" else verdict(a)
