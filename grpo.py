"""The GRPO round (explore): exact-match reward, group advantages, PPO-clip loss with k3 KL.

For each question, G trajectories o_1..o_G get reward r_i = EM(answer_i, gold) in {0, 1}
(rollout.exact_match) and the group-relative advantage, shared by every token of o_i:
    A_i = (r_i - mean(r)) / (std(r) + 1e-6)            (std with Bessel's correction, as veRL)
so a group with equal rewards gives no policy gradient. The loss per policy-sampled token t is
    rho_t  = exp(log pi(t) - log pi_old(t))            (pi_old: the rollout's recorded log-probs)
    pg_t   = max(-A * rho_t, -A * clip(rho_t, 1 - eps, 1 + eps))
    d_t    = clamp(log pi_kl(t) - log pi(t), -20, 20)     (pi_kl: the KL model, see grpo_round)
    kl_t   = exp(d_t) - d_t - 1                            (k3, then clamped to [-10, 10])
    H_t    = -sum_v pi(v) log pi(v)                       (the entropy at t's position)
    L      = sum_t loss_mask_t * (pg_t + beta * kl_t - c_H * H_t) / sum_t loss_mask_t   (token mean)
with log-probabilities taken from softmax(logits / temperature), the rollout's temperature.
(The +-20 clamp only keeps exp() finite; the +-10 clamp is veRL's.)

Micro-batches hold trajectories of similar lengths (little padding). The old log-probabilities are
the rollout's recorded ones, so no forward computes them.

A GRPO round is `steps` steps, each on a fresh rollout batch of the current policy, passed over
once in `ppo_updates` shuffled mini-batches of whole groups, one optimizer update each: the first
update sees rho = 1, the later ones a moved policy, where the clip acts (as veRL's PPO epochs).

Left out: value models / GAE (GRPO needs none), format rewards (the anchor uses EM only),
dynamic sampling and length penalties.

    python grpo.py "the Eiffel Tower" "Eiffel Tower" "tower"      # EM of a prediction vs golds
"""

import contextlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fsdp
import lora
from model import pad_right
from rollout import em_rewards, rollout


def group_advantages(rewards, group_size, eps=1e-6):
    """(r - mean) / (std + eps) within consecutive groups of `group_size`: (N,) -> (N,)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).view(-1, group_size)  # (B, G)
    if group_size == 1:
        return torch.zeros(r.numel())
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def pad_batch(trajs, pad_id, device):
    """Right-pad trajectories -> ids, valid, loss_mask (B, T) and the rollout log-probs (B, T)."""
    ids, valid = pad_right([t.tokens for t in trajs], pad_id, device)
    mask = pad_right([t.loss_mask for t in trajs], 0, device)[0].bool()
    old = torch.zeros(ids.shape, device=device)
    for i, t in enumerate(trajs):
        old[i, :len(t.logprobs)] = torch.tensor(t.logprobs, device=device)
    return ids, valid, mask, old


HEAD_CHUNK = 512  # loss positions per LM-head chunk: a (512, V) float32 block at a time (memory, not results)


def _head(h, weight, targets, temperature):
    """One chunk of the LM head: (C, d) hidden states -> log p(target) and the entropy, each (C,)."""
    logits = F.linear(h, weight)  # (C, V), in float32 at least (float64 stays float64)
    log_p = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def token_logprobs(model, ids, valid, mask, temperature, entropy=False, chunk=HEAD_CHUNK):
    """log softmax(logits / temperature) of each token where mask is 1, (n_masked,), and with
    entropy=True each of those distributions' entropy, (n_masked,). Logits only at the masked
    positions, `chunk` rows at a time, recomputed in backward: autograd keeps no (n, V) tensor
    (1.8 GB a copy at V = 151,936 and 3,000 loss tokens)."""
    pred = mask[:, 1:]  # token t is predicted from position t - 1
    h_sel = model.hidden(ids, valid=valid, select=F.pad(pred, (0, 1)))  # (n, d)
    targets = ids[:, 1:][pred]  # (n,)
    weight, parts = model.lm_head_weight, []
    for c in range(0, len(targets), chunk):
        args = (h_sel[c:c + chunk], weight, targets[c:c + chunk], temperature)
        parts.append(checkpoint(_head, *args, use_reentrant=False) if torch.is_grad_enabled() else _head(*args))
    logp, ent = (torch.cat(x) for x in zip(*parts)) if parts else (h_sel.new_zeros(0).float(),) * 2  # (n,)
    return (logp, ent) if entropy else logp


def grpo_token_loss(logp, old_logp, kl_logp, adv, clip_ratio, kl_coef, entropy=None, entropy_coef=0.0):
    """Per-token PPO-clip + k3 KL terms, minus the entropy bonus, all (n,);
    returns (loss, pg, kl, clipped indicator)."""
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_ratio, 1 + clip_ratio))
    log_r = (kl_logp - logp).clamp(-20, 20)
    kl = (torch.exp(log_r) - log_r - 1).clamp(-10, 10)
    clipped = (ratio - ratio.clamp(1 - clip_ratio, 1 + clip_ratio)).abs() > 0
    loss = pg + kl_coef * kl
    if entropy_coef:
        loss = loss - entropy_coef * entropy
    return loss, pg, kl, clipped


def grpo_step(model, kl_model, optimizer, trajs, advantages, *, micro_batch, clip_ratio, kl_coef,
              entropy_coef, temperature, max_grad_norm, pad_id):
    """One optimizer step on `trajs` (a PPO mini-batch): masked token-mean loss over the tokens of
    every rank, accumulated over micro-batches of similar lengths. Under torch.distributed the
    model is sharded (fsdp.py), whose backward sums the ranks' gradients into each rank's slice;
    every rank must run the same number of micro-batches. kl_model None: the KL term's model is the
    policy with its LoRA adapter off (a LoRA round's starting policy)."""
    device = model.model.embed_tokens.weight.device
    n_tokens = torch.tensor(float(sum(sum(t.loss_mask) for t in trajs)), device=device)
    if dist.is_initialized():
        dist.all_reduce(n_tokens)
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, pg, kl, clipped, entropy (token sums)
    by_length = sorted(range(len(trajs)), key=lambda i: len(trajs[i].tokens))  # micro-batches pad little
    for s in range(0, len(trajs), micro_batch):
        rows = by_length[s:s + micro_batch]
        ids, valid, mask, old = pad_batch([trajs[i] for i in rows], pad_id, device)
        adv = torch.tensor([advantages[i] for i in rows], dtype=torch.float32, device=device)
        adv_tok = adv[:, None].expand_as(mask)[:, 1:][mask[:, 1:]]  # (n,) each token its row's advantage
        old_tok = old[:, 1:][mask[:, 1:]]  # (n,)
        with torch.no_grad(), lora.disabled(model) if kl_model is None else contextlib.nullcontext():
            kl_tok = token_logprobs(model if kl_model is None else kl_model, ids, valid, mask, temperature)
        logp, entropy = token_logprobs(model, ids, valid, mask, temperature, entropy=True)
        loss, pg, kl, clipped = grpo_token_loss(logp, old_tok, kl_tok, adv_tok, clip_ratio, kl_coef,
                                                entropy, entropy_coef)
        (loss.sum() / n_tokens).backward()
        sums += torch.stack([loss.sum(), pg.sum(), kl.sum(), clipped.float().sum(), entropy.sum()]).detach()
    fsdp.reshard(model if kl_model is None else kl_model)  # a sharded root keeps its gathered weights after a no-grad forward
    if dist.is_initialized():
        dist.all_reduce(sums)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    fsdp.sum_replicated_grads(params)  # an adapter's gradients (FSDP sums the sharded weights' own)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)  # the global norm, over every slice
    optimizer.step()
    sums /= n_tokens
    return dict(loss=sums[0].item(), pg=sums[1].item(), kl=sums[2].item(), clip_frac=sums[3].item(),
                entropy=sums[4].item(), grad_norm=fsdp.local(grad_norm).item(), tokens=int(n_tokens.item()))


def grpo_round(policy, kl_model, optimizer, tokenizer, index, next_questions, *, steps, first_step, lr,
               warmup_steps, group_size, ppo_updates, micro_batch, clip_ratio, kl_coef, entropy_coef,
               max_grad_norm, rollout_args, generator, log):
    """`steps` GRPO steps of `policy` as the module docstring says; `next_questions()` gives this rank's
    questions for a step, the learning rate warms up over the run's first `warmup_steps` steps
    (`first_step`: steps before this round), `generator` draws the samples and the mini-batch order.
    `log(metrics)` after every step; returns the steps' metrics (each update's under "updates")."""
    history, device = [], policy.model.embed_tokens.weight.device
    policy.train()
    for s in range(steps):
        t0 = time.time()
        step = first_step + s + 1
        questions = next_questions()
        with torch.no_grad():
            trajs = rollout(policy, tokenizer, index, [q["question"] for q in questions], group_size,
                            generator=generator, **rollout_args)
        rollout_seconds = time.time() - t0
        fsdp.trim_host_memory()  # the rollout's KV cache and gathered weights, before training
        rewards = em_rewards(trajs, questions, group_size)
        advantages = group_advantages(rewards, group_size).tolist()
        for g in optimizer.param_groups:
            g["lr"] = lr * min(1.0, step / warmup_steps)
        order = list(range(len(questions)))  # questions of this rank, each with its G trajectories
        if ppo_updates > 1:
            order = torch.randperm(len(order), generator=generator, device=generator.device).tolist()
        updates = []
        for u in range(ppo_updates):  # equal shares (one more for the first len % ppo_updates)
            part = [i * group_size + j for i in order[u::ppo_updates] for j in range(group_size)]
            updates.append(grpo_step(
                policy, kl_model, optimizer, [trajs[i] for i in part], [advantages[i] for i in part],
                micro_batch=micro_batch, clip_ratio=clip_ratio, kl_coef=kl_coef, entropy_coef=entropy_coef,
                temperature=rollout_args["temperature"], max_grad_norm=max_grad_norm, pad_id=tokenizer.pad_id))
        m = {k: sum(x[k] for x in updates) / len(updates) for k in updates[0]}  # mean over the updates
        m["tokens"] = sum(x["tokens"] for x in updates)
        if ppo_updates > 1:
            m["updates"] = updates
        stats = torch.tensor([sum(rewards), sum(t.n_search for t in trajs), len(trajs)], device=device)
        if dist.is_initialized():
            dist.all_reduce(stats)
        m.update(step=step, lr=optimizer.param_groups[0]["lr"], reward=(stats[0] / stats[2]).item(),
                 searches=(stats[1] / stats[2]).item(),
                 seconds=time.time() - t0, rollout_seconds=rollout_seconds)
        log(m)
        history.append(m)
    policy.eval()
    return history


if __name__ == "__main__":
    from rollout import exact_match, normalize_answer
    if len(sys.argv) < 3:
        sys.exit("usage: python grpo.py PREDICTION GOLD [GOLD ...]")
    print(f"normalised: {normalize_answer(sys.argv[1])!r}  EM: {exact_match(sys.argv[1], sys.argv[2:])}")
