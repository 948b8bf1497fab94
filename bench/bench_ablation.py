"""The paper's central ablation on the toy world: GRPO-only against GRPO + OFSD variants.

Runs `evolve.py` once per (variant, seed), two runs at a time on one thread each (the toy world
and its backbone are shared), then prints, for each variant and evaluation point, test exact
match per question type and overall and searches per question as the mean over seeds
[lowest, highest seed]; the OFSD rounds' diagnostics the same way; and the verdict of the rule
declared in docs/ablation.md:
    a variant gains over GRPO-only only if its final mean EM beats GRPO-only's by more than the
    larger of the two seed ranges (max - min), or its worst seed beats GRPO-only's best seed.
It writes the learning curves (test EM and searches per round, mean line and min-max band per
variant) to OUT/curves.svg. A variant is NAME or NAME:--key=value,--key=value (evolve.py
settings); arguments after `--` go to every run. A run whose results are already in OUT with the
same command is reused (so a killed table resumes where it stopped).

    python bench/bench_ablation.py                     # docs/ablation.md's table: 5 variants x 3 seeds
    python bench/bench_ablation.py --seeds 0 --variants grpo:--ofsd=false ofsd -- --grpo_steps=5
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from eval import curves_svg  # noqa: E402  (the repository's chart, shared with evolve.py)

VARIANTS = (  # pre-declared in docs/ablation.md before the runs; the first is the baseline
    "grpo:--ofsd=false",                         # GRPO only, the same GRPO steps
    "ofsd",                                      # GRPO + OFSD with evolve.py's defaults
    "ofsd-incorrect:--ofsd_students=incorrect",  # only pairs whose student sibling is incorrect
    "ofsd-strong:--lora_lr=1e-3,--lora_epochs=4",  # 5x the LoRA learning rate, twice the epochs
    "ofsd-more:--ofsd_questions=192",            # three times the questions mined per round
)
DIAGNOSTICS = ("pairs", "incorrect_students", "teacher_em", "student_em", "disagree", "kl_true_before",
               "kl_true_after", "clip_frac_before", "p_top_before", "p_top_after", "kl_think", "kl_search",
               "kl_answer", "mined_em_before", "mined_em_after")


def stats(vals):
    vals = [v for v in vals if v is not None]
    return (sum(vals) / len(vals), min(vals), max(vals)) if vals else None


def cell(vals, digits=3):
    s = stats(vals)
    return "-" if s is None else f"{s[0]:.{digits}f} [{s[1]:.{min(digits, 2)}f}, {s[2]:.{min(digits, 2)}f}]"


def run_all(jobs, parallel, env):
    """Run each job's evolve.py (at most `parallel` at once) unless its results exist already."""
    def finish(p, log):
        if p.wait():
            sys.exit(f"{' '.join(p.args)} failed; see {log.name}")

    running = []
    for _, _, cmd, out in jobs:
        stamp = os.path.join(ROOT, out + ".cmd")  # the command whose results are in `out`
        if (os.path.isfile(os.path.join(ROOT, out, "results.md")) and os.path.isfile(stamp)
                and open(stamp).read() == " ".join(cmd)):
            continue
        with open(stamp, "w") as f:
            f.write(" ".join(cmd))
        log = open(os.path.join(ROOT, out + ".log"), "w")
        again = ["--overwrite=true"] if os.path.isdir(os.path.join(ROOT, out)) else []  # a killed run: redone
        running.append((subprocess.Popen(cmd + again, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        if len(running) >= parallel:
            finish(*running.pop(0))
    for p, log in running:
        finish(p, log)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="runs/ablation")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help="NAME[:--key=value,...]; first = baseline")
    ap.add_argument("extra", nargs="*", help="--key=value passed to every evolve.py run (after --)")
    args = ap.parse_args()
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "toyagent.py", "cache/toyworld", "--shipped"], cwd=ROOT, check=True)  # once
    os.makedirs(os.path.join(ROOT, args.out), exist_ok=True)
    variants = [(v.partition(":")[0], [a for a in v.partition(":")[2].split(",") if a]) for v in args.variants]
    seeds = args.seeds.split(",")
    jobs = [(name, s, [sys.executable, "evolve.py", f"--seed={s}", f"--out_dir={args.out}/{name}-seed{s}",
                       *settings, *args.extra], f"{args.out}/{name}-seed{s}")
            for s in seeds for name, settings in variants]
    run_all(jobs, args.parallel, env)

    results, ofsd_rounds = {}, {}  # variant -> per seed: evaluation rows / OFSD round records
    for name, s, _, out in jobs:
        with open(os.path.join(ROOT, out, "checkpoint", "state.json")) as f:
            results.setdefault(name, []).append(json.load(f)["results"])
        with open(os.path.join(ROOT, out, "metrics.jsonl")) as f:
            ofsd_rounds.setdefault(name, []).append([r for r in map(json.loads, f) if r["kind"] == "ofsd_round"])
    with open(os.path.join(ROOT, args.out, "curves.svg"), "w") as f:
        f.write(curves_svg(results))

    types = [t for t in results[variants[0][0]][0][0]["summary"] if t != "all"]
    print(f"\nseeds {args.seeds}; mean over seeds [lowest, highest]; {time.time() - t0:.0f} s for the table\n")
    print("| variant | after | GRPO steps | EM | " + " | ".join(types) + " | searches/q |")
    print("|---|---|---|---|" + "---|" * len(types) + "---|")
    for name, runs in results.items():
        for k, row in enumerate(runs[0]):
            if k == 0 and name != variants[0][0]:
                continue  # the start row is the same for every variant
            at = [r[k]["summary"] for r in runs]
            after = "start" if row["after"] == "start" else f"{row['after'].upper()} round {row['iteration'] + 1}"
            print(f"| {name} | {after} | {row['grpo_steps']} | {cell([a['all']['em'] for a in at])} | " +
                  " | ".join(cell([a[t]['em'] for a in at]) for t in types) +
                  f" | {cell([a['all']['searches'] for a in at], 2)} |")

    print("\nOFSD rounds (each round's own questions): " + ", ".join(DIAGNOSTICS) + "\n")
    print("| variant | round | " + " | ".join(DIAGNOSTICS) + " |")
    print("|---|---|" + "---|" * len(DIAGNOSTICS))
    for name, per_seed in ofsd_rounds.items():
        for k in range(min(map(len, per_seed), default=0)):
            print(f"| {name} | {k + 1} | " + " | ".join(
                cell([r[k].get(d) for r in per_seed], 0 if d in ("pairs", "incorrect_students") else 3)
                for d in DIAGNOSTICS) + " |")

    base = [r[-1]["summary"]["all"]["em"] for r in results[variants[0][0]]]
    print(f"\nthe rule, on final test EM against {variants[0][0]} {cell(base)}:")
    for name, runs in list(results.items())[1:]:
        em = [r[-1]["summary"]["all"]["em"] for r in runs]
        margin = max(max(em) - min(em), max(base) - min(base))
        gain = stats(em)[0] - stats(base)[0] > margin or min(em) > max(base)
        print(f"  {name}: {cell(em)}, mean difference {stats(em)[0] - stats(base)[0]:+.3f} against a margin of "
              f"{margin:.3f}; worst seed {min(em):.3f} vs best baseline seed {max(base):.3f}: "
              f"{'GAIN' if gain else 'no gain'}")
    print(f"\ncurves: {os.path.join(args.out, 'curves.svg')}")


if __name__ == "__main__":
    main()
