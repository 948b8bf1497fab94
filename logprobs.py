"""A policy's log-probabilities at a trajectory's sampled tokens: GRPO's loss and OFSD's NLL read
trajectories only through these. `pad_batch` right-pads trajectories into tensors; `token_logprobs`
runs the model to its final hidden states at the loss positions only, then the LM head a chunk of
positions at a time (at most 2^24 logits), each recomputed in backward: autograd keeps no (n, V) tensor:
    log p(t) = log softmax(h W^T / temperature)[t],   H = -sum_v p(v) log p(v)

    python -m pytest tests/test_grpo.py -k chunk     # the chunked head against one full head
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fsdp import trim_host_memory
from model import pad_right


def pad_batch(trajs, pad_id, device):
    """Right-pad trajectories -> ids, valid, loss_mask (B, T) and the rollout log-probs (B, T)."""
    ids, valid = pad_right([t.tokens for t in trajs], pad_id, device)
    mask = pad_right([t.loss_mask for t in trajs], 0, device)[0].bool()
    old = torch.zeros(ids.shape, device=device)
    for i, t in enumerate(trajs):
        old[i, :len(t.logprobs)] = torch.tensor(t.logprobs, device=device)
    return ids, valid, mask, old


HEAD_CHUNK = 512  # loss positions per LM-head chunk at most (memory, not results) ...
HEAD_LOGITS = 1 << 24  # ... and at most this many logits: 110 positions of a 151,936-token vocabulary


def _head(h, weight, targets, temperature):
    """One chunk of the LM head: (C, d) hidden states -> log p(target) and the entropy, each (C,)."""
    logits = F.linear(h, weight)  # (C, V), in float32 at least (float64 stays float64)
    log_p = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def token_logprobs(model, ids, valid, mask, temperature, entropy=False, chunk=None):
    """log p of each token where mask is 1, (n,), and with entropy=True each position's entropy, (n,)."""
    chunk = chunk or max(1, min(HEAD_CHUNK, HEAD_LOGITS // model.config.vocab_size))
    trim_host_memory()  # the last micro-batch's freed heap back to the OS: this one's tensors differ in size
    pred = mask[:, 1:]  # token t is predicted from position t - 1
    h_sel = model.hidden(ids, valid=valid, select=F.pad(pred, (0, 1)))  # (n, d)
    targets = ids[:, 1:][pred]  # (n,)
    weight, parts = model.lm_head_weight, []  # (V, d), read after hidden(): FSDP2 gathers it there
    for c in range(0, len(targets), chunk):
        args = (h_sel[c:c + chunk], weight, targets[c:c + chunk], temperature)
        parts.append(checkpoint(_head, *args, use_reentrant=False) if torch.is_grad_enabled() else _head(*args))
    logp, ent = (torch.cat(x) for x in zip(*parts)) if parts else (h_sel.new_zeros(0).float(),) * 2  # (n,)
    return (logp, ent) if entropy else logp
