"""Memory after each round of one process (#70 item 3): run a command (evolve.py), print each of its
lines, and after each `eval |` line the process's resident set (VmRSS) and peak so far (VmHWM) from
/proc (Linux), and after each `grpo |` and `eval |` line the largest resident set since the last such line
(polled every 0.1 s: a step's rollout and update, a round's merge and evaluation); at the end, the resident set
after the last round over after the first GRPO round.

    python3 bench/rounds_memory.py python3 evolve.py --model_dir=docs/data/p-lora-b4/policy --iterations=3 \
        --ofsd_rounds=false --grpo_steps=1 --questions_per_step=4 --ppo_mini_batch=4 --group_size=5 \
        --micro_batch=4 --activation_checkpointing=true --grpo_lora_rank=4 --grpo_lora_alpha=32 \
        --grpo_lora_lr=1e-4 --warmup_steps=1 --max_turn_tokens=200 --top_p=0.95 --test_limit=64 \
        --eval_batch=64 --rollout_rows=80 --seed=0 --out_dir=runs/rounds
"""
import subprocess
import sys
import threading
import time



def memory(pid):
    """(resident, peak so far) of process `pid` in GB, from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        kb = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmRSS", "VmHWM"))}
    return kb["VmRSS"] * 1024 / 1e9, kb["VmHWM"] * 1024 / 1e9


def main(cmd):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    t0, rows, largest = time.time(), [], [0.0]

    def poll():  # the largest resident set between two printed step / eval lines: which phase peaks
        while p.poll() is None:
            try:
                largest[0] = max(largest[0], memory(p.pid)[0])
            except (OSError, KeyError):
                pass
            time.sleep(0.1)
    threading.Thread(target=poll, daemon=True).start()
    for line in p.stdout:
        print(line, end="", flush=True)
        if line.startswith(("grpo |", "eval |")):
            print(f"memory | largest resident since the last step or eval line {largest[0]:.2f} GB", flush=True)
            largest[0] = 0.0
        if line.startswith("eval |"):
            rows.append(memory(p.pid))
            print(f"memory | after round {len(rows) - 1} | resident {rows[-1][0]:.2f} GB | peak so far "
                  f"{rows[-1][1]:.2f} GB | {time.time() - t0:.0f} s", flush=True)
    p.wait()
    print(f"exit {p.returncode}; resident after each round: " + ", ".join(f"{r:.2f}" for r, _ in rows))
    if len(rows) > 2:
        print(f"after the last GRPO round / after the first: {rows[-1][0] / rows[1][0]:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
