"""The GRPO round (explore): exact-match reward, group advantages, PPO-clip loss with k3 KL.

Trajectory o_i of a question's G gets r_i = EM(answer_i, gold) and, on every one of its tokens,
    A_i = (r_i - mean(r)) / (std(r) + 1e-6)            (Bessel's std, as veRL)
The loss per policy-sampled token t (log-probs of softmax(logits / temperature)):
    rho_t = exp(log pi(t) - log pi_old(t))             (pi_old: the rollout's own log-probs)
    pg_t  = max(-A rho_t, -A clip(rho_t, 1 - eps, 1 + eps))
    d_t   = clamp(log pi_kl(t) - log pi(t), -20, 20);  kl_t = clamp(exp(d_t) - d_t - 1, -10, 10)
    L     = sum_t loss_mask_t (pg_t + beta kl_t - c_H H_t) / sum_t loss_mask_t   (H_t: the entropy)
A step is `explore` (fresh rollouts, rewards, advantages, the groups shuffled into `ppo_updates`
shares) then `update` (an AdamW update a share: veRL's PPO epochs, the first sees rho = 1). The token
mean's count is over every rank: the loop sums `Batch.token_counts` over the ranks and passes it in.
Left out: value models (GRPO needs none), format rewards, dynamic sampling, length penalties.

    python evolve.py --ofsd_rounds=false     # GRPO alone on the toy world
"""

import contextlib
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

import credit
import lora
import ofsd
from configurator import refuse_bad
from model import token_logprobs
from rollout import RolloutConfig, em_rewards, pad_batch, rollout


@dataclass(frozen=True)
class GRPOConfig:
    """A GRPO round's settings (evolve.py's constants of these names), each checked here."""
    grpo_steps: int  # optimizer steps a round
    questions_per_step: int  # questions rolled out a step, over all ranks
    ppo_mini_batch: int  # questions an update
    group_size: int  # G rollouts a question
    micro_batch: int  # trajectories a forward/backward
    lr: float  # AdamW learning rate (full fine-tuning)
    grpo_lora_rank: int  # 0: every weight trains; r > 0: a fresh rank-r adapter a round (the loop attaches it)
    grpo_lora_alpha: float  # that adapter's alpha
    grpo_lora_lr: float  # that adapter's AdamW learning rate
    warmup_steps: int  # linear warm-up over the run's first steps; 0: none
    clip_ratio: float  # PPO's epsilon
    kl_coef: float  # beta
    kl_policy: str  # the KL term's model: "round" (the round's start), "initial" (the start model)
    entropy_coef: float  # c_H
    max_grad_norm: float  # gradient-norm clip
    credit_lambda: float  # the teacher's token credit (credit.py): lambda at step 1; 0 = plain GRPO
    credit_eps: float  # its bound: w in [1 - eps, 1 + eps]
    credit_decay_steps: int  # lambda falls to 0 over these steps; 0 = constant
    credit_context: str  # what the teacher sees of tau_ref (ofsd.CONTEXTS)
    rollout: RolloutConfig  # how the rollouts run (temperature: also the loss's)

    def __post_init__(self):
        refuse_bad(self, positive=("grpo_steps", "questions_per_step", "ppo_mini_batch", "micro_batch", "lr",
                                   "grpo_lora_alpha", "grpo_lora_lr", "clip_ratio", "max_grad_norm"),
                   not_negative=("grpo_lora_rank", "warmup_steps", "kl_coef", "entropy_coef", "credit_lambda",
                                 "credit_eps", "credit_decay_steps"),
                   choices=dict(kl_policy=("round", "initial"), credit_context=ofsd.CONTEXTS),
                   also=[(self.group_size < 2, f"--group_size={self.group_size}: must be >= 2 (a group of one has "
                                               "no advantage and gives no OFSD pair)"),
                         (self.ppo_mini_batch > self.questions_per_step, f"--ppo_mini_batch={self.ppo_mini_batch}: "
                          f"must be at most --questions_per_step={self.questions_per_step}"),
                         (not self.rollout.temperature > 0, f"--temperature={self.rollout.temperature}: must be > 0 "
                                                            "(GRPO samples)"),
                         (self.credit_lambda > 1, f"--credit_lambda={self.credit_lambda}: must be at most 1")])

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


class Batch(NamedTuple):
    """One GRPO step's rollouts: question-major trajectories, G a question, and what the updates read."""
    trajs: list  # this rank's trajectories
    rewards: list  # EM of each
    advantages: list  # group advantage of each
    parts: list  # the trajectory indices of each PPO update (a shuffled share of the groups)
    weights: list = None  # credit: per trajectory its w over its sampled tokens, or None (w = 1)
    credit_stats: dict = None  # credit.token_stats of this rank's rows

    def token_counts(self):
        """Policy tokens of each update's trajectories on this rank, (ppo_updates,) float32."""
        return torch.tensor([float(sum(sum(self.trajs[i].loss_mask) for i in part)) for part in self.parts])


def explore(policy, tokenizer, index, questions, cfg, generator):
    """A step's rollouts: G a question, their EM rewards and group advantages, the groups shuffled
    into cfg.ppo_updates shares (one more group for the first len % n), and with the credit on each
    token's teacher weight w (credit.py)."""
    G = cfg.group_size
    trajs = rollout(policy, tokenizer, index, [q["question"] for q in questions], G, cfg.rollout, generator)
    rewards = em_rewards(trajs, questions, G)
    order = list(range(len(questions)))
    if cfg.ppo_updates > 1:
        order = torch.randperm(len(order), generator=generator, device=generator.device).tolist()
    parts = [[i * G + j for i in order[u::cfg.ppo_updates] for j in range(G)] for u in range(cfg.ppo_updates)]
    advantages = group_advantages(rewards, G).tolist()
    if not cfg.credit_lambda:
        return Batch(trajs, rewards, advantages, parts)
    t0 = time.time()
    weights, refs = credit.group_weights(policy, tokenizer, trajs, rewards, advantages, G, cfg.credit_context,
                                        cfg.credit_eps, cfg.rollout.temperature, cfg.micro_batch)
    stats = dict(credit.token_stats(tokenizer, trajs, advantages, weights, refs), seconds=time.time() - t0)
    return Batch(trajs, rewards, advantages, parts, weights, stats)


def per_token(advantage, traj):
    """A trajectory's advantage on each token it sampled: a float (the same on every token) or a list."""
    return advantage if isinstance(advantage, list) else [advantage] * sum(traj.loss_mask[1:])


def grpo_step(model, kl_model, optimizer, trajs, advantages, cfg, pad_id, n_tokens=None):
    """One AdamW update on `trajs` (a PPO mini-batch), accumulated over micro-batches (`advantages`: a
    float a trajectory, or with the credit a list over its sampled tokens); the loss is a
    token mean over `n_tokens`, the update's policy tokens on every rank (None: these trajectories'
    own, one process). kl_model None: the KL term's model is the policy with its LoRA adapter off.
    Returns this rank's share of each token mean, its token `sums` of the loss, pg, kl, clipped and
    entropy ((5,) float64), the gradient norm and the token count."""
    device, temperature = model.model.embed_tokens.weight.device, cfg.rollout.temperature
    if n_tokens is None:
        n_tokens = torch.tensor(float(sum(sum(t.loss_mask) for t in trajs)), device=device)
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, pg, kl, clipped, entropy (token sums)
    by_length = sorted(range(len(trajs)), key=lambda i: len(trajs[i].tokens))  # micro-batches pad little
    for s in range(0, len(trajs), cfg.micro_batch):
        rows = by_length[s:s + cfg.micro_batch]
        ids, valid, mask, old = pad_batch([trajs[i] for i in rows], pad_id, device)  # (B, T) each
        adv_tok = torch.tensor([a for i in rows for a in per_token(advantages[i], trajs[i])], dtype=torch.float32,
                               device=device)  # (n,) each sampled token its row's advantage (credited: its own)
        old_tok = old[:, 1:][mask[:, 1:]]  # (n,)
        with torch.no_grad(), lora.disabled(model) if kl_model is None else contextlib.nullcontext():
            kl_tok = token_logprobs(model if kl_model is None else kl_model, ids, valid, mask, temperature)
        logp, entropy = token_logprobs(model, ids, valid, mask, temperature, entropy=True)  # (n,) each
        loss, pg, kl, clipped = grpo_token_loss(logp, old_tok, kl_tok, adv_tok, cfg.clip_ratio, cfg.kl_coef,
                                                entropy, cfg.entropy_coef)
        (loss.sum() / n_tokens).backward()
        sums += torch.stack([loss.sum(), pg.sum(), kl.sum(), clipped.float().sum(), entropy.sum()]).detach()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)  # the global norm
    optimizer.step()
    means = sums / n_tokens
    return dict(loss=means[0].item(), pg=means[1].item(), kl=means[2].item(), clip_frac=means[3].item(),
                entropy=means[4].item(), grad_norm=grad_norm.item(), tokens=int(n_tokens.item()), sums=sums)


def learning_rate(cfg, step):
    """The learning rate at the run's step `step` (from 1): linear warm-up over cfg.warmup_steps (0: none)."""
    lr = cfg.grpo_lora_lr if cfg.grpo_lora_rank else cfg.lr
    return lr * min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else lr


def update(policy, kl_model, optimizer, batch, n_tokens, cfg, step, pad_id):
    """A step's cfg.ppo_updates AdamW updates on `batch`, update u a token mean over n_tokens[u] (its
    policy tokens on every rank), the learning rate warmed up over the run's first cfg.warmup_steps.
    Returns the updates' gradient norms and this rank's sums: the loss terms of each update
    ((ppo_updates, 5) float64) and of the rollouts (reward, searches, trajectories: (3,))."""
    for g in optimizer.param_groups:
        g["lr"] = learning_rate(cfg, step)
    lam = credit.schedule(cfg.credit_lambda, cfg.credit_decay_steps, step)
    adv = batch.advantages if batch.weights is None else credit.token_advantages(batch.advantages, batch.weights, lam)
    done = [grpo_step(policy, kl_model, optimizer, [batch.trajs[i] for i in part], [adv[i] for i in part],
                      cfg, pad_id, n) for part, n in zip(batch.parts, n_tokens)]
    rollout_sums = torch.tensor([sum(batch.rewards), sum(t.n_search for t in batch.trajs), len(batch.trajs)])
    out = dict(loss_sums=torch.stack([d["sums"] for d in done]), rollout_sums=rollout_sums,
               grad_norms=[d["grad_norm"] for d in done], step=step, lr=optimizer.param_groups[0]["lr"])
    if batch.credit_stats is not None:
        out["credit"] = dict(batch.credit_stats, credit_lambda=lam)  # this rank's rows
    return out


def step_metrics(done, loss_sums, rollout_sums, n_tokens):
    """A step's metrics from `update`'s result and its sums over every rank: each update's token means
    (its `updates`, when there are several), their mean, the reward and searches a trajectory."""
    means = loss_sums / n_tokens[:, None]  # (ppo_updates, 5)
    updates = [dict(loss=u[0].item(), pg=u[1].item(), kl=u[2].item(), clip_frac=u[3].item(), entropy=u[4].item(),
                    grad_norm=g, tokens=int(n.item())) for u, g, n in zip(means, done["grad_norms"], n_tokens)]
    m = {k: sum(x[k] for x in updates) / len(updates) for k in updates[0]}
    m["tokens"] = sum(x["tokens"] for x in updates)
    if len(updates) > 1:
        m["updates"] = updates
    m.update(step=done["step"], lr=done["lr"], reward=(rollout_sums[0] / rollout_sums[2]).item(),
             searches=(rollout_sums[1] / rollout_sums[2]).item())
    if "credit" in done:
        m["credit"] = done["credit"]
    return m
