"""The GRPO round (explore): exact-match reward, group advantages, PPO-clip loss with k3 KL.

Trajectory o_i of a question's G gets r_i = EM(answer_i, gold) and, on every one of its tokens,
    A_i = (r_i - mean(r)) / (std(r) + 1e-6)            (Bessel's std, as veRL)
The loss per policy-sampled token t (log-probs of softmax(logits / temperature)):
    rho_t = exp(log pi(t) - log pi_old(t))             (pi_old: the rollout's own log-probs)
    pg_t  = max(-A rho_t, -A clip(rho_t, 1 - eps, 1 + eps))
    d_t   = clamp(log pi_kl(t) - log pi(t), -20, 20);  kl_t = clamp(exp(d_t) - d_t - 1, -10, 10)
    L     = sum_t loss_mask_t (pg_t + beta kl_t - c_H H_t) / sum_t loss_mask_t   (H_t: the entropy)
A step rolls out fresh trajectories and makes `ppo_updates` AdamW updates on shuffled shares of the
groups (veRL's PPO epochs: the first sees rho = 1). Two calls need every rank: `all_sum` (the
token mean), `reshard` (FSDP2 keeps a root's weights gathered after a no-grad forward).
Left out: value models (GRPO needs none), format rewards, dynamic sampling, length penalties.

    python evolve.py --ofsd_rounds=false     # GRPO alone on the toy world
"""

import contextlib
import time
from dataclasses import dataclass

import torch

import lora
from fsdp import all_sum, reshard
from model import token_logprobs
from rollout import RolloutConfig, em_rewards, pad_batch, rollout


@dataclass(frozen=True)
class GRPOConfig:
    """A GRPO round's settings (evolve.py's constants of these names)."""
    grpo_steps: int  # optimizer steps a round
    questions_per_step: int  # questions rolled out a step, over all ranks
    ppo_mini_batch: int  # questions an update
    group_size: int  # G rollouts a question
    micro_batch: int  # trajectories a forward/backward
    lr: float  # AdamW learning rate
    warmup_steps: int  # linear warm-up, over the run's first steps
    clip_ratio: float  # PPO's epsilon
    kl_coef: float  # beta
    entropy_coef: float  # c_H
    max_grad_norm: float  # gradient-norm clip
    rollout: RolloutConfig  # how the rollouts run (temperature: also the loss's)

    @property
    def ppo_updates(self):
        return self.questions_per_step // self.ppo_mini_batch


def group_advantages(rewards, group_size, eps=1e-6):
    """(r - mean) / (std + eps) within consecutive groups of `group_size`: (N,) -> (N,)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).view(-1, group_size)  # (B, G)
    if group_size == 1:
        return torch.zeros(r.numel())
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def grpo_token_loss(logp, old_logp, kl_logp, adv, clip_ratio, kl_coef, entropy=None, entropy_coef=0.0):
    """Per-token (loss, pg, kl, clipped indicator), each (n,)."""
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_ratio, 1 + clip_ratio))
    log_r = (kl_logp - logp).clamp(-20, 20)
    kl = (torch.exp(log_r) - log_r - 1).clamp(-10, 10)
    clipped = (ratio - ratio.clamp(1 - clip_ratio, 1 + clip_ratio)).abs() > 0
    loss = pg + kl_coef * kl
    if entropy_coef:
        loss = loss - entropy_coef * entropy
    return loss, pg, kl, clipped


def grpo_step(model, kl_model, optimizer, trajs, advantages, cfg, pad_id):
    """One AdamW update on `trajs` (a PPO mini-batch), accumulated over micro-batches. kl_model None:
    the KL term's model is the policy with its LoRA adapter off."""
    device, temperature = model.model.embed_tokens.weight.device, cfg.rollout.temperature
    n_tokens = all_sum(torch.tensor(float(sum(sum(t.loss_mask) for t in trajs)), device=device))
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, pg, kl, clipped, entropy (token sums)
    by_length = sorted(range(len(trajs)), key=lambda i: len(trajs[i].tokens))  # micro-batches pad little
    for s in range(0, len(trajs), cfg.micro_batch):
        rows = by_length[s:s + cfg.micro_batch]
        ids, valid, mask, old = pad_batch([trajs[i] for i in rows], pad_id, device)  # (B, T) each
        adv = torch.tensor([advantages[i] for i in rows], dtype=torch.float32, device=device)  # (B,)
        adv_tok = adv[:, None].expand_as(mask)[:, 1:][mask[:, 1:]]  # (n,) each token its row's advantage
        old_tok = old[:, 1:][mask[:, 1:]]  # (n,)
        with torch.no_grad(), lora.disabled(model) if kl_model is None else contextlib.nullcontext():
            kl_tok = token_logprobs(model if kl_model is None else kl_model, ids, valid, mask, temperature)
        logp, entropy = token_logprobs(model, ids, valid, mask, temperature, entropy=True)  # (n,) each
        loss, pg, kl, clipped = grpo_token_loss(logp, old_tok, kl_tok, adv_tok, cfg.clip_ratio, cfg.kl_coef,
                                                entropy, cfg.entropy_coef)
        (loss.sum() / n_tokens).backward()
        sums += torch.stack([loss.sum(), pg.sum(), kl.sum(), clipped.float().sum(), entropy.sum()]).detach()
    reshard(model if kl_model is None else kl_model)
    sums = all_sum(sums) / n_tokens
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)  # the global norm
    optimizer.step()
    return dict(loss=sums[0].item(), pg=sums[1].item(), kl=sums[2].item(), clip_frac=sums[3].item(),
                entropy=sums[4].item(), grad_norm=grad_norm.item(), tokens=int(n_tokens.item()))


def grpo_round(policy, kl_model, optimizer, tokenizer, index, next_questions, cfg, generator, first_step, log):
    """cfg.grpo_steps steps on this rank's `next_questions()`, lr warmed up over the run's first steps
    (`first_step` came before); `log(metrics)` after each step; returns their metrics."""
    device, G, history = policy.model.embed_tokens.weight.device, cfg.group_size, []
    policy.train()
    for s in range(cfg.grpo_steps):
        t0, step = time.time(), first_step + s + 1
        questions = next_questions()
        # 1. G rollouts a question, their EM rewards and group advantages
        trajs = rollout(policy, tokenizer, index, [q["question"] for q in questions], G, cfg.rollout, generator)
        rollout_seconds = time.time() - t0
        rewards = em_rewards(trajs, questions, G)
        advantages = group_advantages(rewards, G).tolist()
        # 2. ppo_updates updates, each on a shuffled share of the groups (one more for the first len % n)
        for g in optimizer.param_groups:
            g["lr"] = cfg.lr * min(1.0, step / cfg.warmup_steps)
        order = list(range(len(questions)))
        if cfg.ppo_updates > 1:
            order = torch.randperm(len(order), generator=generator, device=generator.device).tolist()
        updates = []
        for u in range(cfg.ppo_updates):
            part = [i * G + j for i in order[u::cfg.ppo_updates] for j in range(G)]
            updates.append(grpo_step(policy, kl_model, optimizer, [trajs[i] for i in part],
                                     [advantages[i] for i in part], cfg, tokenizer.pad_id))
        # 3. the step's metrics: means over the updates, reward and searches over every rank
        m = {k: sum(x[k] for x in updates) / len(updates) for k in updates[0]}
        m["tokens"] = sum(x["tokens"] for x in updates)
        if cfg.ppo_updates > 1:
            m["updates"] = updates
        stats = all_sum(torch.tensor([sum(rewards), sum(t.n_search for t in trajs), len(trajs)], device=device))
        m.update(step=step, lr=optimizer.param_groups[0]["lr"], reward=(stats[0] / stats[2]).item(),
                 searches=(stats[1] / stats[2]).item(), seconds=time.time() - t0, rollout_seconds=rollout_seconds)
        log(m)
        history.append(m)
    policy.eval()
    return history
