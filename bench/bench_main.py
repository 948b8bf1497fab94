"""A fixed slice of the main job, this checkout against an earlier version of the repository.

The earlier version (--base, any git revision; default HEAD) is checked out beside this one with
`git worktree`, each gets its own toy world (setup, timed apart: a build or the shipped backbone),
then each runs the same slice of `evolve.py` in its own process, one after the other on the same
machine: a start evaluation on the first --test_limit test questions, --grpo_steps GRPO steps, an
evaluation, an OFSD round on --ofsd_questions questions, an evaluation. Prints one table with the
wall time of each and the ratio.

    python bench/bench_main.py [--base REV] [--grpo_steps 3] [--ofsd_questions 16] [--test_limit 64]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def world_command(repo):
    """The command that writes a revision's toy world and backbone: worlds/toyagent.py now, toyagent.py at
    the top level before it (with assets/toy_backbone shipped, or built), toyworld.py before that."""
    if os.path.isfile(os.path.join(repo, "worlds", "toyagent.py")):
        return ["-m", "worlds.toyagent", "--shipped"]
    shipped = ["--shipped"] if os.path.isdir(os.path.join(repo, "assets", "toy_backbone")) else []
    if "def main" in open(os.path.join(repo, "toyagent.py")).read():
        return ["toyagent.py", *shipped]
    return ["toyworld.py", *shipped]


def timed(cmd, cwd):
    t0 = time.time()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed in {cwd}:\n{p.stderr[-3000:]}")
    return time.time() - t0, p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="the git revision to compare with")
    ap.add_argument("--grpo_steps", type=int, default=3)
    ap.add_argument("--ofsd_questions", type=int, default=16)
    ap.add_argument("--test_limit", type=int, default=64)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_main_")
    base_dir = os.path.join(tmp, "base")
    subprocess.run(["git", "worktree", "add", "--detach", base_dir, args.base], cwd=ROOT, check=True,
                   capture_output=True)
    rows = []
    try:
        for name, repo in ((f"base ({args.base})", base_dir), ("this checkout", ROOT)):
            world = os.path.join(tmp, f"world_{len(rows)}")
            setup, _ = timed([sys.executable, *world_command(repo), world], repo)
            slice_args = [f"--world_dir={world}", f"--out_dir={os.path.join(tmp, f'run_{len(rows)}')}",
                          "--iterations=1", f"--grpo_steps={args.grpo_steps}",
                          f"--ofsd_questions={args.ofsd_questions}", f"--test_limit={args.test_limit}"]
            seconds, out = timed([sys.executable, "evolve.py", *slice_args], repo)
            final = [line for line in out.splitlines() if line.startswith("| 2 |")]
            rows.append((name, setup, seconds, final[0] if final else "?"))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base_dir], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nslice: start eval on {args.test_limit} test questions, {args.grpo_steps} GRPO steps, eval, "
          f"OFSD round on {args.ofsd_questions} questions, eval\n")
    print("| version | toy world setup s | slice s | slice speed-up vs base |")
    print("|---|---|---|---|")
    for name, setup, seconds, _ in rows:
        print(f"| {name} | {setup:.1f} | {seconds:.1f} | {rows[0][2] / seconds:.2f}x |")
    print("\nlast results row of each:")
    for name, _, _, final in rows:
        print(f"  {name}: {final}")


if __name__ == "__main__":
    main()
