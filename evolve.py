"""Search-E1: alternate GRPO rounds (explore) with OFSD rounds (consolidate). The main job.

    evaluate the starting policy
    for each iteration:
        GRPO round: sample G search rollouts per question, reward = exact match, GRPO steps
                    (grpo.py; KL to the policy this round started from, see kl_ref below)
        OFSD round: fresh rollouts of the updated policy -> one (tau_ref, tau_stu) pair per
                    question -> LoRA distillation of the teacher view (tau_ref as privileged
                    context, adapter off) into the student view -> merge (ofsd.py)
        evaluate after each round; checkpoint after each round (resumable)

With no arguments it trains on the built-in toy world (toyworld.py: built on first use, then
cached) and prints a results table per round. Any constant below can be overridden as
--key=value; `--resume` continues a killed run from its last checkpoint. Real-scale settings
(METHOD.md's anchor values) are in the comments and in the README.

    python evolve.py                                   # the toy world, CPU, minutes
    python evolve.py --ofsd=False --out_dir=runs/grpo  # the GRPO-only ablation
    torchrun --nproc_per_node=8 evolve.py --model_dir=... --index_dir=... --train_file=...

Left out: vLLM-speed generation, FSDP / tensor parallelism (ranks hold full weights),
asynchronous rollouts, learning-rate schedules beyond warm-up.
"""

import json
import os
import random
import shutil
import sys
import time

import torch
import torch.distributed as dist

import eval as EV
import grpo
import model as M
import ofsd as OF
import toyworld
from retriever import load_index
from rollout import rollout

# ---------------------------------------------------------------------------------------------
# config: plain constants, overridable as --key=value            (real scale: the anchor's value)
out_dir = "runs/toy"           # checkpoint, metrics.jsonl, results
world_dir = "cache/toyworld"   # the toy world and backbone, built here when missing
model_dir = ""                 # HF Qwen2 checkpoint; "" = the toy backbone    (Qwen2.5-3B-Instruct)
index_dir = ""                 # BM25 index; "" = the toy world's                (wiki-18 index)
train_file = ""                # FlashRAG questions; "" = toy train.jsonl       (NQ + HotpotQA train)
test_file = ""                 # "" = toy test.jsonl                            (the seven benchmarks)
test_limit = 0                 # evaluate on the first N test questions; 0 = all
iterations = 2                 # GRPO round + OFSD round pairs
grpo_steps = 25                # GRPO optimizer steps per round
questions_per_step = 16        # questions per GRPO step, over all ranks      (512)
group_size = 5                 # G rollouts per question                      (5)
micro_batch = 20               # trajectories per forward/backward            (memory-bound)
lr = 2e-4                      # GRPO AdamW learning rate                     (1e-6)
warmup_steps = 3               # linear warm-up of the GRPO learning rate
kl_coef = 0.001                # KL-to-reference coefficient (k3 estimator)   (0.001)
kl_ref = "round"               # KL reference: "round" = the policy this GRPO round started from
                               # (after an OFSD merge, so GRPO is not pulled back across the
                               # consolidation); "initial" = the starting model, as the anchor
clip_ratio = 0.2               # PPO clip epsilon                             (0.2)
max_grad_norm = 1.0            # gradient-norm clip                           (1.0)
temperature = 1.0              # rollout sampling temperature                 (1.0)
top_p = 1.0                    # rollout nucleus sampling                     (1.0; 0.95 in some versions)
max_turns = 4                  # searching turns before the answer-only turn  (4)
max_turn_tokens = 80           # per-turn response cap                        (500)
max_obs_tokens = 256           # observation cap                              (500)
top_k = 3                      # documents per search                         (3)
ofsd = True                    # False: the GRPO-only ablation (same GRPO steps, no OFSD rounds)
ofsd_questions = 64            # questions rolled out to mine pairs per OFSD round
lora_rank = 16                 # LoRA rank
lora_alpha = 32                # LoRA alpha
lora_lr = 2e-4                 # LoRA AdamW learning rate
lora_epochs = 2                # passes over the round's pairs
ofsd_micro_batch = 4           # pairs per OFSD optimizer step
tau_clip = 0.05                # clip on each (position, vocabulary) KL term
eval_batch = 64                # questions per greedy evaluation batch
seed = 0                       # sampling, question order, LoRA initialisation
world_seed = 0                 # the toy world and its backbone (rebuilt when world_dir holds
                               # another seed; seed 0 is the measured one: see README)
device = "auto"                # "auto": cuda if available, else cpu
dtype = "auto"                 # "auto": bfloat16 on cuda, float32 on cpu
resume = False                 # continue from out_dir/checkpoint
# ---------------------------------------------------------------------------------------------
config_keys = [k for k, v in list(globals().items()) if not k.startswith("_") and isinstance(v, (bool, int, float, str))]


def parse_overrides(argv):
    """--key=value for any config key (an int is accepted for a float); --resume alone means True."""
    out = {}
    for arg in argv:
        key, eq, val = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or key not in config_keys:
            raise SystemExit(f"unknown argument {arg!r}; keys: {', '.join(config_keys)}")
        old = globals()[key]
        if isinstance(old, bool):
            if val.lower() not in ("", "true", "1", "false", "0"):
                raise SystemExit(f"--{key} takes true/false, not {val!r}")
            out[key] = val.lower() in ("", "true", "1")
        else:
            try:
                out[key] = type(old)(val)  # int("1") for an int, float("1") for a float, str
            except ValueError:
                raise SystemExit(f"--{key}={val}: expected {type(old).__name__}") from None
    return out


if __name__ == "__main__":
    globals().update(parse_overrides(sys.argv[1:]))
    config = {k: globals()[k] for k in config_keys}

    # -----------------------------------------------------------------------------------------
    # setup: ranks, device, data, policy
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() and device != "cpu" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    master = rank == 0
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if dev == "cuda" and distributed:
        dev = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(dev)
    dt = getattr(torch, dtype) if dtype != "auto" else (torch.bfloat16 if dev.startswith("cuda") else torch.float32)

    if not (model_dir and index_dir and train_file and test_file):
        if master:
            toyworld.ensure(world_dir, world_seed)
        if distributed:
            dist.barrier()
    policy, tokenizer = M.load(model_dir or os.path.join(world_dir, "backbone"), dev, dt)
    index = load_index(index_dir or os.path.join(world_dir, "index"))
    train = EV.read_questions(train_file or os.path.join(world_dir, "train.jsonl"))
    test = EV.read_questions(test_file or os.path.join(world_dir, "test.jsonl"), test_limit)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)  # question order, identical on every rank
    gen = torch.Generator(device=dev).manual_seed(seed * 1000 + rank)  # rollout sampling, per rank
    torch.manual_seed(seed)  # LoRA initialisation
    ckpt_dir = os.path.join(out_dir, "checkpoint")
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    rounds = ["eval"] + [r for _ in range(iterations) for r in (("grpo", "ofsd") if ofsd else ("grpo",))]
    done, results, step = 0, [], 0  # finished rounds, evaluation rows, GRPO steps so far
    if resume and master and not os.path.exists(ckpt_dir) and os.path.exists(ckpt_dir + ".old"):
        os.replace(ckpt_dir + ".old", ckpt_dir)  # killed between the checkpoint's two renames
    if distributed:
        dist.barrier()
    if resume and os.path.exists(os.path.join(ckpt_dir, "state.json")):
        with open(os.path.join(ckpt_dir, "state.json")) as f:
            state = json.load(f)
        policy, tokenizer = M.load(os.path.join(ckpt_dir, "model"), dev, dt)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
        optimizer.load_state_dict(torch.load(os.path.join(ckpt_dir, "optimizer.pt"), weights_only=True))
        rng_state = torch.load(os.path.join(ckpt_dir, f"rng{rank}.pt"), weights_only=True)
        gen.set_state(rng_state["gen"])
        torch.set_rng_state(rng_state["torch"])
        rng.setstate((state["py_rng"][0], tuple(state["py_rng"][1]), state["py_rng"][2]))
        done, results, step = state["done"], state["results"], state["step"]
        if master:
            print(f"resumed from {ckpt_dir}: {done}/{len(rounds)} rounds done")
    elif master:
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir)
    reference = M.load(model_dir or os.path.join(world_dir, "backbone"), dev, dt)[0]  # kl_ref = "initial"
    rollout_args = dict(max_turns=max_turns, max_turn_tokens=max_turn_tokens, max_obs_tokens=max_obs_tokens,
                        top_k=top_k, temperature=temperature, top_p=top_p, generator=gen)

    def log(record):
        """One JSON line in metrics.jsonl (rank 0)."""
        if master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def sample_questions(n):
        """n training questions (same on every rank), then this rank's share."""
        qs = [train[rng.randrange(len(train))] for _ in range(n)]
        return qs[rank::world]

    def exact_match_rewards(trajs, qs):
        """R = EM of each trajectory's answer; trajectories are question-major, group_size each."""
        return [grpo.exact_match(t.answer, q["golden_answers"])
                for t, q in zip(trajs, (q for q in qs for _ in range(group_size)))]

    def check_ranks_identical():
        """Every rank must hold the same weights: compare a float64 checksum across ranks."""
        if not distributed:
            return True
        s = torch.stack([p.detach().double().sum() for p in policy.parameters()]).sum().reshape(1).to(dev)
        all_s = [torch.zeros_like(s) for _ in range(world)]
        dist.all_gather(all_s, s)
        return all(torch.equal(a, all_s[0]) for a in all_s)

    # -----------------------------------------------------------------------------------------
    # the rounds
    for r in range(done, len(rounds)):
        kind, it = rounds[r], (r - 1) // (2 if ofsd else 1)
        t_round = time.time()
        row = dict(round=r, after=kind, iteration=it)
        if kind == "grpo":
            # GRPO round: explore with outcome reward
            if kl_ref == "round":
                reference.load_state_dict(policy.state_dict())
            policy.train()
            for s in range(grpo_steps):
                t0 = time.time()
                qs = sample_questions(questions_per_step)
                with torch.no_grad():
                    trajs = rollout(policy, tokenizer, index, [q["question"] for q in qs], group_size, **rollout_args)
                rewards = exact_match_rewards(trajs, qs)
                adv = grpo.group_advantages(rewards, group_size).tolist()
                for g in optimizer.param_groups:
                    g["lr"] = lr * min(1.0, (step + 1) / warmup_steps)
                m = grpo.grpo_step(policy, reference, optimizer, trajs, adv, micro_batch=micro_batch,
                                   clip_ratio=clip_ratio, kl_coef=kl_coef, temperature=temperature,
                                   max_grad_norm=max_grad_norm, pad_id=tokenizer.pad_id)
                stats = torch.tensor([sum(rewards), sum(t.n_search for t in trajs), len(trajs)], device=dev)
                if distributed:
                    dist.all_reduce(stats)
                step += 1
                m.update(reward=(stats[0] / stats[2]).item(), searches=(stats[1] / stats[2]).item(),
                         seconds=time.time() - t0)
                log(dict(kind="grpo_step", iteration=it, step=step, **m))
                if master:
                    print(f"grpo | it {it} | step {step:4d} | reward {m['reward']:.3f} | loss {m['loss']:+.4f} | "
                          f"kl {m['kl']:.5f} | clip {m['clip_frac']:.3f} | searches {m['searches']:.2f} | "
                          f"tokens {m['tokens']:6d} | {m['seconds']:.1f}s", flush=True)
            policy.eval()
        elif kind == "ofsd":
            # OFSD round: consolidate, distilling the policy's best sibling into its other siblings
            qs = sample_questions(ofsd_questions)
            with torch.no_grad():
                trajs = rollout(policy, tokenizer, index, [q["question"] for q in qs], group_size, **rollout_args)
            rewards = exact_match_rewards(trajs, qs)
            pairs = OF.mine_pairs(trajs, rewards, group_size)
            if distributed:  # every rank runs the same round on all ranks' pairs (the round is cheap)
                gathered = [None] * world
                dist.all_gather_object(gathered, pairs)
                pairs = [p for ps in gathered for p in ps]

            def ofsd_log(epoch, n, loss):
                if master:
                    print(f"ofsd | it {it} | epoch {epoch} | step {n:4d} | loss {loss:.5f}", flush=True)

            m = OF.ofsd_round(policy, tokenizer, pairs, lora_rank=lora_rank, lora_alpha=lora_alpha,
                              lr=lora_lr, epochs=lora_epochs, micro_batch=ofsd_micro_batch, tau_clip=tau_clip,
                              max_grad_norm=max_grad_norm, seed=seed * 7919 + r, log=ofsd_log)
            if distributed:  # guard against non-deterministic kernels: rank 0's weights for all
                for p in policy.parameters():
                    dist.broadcast(p.data, 0)
            row.update(pairs=m["pairs"], incorrect_students=m["incorrect_students"],
                       kl_before=m.get("kl_before"), kl_after=m.get("kl_after"))
            log(dict(kind="ofsd_round", **row, losses=m["losses"]))
            if master:
                print(f"ofsd | it {it} | pairs {m['pairs']} ({m['incorrect_students']} with an incorrect student) | "
                      f"KL {m.get('kl_before', 0):.5f} -> {m.get('kl_after', 0):.5f}", flush=True)

        # evaluation after each round (rank 0), then the checkpoint
        row["ranks_identical"] = check_ranks_identical()
        if master:
            res = EV.evaluate(policy, tokenizer, index, test, batch=eval_batch, max_turns=max_turns,
                              max_turn_tokens=max_turn_tokens, max_obs_tokens=max_obs_tokens, top_k=top_k)
            row.update(summary=EV.summarize(res, "type"), grpo_steps=step, seconds=time.time() - t_round)
            results.append(row)
            log(dict(kind="eval", **row))
            s = row["summary"]
            print(f"eval | round {r} {kind} | EM {s['all']['em']:.3f} | " +
                  " | ".join(f"{k} {v['em']:.3f}" for k, v in s.items() if k != "all") +
                  f" | searches {s['all']['searches']:.2f} | format {s['all']['format']:.2f}" +
                  (f" | ranks identical {row['ranks_identical']}" if distributed else ""), flush=True)
            tmp = ckpt_dir + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            M.save(policy, tokenizer, os.path.join(tmp, "model"))
            torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
            py = rng.getstate()
            with open(os.path.join(tmp, "state.json"), "w") as f:
                json.dump(dict(done=r + 1, step=step, results=results, config=config,
                               py_rng=[py[0], list(py[1]), py[2]]), f)
        if distributed:
            dist.barrier()  # every rank saves its own RNG state into the same new checkpoint
        torch.save(dict(gen=gen.get_state(), torch=torch.get_rng_state()),
                   os.path.join(ckpt_dir + ".tmp", f"rng{rank}.pt"))
        if distributed:
            dist.barrier()
        if master:
            if os.path.exists(ckpt_dir):
                os.replace(ckpt_dir, ckpt_dir + ".old")
            os.replace(ckpt_dir + ".tmp", ckpt_dir)
            shutil.rmtree(ckpt_dir + ".old", ignore_errors=True)
        if distributed:
            dist.barrier()

    # -----------------------------------------------------------------------------------------
    # results: one row per round
    if master:
        types = [k for k in results[0]["summary"] if k != "all"]
        lines = ["| round | after | GRPO steps | EM | " + " | ".join(types) + " | searches/q | format |",
                 "|---|---|---|---|" + "---|" * len(types) + "---|---|"]
        for row in results:
            s = row["summary"]
            lines.append(f"| {row['round']} | {row['after'] if row['after'] != 'eval' else 'start'} "
                         f"(it {max(row['iteration'], 0)}) | {row['grpo_steps']} | {s['all']['em']:.3f} | " +
                         " | ".join(f"{s[t]['em']:.3f}" for t in types) +
                         f" | {s['all']['searches']:.2f} | {s['all']['format']:.2f} |")
        table = "\n".join(lines)
        print("\n" + table)
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write(table + "\n")
    if distributed:
        dist.destroy_process_group()
