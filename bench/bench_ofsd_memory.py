"""The loop's OFSD round on a real checkpoint: its peak resident memory, this checkout against another.

One short GRPO-only run of this checkout (`evolve.py --ofsd_rounds=false`, the settings below)
leaves the checkpoint after its GRPO round. Each code (this checkout, and the checkout --before
names) then continues a copy of that run into one OFSD round with `evolve.py --resume` (the way
bench_ablation.fork turns a run into a variant: the recorded settings say ofsd_rounds=true), one
code after the other, nothing else from this script beside it. The resident set of the resumed
process is read every --every seconds (/proc/PID/status, VmRSS) and each printed line is timed, so
the table gives the peak over the whole process (os.wait4's ru_maxrss), over the round (from its
first "ofsd |" line to its "ofsd | ... pairs" summary line; a code that prints no line when its
round starts is measured from its first LoRA step) and the round's summary.

    python3 bench/bench_ofsd_memory.py --checkpoint ~/.cache/qwen2.5-coder-0.5b-instruct \\
        --before ../before --work runs/ofsd_memory [--threads 2]

What the resumed process holds before its round (setup: the policy, a code's KL model, the
optimizer state from the checkpoint) counts in the whole-process peak; the round's own peak is the
second column. Both codes mine their pairs with their own sampler, so their pairs can differ: the
table gives their number and length.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9
# the P' command's settings (docs/benchmarks.md), shortened: 1 GRPO step of 1 question, a round
# mining 16 questions, 4 test questions
SETTINGS = ["--iterations=1", "--grpo_steps=1", "--questions_per_step=1", "--ppo_mini_batch=1", "--group_size=5",
            "--micro_batch=4", "--activation_checkpointing=true", "--lr=1e-5", "--warmup_steps=1",
            "--max_turn_tokens=200", "--top_p=0.95", "--test_limit=4", "--eval_batch=4", "--rollout_rows=80",
            "--ofsd_questions=16", "--ofsd_clip=none", "--seed=0"]


def defaults(repo):
    """The settings a checkout's evolve.py knows, with their defaults."""
    out = subprocess.run([sys.executable, "-c", "import json, evolve; print(json.dumps(evolve.DEFAULTS))"],
                         cwd=repo, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def fork(src, dst, repo):
    """Copy the GRPO-only run to `dst`, its recorded settings as `repo`'s evolve.py knows them, ofsd_rounds on."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "results.md"))
    state_file = os.path.join(dst, "checkpoint", "state.json")
    with open(state_file) as f:
        state = json.load(f)
    known = defaults(repo)  # a setting the run did not record (a code's own) takes that code's default
    state["config"] = {k: state["config"].get(k, v) for k, v in known.items()}
    state["config"].update(ofsd_rounds=True, out_dir=dst)
    with open(state_file, "w") as f:
        json.dump(state, f)


def resident(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (FileNotFoundError, StopIteration, ProcessLookupError):
        return 0


def measured(cmd, cwd, env, every):
    """Run cmd; returns (its stdout lines with their times, RSS samples (time, bytes), peak bytes)."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines, samples, done = [], [], threading.Event()

    def poll():
        while not done.is_set():
            samples.append((time.time(), resident(p.pid)))
            done.wait(every)
    t = threading.Thread(target=poll)
    t.start()
    for line in p.stdout:
        lines.append((time.time(), line.rstrip("\n")))
        print(line, end="", flush=True)
    _, status, usage = os.wait4(p.pid, 0)
    done.set()
    t.join()
    if status:
        sys.exit(f"{' '.join(cmd)} failed in {cwd} (status {status})")
    return lines, samples, usage.ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True, help="an HF Qwen2 checkpoint folder")
    ap.add_argument("--before", required=True, help="the other checkout (e.g. a git worktree of 4d9e205)")
    ap.add_argument("--work", default="runs/ofsd_memory", help="where the runs go (reused if there)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between resident-set reads")
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    base = [sys.executable, "evolve.py", f"--model_dir={os.path.expanduser(args.checkpoint)}",
            f"--world_dir={os.path.join(ROOT, 'cache', 'toyworld')}", *SETTINGS]
    grpo_run = os.path.join(work, "grpo")
    if not os.path.isfile(os.path.join(grpo_run, "results.md")):
        measured(base + [f"--out_dir={grpo_run}", "--ofsd_rounds=false", "--overwrite=true"], ROOT, env, args.every)
    rows = []
    for name, repo in ((f"before ({os.path.basename(os.path.abspath(args.before))})", os.path.abspath(args.before)),
                       ("this checkout", ROOT)):
        out = os.path.join(work, "before" if name.startswith("before") else "after")
        fork(grpo_run, out, repo)
        t0 = time.time()
        lines, samples, peak = measured(base + [f"--out_dir={out}", "--ofsd_rounds=true", "--resume=true"],
                                        repo, env, args.every)
        first = next(t for t, line in lines if line.startswith("ofsd |"))
        summary_t, summary = next((t, line) for t, line in lines if line.startswith("ofsd |") and "pairs" in line)
        in_round = max(b for t, b in samples if first <= t <= summary_t)
        rows.append((name, time.time() - t0, peak, in_round, summary_t - first, summary))
    print("\n| code | process s | process peak GB | round peak GB | round s | round |")
    print("|---|---|---|---|---|---|")
    for name, secs, peak, in_round, round_s, summary in rows:
        print(f"| {name} | {secs:.0f} | {peak / GB:.2f} | {in_round / GB:.2f} | {round_s:.0f} | {summary} |")


if __name__ == "__main__":
    main()
