"""Search-E1: alternate GRPO rounds (explore) with OFSD rounds (consolidate). The main job.

    evaluate the starting policy; checkpoint
    for it in range(iterations):
        GRPO round (grpo.py): grpo_steps updates on fresh rollouts, G a question; reward = exact
                   match; PPO-clip loss + KL to the round's starting policy (with --credit_lambda,
                   each token's advantage weighed by the teacher view: credit.py).  Evaluate; checkpoint
        OFSD round (ofsd.py): fresh rollouts -> one (tau_ref, tau_stu) pair a question -> LoRA
                   distillation of the teacher view (tau_ref in context, adapter off) into the
                   student view -> merge.  Evaluate; checkpoint
    print the results table, one row an evaluation; tokens.html shows where the teacher disagrees

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
import credit
from eval import (credit_sections, curves_svg, eval_line, evaluate, grpo_line, ofsd_line, peak_line, results_table,
                  summarize, token_page, token_section)
import fsdp
import grpo
import lora
from model import Qwen2Config
import ofsd
from rollout import RolloutConfig, make_prompt, max_response_tokens
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
lr = 2e-4                      # GRPO AdamW learning rate (full fine-tuning)   (1e-6)
grpo_lora_rank = 0             # 0: GRPO trains every weight; r > 0: a fresh rank-r LoRA adapter a round, merged
grpo_lora_alpha = 32           # that adapter's alpha
grpo_lora_lr = 2e-3            # that adapter's AdamW learning rate (LoRA wants ~10x full fine-tuning's)
warmup_steps = 3               # linear warm-up of the GRPO learning rate; 0 = none (0.285 of the run's steps)
kl_coef = 0.001                # KL-term coefficient beta (k3 estimator)      (0.001)
entropy_coef = 0.001           # entropy bonus: loss -= entropy_coef * token-mean entropy   (0.001)
credit_lambda = 0.0            # the teacher's token credit inside GRPO (credit.py, RLSD): lambda at step 1; 0 = off
credit_eps = 0.2               # its bound: each token's weight w in [1 - eps, 1 + eps]   (RLSD: 0.2)
credit_decay_steps = 50        # lambda falls linearly to 0 over these GRPO steps; 0 = constant   (RLSD: 50)
credit_context = "full"        # what the credit's teacher sees of the group's tau_ref (as --ofsd_context)
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
ofsd_lora_rank = 16            # OFSD's LoRA rank
ofsd_lora_alpha = 32           # OFSD's LoRA alpha
ofsd_lora_lr = 2e-4            # OFSD's LoRA AdamW learning rate
ofsd_epochs = 2                # passes over the round's pairs
ofsd_pairs_per_step = 4        # pairs per OFSD optimizer step (and per teacher or measuring pass)
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
RENAMED = dict(lora_rank="ofsd_lora_rank", lora_alpha="ofsd_lora_alpha", lora_lr="ofsd_lora_lr",
               lora_epochs="ofsd_epochs", ofsd_micro_batch="ofsd_pairs_per_step")  # old --key: refused with its new name
RESUME_MAY_CHANGE = ("resume", "overwrite", "out_dir", "world_dir", "iterations", "eval_batch", "micro_batch",
                     "kl_chunk", "activation_checkpointing", "rollout_rows", "search_workers", "compile")  # paths, length, speed, memory


def main():
    # config: the constants above, --key=value over them; each settings group checks its own
    globals().update(configurator.parse(sys.argv[1:], DEFAULTS, __file__, __doc__, RENAMED))
    config = {k: globals()[k] for k in config_keys}
    sampling, grpo_cfg, ofsd_cfg = settings_groups(config)

    # setup: ranks and device, the run's folder, data, the policy (or all of it from a checkpoint)
    rank, world_size, dev, dt = fsdp.setup(device, dtype, hidden_size(model_dir), masters=not grpo_lora_rank)
    run = checkpoint.Run(out_dir, config, rank, world_size, RESUME_MAY_CHANGE)  # refuses a bad out_dir or resume
    fsdp.check_ranks(questions_per_step, grpo_cfg.ppo_updates, ofsd_questions, world_size)
    fsdp.check_compile(compile, dev, world_size)
    checkpoint.barrier()  # every rank has checked before any rank writes
    start_model, index, train, test, tokenizer = worlds.load(model_dir, index_dir, train_file, test_file, test_limit,
                                                             world_dir, world_seed, top_k, rank)
    check_context(model_config(start_model).max_position_embeddings, tokenizer, train + test, sampling, group_size,
                  ofsd_context if ofsd_rounds else None)
    rng, gen = random.Random(seed), torch.Generator(device=dev).manual_seed(seed * 1000 + rank)  # questions; sampling
    torch.manual_seed(seed)  # LoRA initialisation (checkpointed: exact resume)
    policy = fsdp.wrap(run.load_policy(start_model, dev, fsdp.held_dtype(dt), lora_chain=grpo_lora_rank > 0), dt)
    policy.checkpoint_layers = activation_checkpointing
    optimizer = None if grpo_lora_rank else torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)  # kept (full FT)
    run.restore(policy, optimizer, rng, gen)

    def sample_questions(n):  # n training questions (the same on every rank), then this rank's share
        return [train[rng.randrange(len(train))] for _ in range(n)][rank::world_size]

    # the rounds: start, then (GRPO, OFSD) per iteration; each is evaluated and checkpointed
    schedule = [("start", 0)] + [(kind, it) for it in range(iterations) for kind in ("grpo", "ofsd")[:1 + ofsd_rounds]]
    for r in range(run.state["done"], len(schedule)):
        kind, it = schedule[r]
        t0, row = time.time(), dict(round=r, after=kind, iteration=it)
        if kind == "grpo":
            kl_model = kl_term_model(policy, start_model, dev, dt, grpo_cfg)  # None through LoRA: the adapter off
            adapter, round_optimizer = grpo_adapter(policy, optimizer, grpo_cfg)  # LoRA: a fresh adapter, its AdamW
            steps = [sample_questions(questions_per_step) for _ in range(grpo_steps)]
            for m in grpo_round(policy, kl_model, round_optimizer, tokenizer, index, steps, grpo_cfg, gen,
                                run.state["step"], run.state["pages"]):
                run.record(dict(kind="grpo_step", iteration=it, **m), grpo_line(m, it))
            run.state["step"] += grpo_steps
            if adapter is not None:  # saved in the run's chain, merged
                row["replica_drift"] = run.merge(policy, adapter, f"{r:02d}-grpo")  # 0.0: one adapter on every rank
            del kl_model  # a second copy of the weights: not kept through the evaluation or an OFSD round
        elif kind == "ofsd":
            row.update(ofsd_round(policy, tokenizer, index, sample_questions(ofsd_questions), ofsd_cfg, gen, run, r,
                                  it, seed * 7919 + r))  # the pairs' order, per seed and round
        results = evaluate(policy, tokenizer, index, test[rank::world_size], sampling, eval_batch)  # this rank's share
        row.update(summary=summarize(fsdp.all_ranks(results), "type"), grpo_steps=run.state["step"],
                   seconds=time.time() - t0)
        run.state["results"].append(row)
        run.record(dict(kind="eval", **row), eval_line(row))
        if rank == 0:  # the chart, and where the teacher disagrees token by token
            checkpoint.write_atomic(os.path.join(out_dir, "curves.svg"), curves_svg({out_dir: [run.state["results"]]}))
            checkpoint.write_atomic(os.path.join(out_dir, "tokens.html"), token_page(run.state["pages"]))
        run.save(policy, tokenizer, optimizer, rng, gen)

    if rank == 0:
        table = results_table(run.state["results"])
        print("\n" + table + "\n" + peak_line())
        checkpoint.write_atomic(os.path.join(out_dir, "results.md"), table + "\n")
    fsdp.teardown()


# ---------------------------------------------------------------------------------------------
# the steps main() names: settings, the KL term's model, a GRPO round's adapter, the rounds

def settings_groups(config):
    """(RolloutConfig, GRPOConfig, OFSDConfig) from the settings, each checked by its class, after the
    loop's own settings: refused, naming the key, before anything is written."""
    bad = configurator.check(config, positive=("eval_batch",), not_negative=("iterations", "test_limit", "seed",
                                                                             "world_seed"),
                             choices=dict(dtype=("auto", "float32", "bfloat16")),
                             dirs=("model_dir", "index_dir"), files=("train_file", "test_file"))
    if config["grpo_lora_rank"] and config["kl_policy"] == "initial" and config["iterations"] > 1:
        bad.append(f"--kl_policy=initial with --grpo_lora_rank={config['grpo_lora_rank']}: a LoRA round's KL model "
                   "is the policy with its adapter off, the round's own start; after the first round's merge the "
                   "initial model is gone (use --kl_policy=round, or --iterations=1)")
    if not (config["device"] in ("auto", "cpu", "cuda") or config["device"].startswith("cuda:")):
        bad.append(f"--device={config['device']!r}: must be auto, cpu, cuda or cuda:N")
    configurator.refuse(bad)
    sampling = configurator.group(RolloutConfig, config)
    return sampling, configurator.group(grpo.GRPOConfig, config, rollout=sampling), \
        configurator.group(ofsd.OFSDConfig, config, rollout=sampling)


def hidden_size(model_dir):
    """The policy's width, read before it is loaded: it decides "auto"'s dtype on a CPU (fsdp.device_and_dtype)."""
    return model_config(model_dir).hidden_size if model_dir else toyagent.BACKBONE["hidden_size"]


def model_config(path):
    """The Qwen2Config of a checkpoint or policy folder (its base's)."""
    return Qwen2Config.from_json(os.path.join(checkpoint.base_dir(path), "config.json"))


def check_context(limit, tokenizer, questions, sampling, group_size, ofsd_context):
    """A trajectory must fit the model's context of `limit` tokens: the longest question's prompt, then
    its response (rollout.max_response_tokens: the KV cache holds all of it); OFSD's teacher view
    (ofsd_context, None without OFSD rounds) also holds the privileged text (ofsd.max_context_tokens).
    Refused before any weights or caches are allocated."""
    longest_question = max((q["question"] for q in questions), key=len)
    prompt = len(tokenizer.encode(tokenizer.chat_prompt(make_prompt(longest_question))))
    response = max_response_tokens(tokenizer, sampling)
    extra = ofsd.max_context_tokens(tokenizer, ofsd_context, response, group_size) if ofsd_context else 0
    if prompt + extra + response > limit:
        view = f"teacher view ({ofsd_context})" if ofsd_context else "trajectory"
        raise SystemExit(
            f"bad settings, nothing was written:\n  a {view} may reach {prompt + extra + response:,} tokens (a prompt "
            f"of {prompt}{f', a privileged context of up to {extra:,}' if extra else ''} and a response of up to "
            f"{response:,}: --max_turns={sampling.max_turns} searching turns and the answer-only turn of "
            f"--max_turn_tokens={sampling.max_turn_tokens} + 1, and --max_turns observations of --max_obs_tokens="
            f"{sampling.max_obs_tokens}), over the model's context of {limit:,} (max_position_embeddings)")


def kl_term_model(policy, start_model, device, compute_dtype, cfg):
    """The GRPO KL term's model for a round: through LoRA None (the policy with its adapter off); in
    full fine-tuning a second copy, the start model's weights (kl_policy "initial") or the policy's
    as the round starts ("round")."""
    if cfg.grpo_lora_rank:
        return None
    model = fsdp.wrap(checkpoint.load_policy(start_model, device, fsdp.held_dtype(compute_dtype))[0], compute_dtype)
    if cfg.kl_policy == "round":
        fsdp.copy_weights(model, policy)
    return model


def grpo_adapter(policy, optimizer, cfg):
    """(the round's LoRA adapter, its AdamW) through LoRA: fresh, the same on every rank, its gradient
    summed over the ranks; in full fine-tuning (None, the run's optimizer)."""
    if not cfg.grpo_lora_rank:
        return None, optimizer
    adapter = lora.attach(policy, cfg.grpo_lora_rank, cfg.grpo_lora_alpha)
    fsdp.replicate(adapter)
    fsdp.sum_grads(adapter)
    return adapter, torch.optim.AdamW(adapter, lr=cfg.grpo_lora_lr, weight_decay=0.0)


def grpo_round(policy, kl_model, optimizer, tokenizer, index, questions, cfg, gen, first_step, pages=None):
    """The GRPO round (grpo.py), a step for each of this rank's `questions` lists: the rollouts, then the
    updates, each a token mean over its tokens on every rank (summed here). Yields each step's metrics,
    with what each rank holds. With the credit on, the first step with groups of both outcomes gives two
    of them to `pages` (eval.token_section's, tagged with the round) for the run's tokens.html."""
    for s, step_questions in enumerate(questions):
        t0 = time.time()
        batch = grpo.explore(policy, tokenizer, index, step_questions, cfg, gen)
        rollout_seconds = time.time() - t0
        if batch.weights is not None and pages is not None and not any(p["round"] == first_step for p in pages):
            pages += [dict(x, round=first_step) for x in credit_sections(tokenizer, batch, cfg.group_size, cfg.credit_eps, first_step + s + 1)]
        n_tokens = fsdp.all_sum(batch.token_counts().to(gen.device))  # (ppo_updates,) over every rank
        done = grpo.update(policy, kl_model, optimizer, batch, n_tokens, cfg, first_step + s + 1, tokenizer.pad_id)
        m = grpo.step_metrics(done, fsdp.all_sum(done["loss_sums"]), fsdp.all_sum(done["rollout_sums"].to(gen.device)),
                              n_tokens)
        yield dict(m, seconds=time.time() - t0, rollout_seconds=rollout_seconds,
                   state_bytes=fsdp.state_bytes(policy, optimizer, kl_model))


def ofsd_round(policy, tokenizer, index, questions, cfg, gen, run, r, it, order_seed):
    """Mine pairs on every rank, measure the teacher's headroom, distil into a fresh adapter and merge
    it, measure again; GRPO's optimizer state waits on disk meanwhile (run.parked)."""
    with run.parked():
        run.record(None, f"ofsd | it {it} | mining {cfg.ofsd_questions} questions x {cfg.group_size}")
        pairs = fsdp.all_ranks(ofsd.mine_round(policy, tokenizer, index, questions, cfg, gen))  # every rank: all
        gap = teacher_gap.before_round(policy, tokenizer, index, pairs, cfg.rollout, cfg.kl_chunk, cfg.ofsd_context)
        shown = pairs[:3]  # tokens.html: tau_stu, teacher log p - student log p, before the round trains
        gaps = credit.view_logprobs(policy, tokenizer, [p.stu for p in shown], [ofsd.privileged(tokenizer, p,
                                    cfg.ofsd_context) for p in shown], 1.0, cfg.ofsd_pairs_per_step)
        run.state["pages"] += [dict(token_section(tokenizer, f"OFSD round {r}: tau_stu, log p_T - log p_S", [
            (f"tau_stu ({'incorrect' if p.incorrect else 'correct'})", p.stu, (lt - ls).tolist())
            for p, (lt, ls) in zip(shown, gaps)], 2.0, "blue: the teacher view gives the token more probability "
            "than the student view, red: less (scale +-2 nats)"), round=f"ofsd {r}")] if shown else []
        m = distill_round(policy, tokenizer, pairs, cfg, order_seed, lambda p, a: run.merge(p, a, f"{r:02d}-ofsd"))
        for n, (epoch, loss) in enumerate(zip(m.pop("epochs", []), m["losses"]), 1):
            run.record(None, f"ofsd | it {it} | epoch {epoch} | step {n:4d} | loss {loss:.5f}")
        m.update(gap, **teacher_gap.after_round(policy, tokenizer, index, pairs, cfg.rollout))
    row = dict(round=r, after="ofsd", iteration=it, **{k: v for k, v in m.items() if k != "losses"})
    run.record(dict(kind="ofsd_round", **row, losses=m["losses"]), ofsd_line(row, m))
    return {k: v for k, v in m.items() if k != "losses"}  # counts, KL, diagnostics


def distill_round(policy, tokenizer, pairs, cfg, seed, merge=checkpoint.merge_adapter):
    """An OFSD round's training: both views of each pair and the teacher's states (ofsd.prepare), a
    fresh adapter (rank 0's initialisation on every rank) distilled on them (ofsd.distill, in an order
    `seed` shuffles), then `merge(policy, adapter)` (a run's also saves it in its chain). Returns the
    round's metrics, each step's epoch and loss, and how far the adapter's replicas had drifted."""
    lesson = ofsd.prepare(policy, tokenizer, pairs, cfg)
    if not lesson.data:  # no usable pair: nothing to train
        return dict(lesson.metrics)
    adapter = lora.attach(policy, cfg.ofsd_lora_rank, cfg.ofsd_lora_alpha)
    fsdp.replicate(adapter)
    m = ofsd.distill(policy, adapter, tokenizer, lesson, cfg, seed)
    m["replica_drift"] = merge(policy, adapter)
    return m


if __name__ == "__main__":
    main()
