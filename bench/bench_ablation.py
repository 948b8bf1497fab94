"""The paper's central ablation on the toy world: GRPO-only against GRPO + OFSD, same GRPO steps.

Runs `evolve.py` for each seed with --ofsd=true and --ofsd=false (two runs at a time, one
thread each; the toy world and backbone are shared), then prints, per evaluation point, the
test exact match per question type and overall and the mean searches per question, as the
mean over seeds with the lowest and highest seed. Extra arguments go to every evolve.py run.

    python bench/bench_ablation.py [--seeds 0,1,2] [--out runs/ablation] [-- --grpo_steps=10 ...]
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="runs/ablation")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("extra", nargs="*", help="--key=value passed to evolve.py")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "toyworld.py", "cache/toyworld", "--shipped"], cwd=ROOT, check=True)  # once
    jobs = [(variant, s) for s in args.seeds.split(",") for variant in ("grpo+ofsd", "grpo")]
    running = []
    os.makedirs(os.path.join(ROOT, args.out), exist_ok=True)
    for variant, s in jobs:
        out = os.path.join(args.out, f"{variant}-seed{s}")
        cmd = [sys.executable, "evolve.py", f"--seed={s}", f"--ofsd={variant == 'grpo+ofsd'}",
               f"--out_dir={out}", *args.extra]
        log = open(os.path.join(ROOT, out + ".log"), "w")
        running.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        if len(running) >= args.parallel:
            p, f = running.pop(0)
            if p.wait():
                sys.exit(f"{' '.join(p.args)} failed; see {f.name}")
    for p, f in running:
        if p.wait():
            sys.exit(f"{' '.join(p.args)} failed; see {f.name}")

    table = {}  # (variant, eval index) -> list over seeds of summaries
    for variant, s in jobs:
        with open(os.path.join(ROOT, args.out, f"{variant}-seed{s}", "checkpoint", "state.json")) as f:
            for k, row in enumerate(json.load(f)["results"]):
                table.setdefault((variant, k), []).append((row, row["summary"]))
    types = [t for t in next(iter(table.values()))[0][1] if t != "all"]
    print(f"\nseeds {args.seeds}; mean over seeds [min, max]\n")
    print("| variant | after | GRPO steps | EM | " + " | ".join(types) + " | searches/q |")
    print("|---|---|---|---|" + "---|" * len(types) + "---|")
    for (variant, k), rows in sorted(table.items(), key=lambda kv: (kv[0][0] == "grpo", kv[0][1])):
        def cell(key, field="em"):
            vals = [summ[key][field] for _, summ in rows]
            return f"{sum(vals) / len(vals):.3f} [{min(vals):.2f}, {max(vals):.2f}]"
        r0 = rows[0][0]
        after = "start" if r0["after"] == "start" else f"{r0['after']} {r0['iteration']}"
        print(f"| {variant} | {after} | {r0['grpo_steps']} | {cell('all')} | " +
              " | ".join(cell(t) for t in types) + f" | {cell('all', 'searches')} |")


if __name__ == "__main__":
    main()
