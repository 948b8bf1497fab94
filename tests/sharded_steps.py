"""Worker for test_fsdp.py: GRPO steps and an OFSD round on fixed trajectories and pairs.

    python tests/sharded_steps.py MODEL_DIR OUT.pt [float32|float64|bfloat16|checkpointing]       # 1 process
    torchrun --nproc_per_node=2 tests/sharded_steps.py MODEL_DIR OUT.pt [float32|float64|bfloat16]

Every process builds the same 12 trajectories (4 questions x G=3) from the checkpoint's own
tokenizer, with recorded log-probs a little off the model's (so the PPO clip acts); rank r takes
questions r, r + N, ... for each GRPO step; the OFSD round distils 4 fixed pairs. Rank 0 saves
the step metrics, the OFSD losses, every rank's state_bytes and the full weights after each
phase to OUT.pt; the OFSD round runs once per clip mode, one after the other; then two GRPO
steps through a LoRA adapter.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint  # noqa: E402
import evolve  # noqa: E402
import fsdp  # noqa: E402
import grpo  # noqa: E402
from model import load  # noqa: E402
import lora  # noqa: E402
import ofsd  # noqa: E402
from clipped_kl import CLIPS  # noqa: E402
from conftest import settings  # noqa: E402
from model import token_logprobs  # noqa: E402
from rollout import pad_batch  # noqa: E402
from rollout import Trajectory, make_prompt  # noqa: E402

QUESTIONS = ["which river flows through Paris", "who founded Tokyo", "which lake is near London",
             "when was Ada Lovelace born"]
G = 3


def trajectories(model, tokenizer, shift):
    """12 trajectories: prompt, then sampled / injected / sampled spans of seeded random tokens."""
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for q in QUESTIONS:
        prompt = tokenizer.encode(tokenizer.chat_prompt(make_prompt(q)))
        for _ in range(G):
            t = Trajectory(q, len(prompt))
            t.add(prompt, sampled=False)
            n1, n2, n3 = torch.randint(4, 16, (3,), generator=gen).tolist()
            for n, sampled in ((n1, True), (n2, False), (n3, True)):
                t.add(torch.randint(3, 300, (n,), generator=gen).tolist(), sampled=sampled)
            trajs.append(t)
    for t in trajs:  # recorded log-probs: the model's own, shifted by up to +-shift
        ids, valid, mask, _ = pad_batch([t], tokenizer.pad_id, "cpu")
        with torch.no_grad():
            lp = token_logprobs(model, ids, valid, mask, 1.0)
        lp = lp + shift * (2 * torch.rand(lp.shape, generator=gen) - 1)
        it = iter(lp.tolist())
        t.logprobs = [next(it) if m else 0.0 for m in t.loss_mask]
    return trajs


def plain_step(model, dtype, trajs, advantages, pad_id):
    """The first GRPO step's loss (the policy is its own KL model) and its gradient on
    an unsharded copy of `model`, in one pass over `trajs`: loss, grads, and per policy token its
    log-prob, entropy and advantage (n,). On a bfloat16 copy, this is what rounding alone does."""
    model = copy.deepcopy(model).to(dtype)
    ids, valid, mask, old = pad_batch(trajs, pad_id, "cpu")
    adv = torch.tensor(advantages)[:, None].expand_as(mask)[:, 1:][mask[:, 1:]]  # (n,)
    logp, entropy = token_logprobs(model, ids, valid, mask, 1.0, entropy=True)
    old = old[:, 1:][mask[:, 1:]]  # (n,) the recorded log-probs: pi_old
    loss = grpo.grpo_token_loss(logp, old, logp.detach(), adv, 0.2, 0.01, entropy, 0.01)[0].mean()
    loss.backward()
    return dict(loss=loss.item(), grads={n: p.grad.float() for n, p in model.named_parameters()},
                logp=logp.detach(), entropy=entropy.detach(), adv=adv)


def step(policy, kl_model, optimizer, trajs, advantages, cfg, pad_id):
    """grpo.grpo_step as evolve.grpo_round runs it: the token mean's count and the reported sums over every rank."""
    n = fsdp.all_sum(torch.tensor(float(sum(sum(t.loss_mask) for t in trajs))))
    m = grpo.grpo_step(policy, kl_model, optimizer, trajs, advantages, cfg, pad_id, n)
    means = fsdp.all_sum(m.pop("sums")) / n
    return dict(m, loss=means[0].item(), pg=means[1].item(), kl=means[2].item(), clip_frac=means[3].item(),
                entropy=means[4].item())


def distill(policy, tokenizer, pairs, cfg):
    """An OFSD round's distillation as evolve.ofsd_round runs it: rank 0's fresh adapter on every rank, merged."""
    lesson = ofsd.prepare(policy, tokenizer, pairs, cfg)
    adapter = lora.attach(policy, cfg.ofsd_lora_rank, cfg.ofsd_lora_alpha)
    fsdp.replicate(adapter)
    m = ofsd.distill(policy, adapter, tokenizer, lesson, cfg, 0)
    checkpoint.merge_adapter(policy, adapter)
    return m


def main():
    model_dir, out, mode = sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else "float32")
    shift = float(sys.argv[4]) if len(sys.argv) > 4 else 0.3
    weights = torch.float64 if mode == "float64" else torch.float32  # float64: the exactness check
    rank, world, _, dt = fsdp.setup("cpu", mode if mode in ("bfloat16", "float64") else "float32", 0)  # evolve.py's setup
    torch.manual_seed(0)
    policy, tokenizer = load(model_dir, "cpu", weights)
    reference = load(model_dir, "cpu", weights)[0]
    trajs = trajectories(policy, tokenizer, shift)
    rewards = [1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1]
    adv = grpo.group_advantages(rewards, G).tolist()
    plain = {str(d): plain_step(policy, d, trajs, adv, tokenizer.pad_id) for d in (torch.float32, torch.bfloat16)} \
        if shift == 0 else None
    if dist.is_initialized():
        fsdp.shard(policy, dt)
        fsdp.shard(reference, dt)
    policy.checkpoint_layers = mode == "checkpointing"
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.0)
    grads = []  # the full gradient of each step, taken just before AdamW applies it
    optimizer.register_step_pre_hook(lambda *_: grads.append(
        {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().to("cpu", copy=True)
         for n, p in policy.named_parameters()}))
    mine = [i * G + j for i in range(rank, len(QUESTIONS), world) for j in range(G)]
    steps, weights = [], [fsdp.full_state_dict(policy)]
    step_cfg = settings(grpo.GRPOConfig, micro_batch=2, clip_ratio=0.2, kl_coef=0.01, entropy_coef=0.01,
                        temperature=1.0, max_grad_norm=1.0)
    policy.train()
    for _ in range(3):
        steps.append(step(policy, reference, optimizer, [trajs[i] for i in mine], [adv[i] for i in mine],
                                    step_cfg, tokenizer.pad_id))
        weights.append(fsdp.full_state_dict(policy))
    policy.eval()
    held = fsdp.state_bytes(policy, optimizer, reference)
    after_grpo = fsdp.full_state_dict(policy)
    pairs = [ofsd.Pair(trajs[g * G], trajs[g * G + 1], True) for g in range(len(QUESTIONS))]
    rounds, after_ofsd = {}, {}
    for clip in CLIPS:  # one round per clip mode, one after the other (each merges into the policy)
        cfg = settings(ofsd.OFSDConfig, ofsd_loss="kl", ofsd_kl_weight=1.0, ofsd_lora_rank=4, ofsd_lora_alpha=8, ofsd_lora_lr=1e-2,
                       ofsd_epochs=2, ofsd_pairs_per_step=2, tau_clip=0.05, ofsd_clip=clip, ofsd_context="full",
                       ofsd_positions="policy", max_grad_norm=1.0, kl_chunk=7)
        rounds[clip] = distill(policy, tokenizer, pairs, cfg)
        after_ofsd[clip] = fsdp.full_state_dict(policy)
    # GRPO through LoRA (evolve.grpo_adapter): an adapter replicated on every rank, its gradient summed
    # over the ranks, the KL term's model the policy with the adapter off; two steps
    adapter, lora_opt = evolve.grpo_adapter(policy, None, settings(grpo.GRPOConfig, grpo_lora_rank=4, grpo_lora_alpha=8,
                                                                   grpo_lora_lr=1e-3))  # as evolve.py sets it up
    with torch.no_grad():  # B = 0 at attach: move it, so that the KL term and the adapter's A gradient are not 0
        for p in adapter[1::2]:
            p.copy_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    policy.train()
    lora_steps = [step(policy, None, lora_opt, [trajs[i] for i in mine], [adv[i] for i in mine], step_cfg,
                       tokenizer.pad_id) for _ in range(2)]
    policy.eval()
    lora_adapter = [p.detach().clone() for p in adapter]
    if rank == 0:
        torch.save(dict(steps=steps, weights=weights, grads=grads, plain=plain, ofsd=rounds, state_bytes=held,
                        after_grpo=after_grpo, after_ofsd=after_ofsd, lora_steps=lora_steps, lora_adapter=lora_adapter), out)
    fsdp.teardown()


if __name__ == "__main__":
    main()
