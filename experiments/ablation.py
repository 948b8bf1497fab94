"""The paper's central ablation on the toy world: GRPO-only against GRPO + OFSD variants.

Runs `evolve.py` once per (variant, seed), two runs at a time on one thread each (the toy world
and its backbone are shared). Variants that differ from the baseline only in settings that an OFSD
round alone reads (OFSD_ONLY) share the seed's first GRPO round: it runs once, and each of them
continues from its checkpoint with `--resume` (`fork`), exactly the run it makes from the start
(checked: every metrics record and the final weights byte for byte). Then it prints, for each
variant and evaluation point, test exact match per question type and overall and searches per
question as the mean over seeds [lowest, highest seed]; the OFSD rounds' diagnostics the same
way; the teacher's headroom per round (also on the pairs whose student was incorrect, and the
rounds where even a reader that copies tau_ref could reach 0.10); and the verdict of the rule
declared in docs/ablation.md:
    a variant gains over GRPO-only only if its final mean EM beats GRPO-only's by more than the
    larger of the two seed ranges (max - min), or its worst seed beats GRPO-only's best seed.
It writes the learning curves (test EM and searches per round, mean line and min-max band per
variant) to OUT/curves.svg. A variant is NAME or NAME:--key=value,--key=value (evolve.py
settings); arguments after `--` go to every run. A run whose results are already in OUT with the
same command is reused (so a killed table resumes where it stopped).

    python experiments/ablation.py                     # docs/ablation.md's table: 4 variants x 5 seeds
    python experiments/ablation.py --seeds 0 --variants grpo:--ofsd_rounds=false ofsd -- --grpo_steps=5
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cell, provenance, stats  # noqa: E402
from eval import curves_svg  # noqa: E402  (the repository's chart, shared with evolve.py)
import configurator  # noqa: E402
import evolve  # noqa: E402  (its parse_overrides types a variant's settings)
import checkpoint  # noqa: E402

VARIANTS = (  # pre-declared in docs/ablation.md before the runs; the first is the baseline
    "grpo:--ofsd_rounds=false",                     # GRPO only, the same GRPO steps
    "ofsd-vocab:--ofsd_clip=vocab",          # the paper's formula: each (position, vocabulary) term clipped
    "ofsd-position:--ofsd_clip=position",    # each position's KL clipped
    "ofsd-none:--ofsd_clip=none",            # plain forward KL
)
HEADROOM = 0.10  # the fair test's precondition: teacher_em - student_em in an OFSD round (docs/ablation.md)
DIAGNOSTICS = ("pairs", "incorrect_students", "teacher_em", "student_em", "disagree", "kl_true_before",
               "kl_true_after", "clip_frac_before", "p_top_before", "p_top_after", "kl_think", "kl_search",
               "kl_answer", "mined_em_before", "mined_em_after")


# The settings only an OFSD round reads (evolve.py passes them to ofsd.mine_round, teacher_gap and
# ofsd.distill alone). Variants that differ from the baseline in these alone share its first GRPO round
# (same seed, same steps, deterministic), which runs once per seed.
OFSD_ONLY = ("ofsd_rounds", "ofsd_questions", "ofsd_students", "ofsd_loss", "ofsd_kl_weight", "ofsd_lora_rank", "ofsd_lora_alpha",
             "ofsd_lora_lr", "ofsd_epochs", "ofsd_pairs_per_step", "tau_clip", "ofsd_clip", "ofsd_context", "ofsd_positions",
             "kl_chunk")


def fork(src, dst, args):
    """`src` forked into `dst` as the variant of command line `args` (checkpoint.fork_run): the OFSD
    settings at their defaults, then the variant's."""
    checkpoint.fork_run(src, dst, {**{k: evolve.DEFAULTS[k] for k in OFSD_ONLY}, **configurator.parse(args, evolve.DEFAULTS, evolve.__file__, evolve.__doc__)})


def run_all(jobs, parallel, env):
    """Run each job (at most `parallel` at once) unless its results exist already. A job is
    (command, out_dir, after): after=None runs the command; else it waits for the job whose out_dir
    is `after`, forks that run into out_dir and resumes it. Beside out_dir, OUT.cmd records the
    command whose results out_dir holds (a forked run's: the variant's own from-scratch command)."""
    def done(cmd, out):
        path = os.path.join(ROOT, out + ".cmd")
        return (os.path.isfile(os.path.join(ROOT, out, "results.md")) and os.path.isfile(path)
                and open(path).read() == " ".join(cmd))

    pending = [j for j in jobs if not done(*j[:2])]
    finished = {j[1] for j in jobs if j not in pending}
    running = []
    while pending or running:
        for job in [j for j in pending if j[2] is None or j[2] in finished][:max(0, parallel - len(running))]:
            cmd, out, after = job
            pending.remove(job)
            with open(os.path.join(ROOT, out + ".cmd"), "w") as f:
                f.write(" ".join(cmd))
            if after is not None:
                fork(os.path.join(ROOT, after), os.path.join(ROOT, out), cmd[2:])
                cmd = cmd + ["--resume"]
            elif os.path.isdir(os.path.join(ROOT, out)):
                cmd = cmd + ["--overwrite=true"]  # a killed run: redone
            log = open(os.path.join(ROOT, out + ".log"), "w")
            running.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), out))
        if not running:
            sys.exit("jobs wait for runs that never ran: " + ", ".join(j[1] for j in pending))
        time.sleep(1)
        for p, out in [r for r in running if r[0].poll() is not None]:
            running.remove((p, out))
            if p.returncode:
                sys.exit(f"{' '.join(p.args)} failed; see {out}.log")
            finished.add(out)


def plan(variants, seeds, out, extra):
    """The jobs of the table (evolve.py commands, from scratch). Per seed, the first GRPO round runs
    once (OUT/first-seedS, GRPO only, one iteration) when some variant differs from the baseline in
    OFSD_ONLY settings alone; those variants fork from it; any other variant runs from scratch."""
    shares = [all(a.removeprefix("--").partition("=")[0] in OFSD_ONLY for a in settings)
              for _, settings in variants]  # `extra` goes to every run, the first one's too
    jobs = []
    for s in seeds:
        first = f"{out}/first-seed{s}"
        if any(shares):
            jobs.append(([sys.executable, "evolve.py", f"--seed={s}", f"--out_dir={first}", "--ofsd_rounds=false",
                          "--iterations=1", *extra], first, None))
        for (name, settings), share in zip(variants, shares):
            run = f"{out}/{name}-seed{s}"
            jobs.append(([sys.executable, "evolve.py", f"--seed={s}", f"--out_dir={run}", *settings, *extra],
                         run, first if share else None))
    return jobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--out", default="runs/ablation")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help="NAME[:--key=value,...]; first = baseline")
    ap.add_argument("extra", nargs="*", help="--key=value passed to every evolve.py run (after --)")
    args = ap.parse_args()
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "worlds.toyagent", "cache/toyworld", "--shipped"], cwd=ROOT, check=True)  # once
    os.makedirs(os.path.join(ROOT, args.out), exist_ok=True)
    variants = [(v.partition(":")[0], [a for a in v.partition(":")[2].split(",") if a]) for v in args.variants]
    seeds = args.seeds.split(",")
    jobs = plan(variants, seeds, args.out, args.extra)
    made = provenance(os.path.join(ROOT, "cache/toyworld/backbone"), None, threads=int(env["OMP_NUM_THREADS"]),
                      training=dict(seeds=seeds, variants=args.variants, extra=args.extra))
    checkpoint.write_atomic(os.path.join(ROOT, args.out, "made.json"), json.dumps(made, indent=1))
    run_all(jobs, args.parallel, env)
    runs = [(name, s, f"{args.out}/{name}-seed{s}") for s in seeds for name, _ in variants]

    results, ofsd_rounds = {}, {}  # variant -> per seed: evaluation rows / OFSD round records
    for name, s, out in runs:
        with open(os.path.join(ROOT, out, "checkpoint", "state.json")) as f:
            results.setdefault(name, []).append(json.load(f)["results"])
        with open(os.path.join(ROOT, out, "metrics.jsonl")) as f:
            ofsd_rounds.setdefault(name, []).append([r for r in map(json.loads, f) if r["kind"] == "ofsd_round"])
    with open(os.path.join(ROOT, args.out, "curves.svg"), "w") as f:
        f.write(curves_svg(results))

    types = [t for t in results[variants[0][0]][0][0]["summary"] if t != "all"]
    print(f"\nseeds {args.seeds}; mean over seeds [lowest, highest]; {time.time() - t0:.0f} s for the table; "
          f"made: {json.dumps(made)}\n")
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

    def met(gaps):  # how many seeds' headroom reaches the precondition
        return sum(g >= HEADROOM - 1e-9 for g in gaps)

    print("\nthe teacher's headroom (teacher_em - student_em on each round's mined questions), and the seeds "
          f"where it is at least {HEADROOM:.2f} (the fair test's precondition):")
    for name, per_seed in ofsd_rounds.items():
        for k in range(min(map(len, per_seed), default=0)):
            rows = [r[k] for r in per_seed if "teacher_em" in r[k]]
            gaps = [m["teacher_em"] - m["student_em"] for m in rows]
            # a reader that copies tau_ref verbatim scores 1.0 (retrieval is deterministic): its headroom
            reachable = met([1 - m["student_em"] for m in rows])
            print(f"  {name} round {k + 1}: {cell(gaps)}; {met(gaps)} of {len(gaps)} seeds "
                  f"(reachable by a perfect reader, teacher EM 1.0: {reachable})")
            wrong = [m["teacher_em_incorrect"] - m["mined_em_before_incorrect"] for m in rows
                     if m.get("teacher_em_incorrect") is not None]
            if wrong:  # the pairs whose student sample was incorrect, the ones distillation is for
                print(f"    on the pairs with an incorrect student: {cell(wrong)}; {met(wrong)} of {len(wrong)} seeds")

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
