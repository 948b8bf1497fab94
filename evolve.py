"""Search-E1: alternate GRPO rounds (explore) with OFSD rounds (consolidate). The main job.

    evaluate the starting policy; checkpoint
    for it in range(iterations):
        GRPO round (grpo.py): grpo_steps updates on fresh rollouts, G a question; reward = exact
                   match; PPO-clip loss + KL to the round's starting policy.  Evaluate; checkpoint
        OFSD round (ofsd.py): fresh rollouts -> one (tau_ref, tau_stu) pair a question -> LoRA
                   distillation of the teacher view (tau_ref in context, adapter off) into the
                   student view -> merge.  Evaluate; checkpoint
    print the results table, one row an evaluation

METHOD.md is the method and where this code departs from Search-R1. With no arguments it trains on the
toy world (worlds/); any constant below is overridable as --key=value (real scale: docs/real-scale.md).

    python evolve.py                                   # the toy world, CPU, minutes
    python evolve.py --ofsd_rounds=false --out_dir=runs/grpo   # the GRPO-only ablation
    torchrun --nproc_per_node=8 evolve.py --model_dir=... --index_dir=... --train_file=...

Left out: vLLM-speed generation, tensor parallelism, CPU offload, asynchronous rollouts.
"""

import os
import random
import sys
import time

import torch

import checkpoint
import configurator
from eval import curves_svg, eval_line, evaluate, grpo_line, ofsd_line, peak_line, results_table, summarize
import fsdp
import grpo
import lora
from model import Qwen2Config
import ofsd
from rollout import RolloutConfig
import teacher_gap
import worlds
from worlds import toyagent

# ---------------------------------------------------------------------------------------------
# config: plain constants, overridable as --key=value            (real scale: the anchor's value)
out_dir = "runs/toy"           # checkpoint, metrics.jsonl, results
world_dir = "cache/toyworld"   # the toy world and its backbone, written here when missing
model_dir = ""                 # HF Qwen2 checkpoint or policy folder; "" = the toy backbone  (Qwen2.5-3B-Instruct)
index_dir = ""                 # BM25 index; "" = the toy world's               (wiki-18 index)
train_file = ""                # FlashRAG questions; "" = toy train.jsonl      (NQ + HotpotQA train)
test_file = ""                 # "" = toy test.jsonl                           (the seven benchmarks)
test_limit = 0                 # evaluate on the first N test questions; 0 = all
iterations = 2                 # GRPO round + OFSD round pairs
grpo_steps = 12                # GRPO optimizer steps per round (the toy's test EM levels off by ~12)
questions_per_step = 16        # questions rolled out per GRPO step, over all ranks       (512)
ppo_mini_batch = 8             # questions per update: questions_per_step // ppo_mini_batch updates a step  (51)
group_size = 5                 # G rollouts per question                       (5)
micro_batch = 20               # trajectories per forward/backward             (memory-bound)
lr = 2e-4                      # GRPO AdamW learning rate                      (1e-6)
grpo_lora_rank = 0             # 0: GRPO trains every weight; r > 0: a fresh rank-r LoRA adapter a round, merged
grpo_lora_alpha = 32           # that adapter's alpha
grpo_lora_lr = 2e-3            # that adapter's AdamW learning rate (LoRA wants ~10x full fine-tuning's)
warmup_steps = 3               # linear warm-up of the GRPO learning rate (0.285 of the run's steps)
kl_coef = 0.001                # KL-term coefficient beta (k3 estimator)      (0.001)
entropy_coef = 0.001           # entropy bonus: loss -= entropy_coef * token-mean entropy   (0.001)
kl_policy = "round"            # the KL term's model: "round" the round's start, "initial" the start model (the anchor's)
clip_ratio = 0.2               # PPO clip epsilon                              (0.2)
max_grad_norm = 1.0            # gradient-norm clip                            (1.0)
temperature = 1.0              # rollout sampling temperature                  (1.0)
top_p = 1.0                    # rollout nucleus sampling                      (0.95)
max_turns = 4                  # searching turns before the answer-only turn   (2; toy three-hop questions need 3+)
max_turn_tokens = 80           # per-turn response cap                         (500)
max_obs_tokens = 256           # observation cap                               (500)
top_k = 3                      # documents per search                          (3)
search_workers = 1             # BM25 worker processes per rank for a turn's searches (8+ at wiki-18 scale)
rollout_rows = 0               # trajectories decoded at once per rank (the KV cache); 0 = all  (64 at 3B/7B)
compile = False                # decoding steps through torch.compile (one process on CUDA: CUDA graphs)
ofsd_rounds = True             # False: the GRPO-only ablation (same GRPO steps, no OFSD rounds)
ofsd_questions = 64            # questions rolled out to mine pairs per OFSD round
ofsd_students = "any"          # "any": the paper's rule (else a correct sibling); "incorrect": only incorrect students
ofsd_loss = "kl"               # "kl": the teacher view's clipped forward KL (the paper's); "nll": tau_ref's NLL (rft); "nll_kl"
ofsd_kl_weight = 1.0           # the KL's weight beside the NLL in "nll_kl"
lora_rank = 16                 # OFSD's LoRA rank
lora_alpha = 32                # OFSD's LoRA alpha
lora_lr = 2e-4                 # OFSD's LoRA AdamW learning rate
lora_epochs = 2                # passes over the round's pairs
ofsd_micro_batch = 4           # pairs per OFSD optimizer step
tau_clip = 0.05                # the OFSD loss's clip threshold
ofsd_clip = "vocab"            # what tau_clip caps: "vocab" each term (the paper's), "position" each position, "none"
ofsd_context = "full"          # the teacher's view of tau_ref: "full" (the paper's), "no_answer", "queries", "group_queries"
ofsd_positions = "policy"      # where the OFSD loss counts: "policy" every sampled token (the paper's), "queries"
kl_chunk = 256                 # positions per LM-head chunk of the OFSD loss (memory, not results)
eval_batch = 64                # questions per greedy evaluation batch
seed = 0                       # sampling, question order, LoRA initialisation
world_seed = 0                 # the toy world; seed 0's backbone is shipped, another's is built (~4.5 min)
device = "auto"                # "auto": cuda:0 (cuda:LOCAL_RANK under torchrun) if available, else cpu
dtype = "auto"                 # compute dtype ("auto": bfloat16 on CUDA and native-bf16 CPUs for a real model)
activation_checkpointing = False  # recompute each decoder layer in backward: less memory (True at 3B/7B)
resume = False                 # continue from out_dir/checkpoint (the same settings; see RESUME_MAY_CHANGE)
overwrite = False              # a fresh run may replace an earlier run's files in out_dir (never others)
# ---------------------------------------------------------------------------------------------
DEFAULTS = configurator.settings(globals())  # as written above: main() rewrites the globals, not this
config_keys = list(DEFAULTS)


def main():
    globals().update(configurator.parse(sys.argv[1:], DEFAULTS, __file__, __doc__))  # --key=value, typed by the defaults
    config = {k: globals()[k] for k in config_keys}
    configurator.check_evolve(config)  # every setting, before anything is written
    width = Qwen2Config.from_json(os.path.join(lora.base_dir(model_dir), "config.json")).hidden_size if model_dir else \
        toyagent.BACKBONE["hidden_size"]  # decides "auto"'s dtype on CPU (fsdp.device_and_dtype)
    rank, world_size, dev, dt = fsdp.setup(device, dtype, width, masters=not grpo_lora_rank)
    run = checkpoint.Run(out_dir, config, rank, world_size, RESUME_MAY_CHANGE)  # refuses a bad out_dir or resume
    configurator.check_ranks(config, world_size, questions_per_step // ppo_mini_batch)
    configurator.check_compile(compile, dev, world_size)
    checkpoint.barrier()  # every rank has checked before any rank writes

    # -----------------------------------------------------------------------------------------
    # setup: data, the policy, its optimizer, random state (or all of it from a checkpoint)
    start_model, index, train, test, tokenizer = worlds.load(model_dir, index_dir, train_file, test_file, test_limit,
                                                             world_dir, world_seed, top_k, rank)
    configurator.check_context(config, Qwen2Config.from_json(os.path.join(lora.base_dir(start_model), "config.json")),
                               tokenizer, max((q["question"] for q in train + test), key=len))
    rng = random.Random(seed)  # question order, identical on every rank
    # rollout sampling: one stream a rank (seeds apart up to 1,000 ranks)
    gen = torch.Generator(device=dev).manual_seed(seed * 1000 + rank)
    torch.manual_seed(seed)  # LoRA initialisation (checkpointed: exact resume)
    # as this process holds it: FSDP2 over float32 masters in a process group, else in dt (fsdp.wrap)
    policy = fsdp.wrap(run.load_policy(start_model, dev, fsdp.held_dtype(dt), lora_chain=grpo_lora_rank > 0), dt)
    policy.checkpoint_layers = activation_checkpointing
    # full fine-tuning's AdamW, kept across rounds (a LoRA run makes one a round)
    optimizer = None if grpo_lora_rank else torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    run.restore(policy, optimizer, rng, gen)
    kl = KLModel(start_model, dev, dt)  # the KL term's model
    # the settings each round takes, as one group each
    sampling = configurator.group(RolloutConfig, config)
    grpo_cfg = configurator.group(grpo.GRPOConfig, config, rollout=sampling, lr=grpo_lora_lr if grpo_lora_rank else lr)
    ofsd_cfg = configurator.group(ofsd.OFSDConfig, config)

    def sample_questions(n):  # n training questions (the same on every rank), then this rank's share
        return [train[rng.randrange(len(train))] for _ in range(n)][rank::world_size]

    # -----------------------------------------------------------------------------------------
    # the rounds: start, then (GRPO, OFSD) per iteration; each is evaluated and checkpointed
    rounds = ("grpo", "ofsd") if ofsd_rounds else ("grpo",)
    schedule = [("start", 0)] + [(kind, it) for it in range(iterations) for kind in rounds]
    for r in range(run.state["done"], len(schedule)):
        kind, it = schedule[r]
        t0, row = time.time(), dict(round=r, after=kind, iteration=it)
        if kind == "grpo":
            adapter, round_optimizer = kl.begin_grpo_round(policy, optimizer)
            grpo.grpo_round(policy, kl.model, round_optimizer, tokenizer, index,
                            lambda: sample_questions(questions_per_step), grpo_cfg, gen, run.state["step"],
                            log=lambda m: run.record(dict(kind="grpo_step", iteration=it, **m,  # what each rank holds:
                                                          state_bytes=fsdp.state_bytes(policy, round_optimizer, kl.model)),
                                                     grpo_line(m, it)))
            run.state["step"] += grpo_steps
            if adapter is not None:  # saved in the run's chain, merged
                run.merge(policy, adapter, f"{r:02d}-grpo")
        elif kind == "ofsd":
            kl.model = None  # the round needs neither, nor AdamW's moments
            with fsdp.parked(optimizer, os.path.join(run.ckpt_dir, f"parked-optimizer{rank}.pt")):
                row.update(ofsd_round(policy, tokenizer, index, sample_questions(ofsd_questions), run, r, it,
                                      sampling, ofsd_cfg, gen))
        with fsdp.gathered(policy):  # each rank its share, weights gathered once
            results = evaluate(policy, tokenizer, index, test[rank::world_size], sampling, eval_batch)
        row.update(summary=summarize(fsdp.all_ranks(results), "type"), grpo_steps=run.state["step"],
                   seconds=time.time() - t0)
        run.state["results"].append(row)
        run.record(dict(kind="eval", **row), eval_line(row))
        if rank == 0:
            checkpoint.write_atomic(os.path.join(out_dir, "curves.svg"), curves_svg({out_dir: [run.state["results"]]}))
        run.save(policy, tokenizer, optimizer, rng, gen)

    if rank == 0:
        table = results_table(run.state["results"])
        print("\n" + table + "\n" + peak_line())
        checkpoint.write_atomic(os.path.join(out_dir, "results.md"), table + "\n")
    fsdp.teardown()


# ---------------------------------------------------------------------------------------------
# the steps main() names: the KL term's model, an OFSD round

class KLModel:
    """The GRPO KL term's model: full fine-tuning's second copy (kl_policy's weights, loaded when a round
    needs it, let go for an OFSD round), or None through LoRA (the policy with its adapter off)."""

    def __init__(self, start_model, device, compute_dtype):
        self.start_model, self.device, self.compute_dtype, self.model = start_model, device, compute_dtype, None

    def begin_grpo_round(self, policy, optimizer):
        """(the round's LoRA adapter or None, the round's optimizer), the KL model ready."""
        if grpo_lora_rank:  # a fresh adapter, the same on every rank
            adapter = lora.attach(policy, grpo_lora_rank, grpo_lora_alpha)
            fsdp.sum_grads(adapter)
            return adapter, torch.optim.AdamW(adapter, lr=grpo_lora_lr, weight_decay=0.0)
        if self.model is None:  # the first round, or one after an OFSD round
            dt = self.compute_dtype
            self.model = fsdp.wrap(lora.load_policy(self.start_model, self.device, fsdp.held_dtype(dt))[0], dt)
        if kl_policy == "round":
            fsdp.copy_weights(self.model, policy)
        return None, optimizer


def ofsd_round(policy, tokenizer, index, questions, run, r, it, sampling, cfg, gen):
    """Mine pairs on every rank, measure the teacher's headroom, distil and merge, measure again."""
    run.record(None, f"ofsd | it {it} | mining {ofsd_questions} questions x {group_size}")
    pairs = fsdp.all_ranks(ofsd.mine_round(policy, tokenizer, index, questions, group_size, sampling, gen,
                                           ofsd_students))  # every rank distils every pair
    gap = teacher_gap.before_round(policy, tokenizer, index, pairs, sampling, kl_chunk, ofsd_context)
    m = ofsd.distill(policy, tokenizer, pairs, cfg, seed=seed * 7919 + r,  # the pairs' order, per seed and round
                     log=lambda epoch, n, loss: run.record(None, f"ofsd | it {it} | epoch {epoch} | step {n:4d} | "
                                                                 f"loss {loss:.5f}"),
                     merge=lambda params: run.merge(policy, params, f"{r:02d}-ofsd"))
    m.update(gap, **teacher_gap.after_round(policy, tokenizer, index, pairs, sampling))
    row = dict(round=r, after="ofsd", iteration=it, **{k: v for k, v in m.items() if k != "losses"})
    run.record(dict(kind="ofsd_round", **row, losses=m["losses"]), ofsd_line(row, m))
    return {k: v for k, v in m.items() if k != "losses"}  # counts, KL, diagnostics


RESUME_MAY_CHANGE = ("resume", "overwrite", "out_dir", "world_dir", "iterations", "eval_batch", "micro_batch",
                     "kl_chunk", "activation_checkpointing", "rollout_rows", "search_workers", "compile")  # paths, length, speed, memory


if __name__ == "__main__":
    main()
