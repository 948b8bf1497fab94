"""Worker for test_grpo_lora: one LoRA GRPO step on a base held in bfloat16 (fsdp.wrap in one process,
a LoRA run's layout), then the same step under FSDP2's one-rank mixed precision over float32 masters
(a full fine-tuning run's layout); prints both steps' metrics and adapter gradients' largest difference.

    python tests/bf16_base_step.py CHECKPOINT_DIR
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fsdp  # noqa: E402
import grpo  # noqa: E402
import lora  # noqa: E402
from conftest import settings  # noqa: E402
from model import load  # noqa: E402
from rollout import Trajectory  # noqa: E402


def step(policy, vocab):
    """The adapter's gradients and the metrics of one step on fixed trajectories (a seeded adapter)."""
    policy.checkpoint_layers = True
    torch.manual_seed(0)
    adapter = lora.attach(policy, 4, 8)
    with torch.no_grad():
        for p in adapter:
            p.add_(torch.randn_like(p) * 0.05)  # B non-zero: the adapter acts in the forward
    g, trajs = torch.Generator().manual_seed(1), []
    for n in (40, 55, 70):
        t = Trajectory("q", 10)
        t.add(torch.randint(0, vocab, (10,), generator=g).tolist(), sampled=False)
        t.add(torch.randint(0, vocab, (n,), generator=g).tolist(), sampled=True, logprobs=[-3.0] * n)
        trajs.append(t)
    opt = torch.optim.AdamW(adapter, lr=1e-3, weight_decay=0.0)
    m = grpo.grpo_step(policy, None, opt, trajs, [1.0, -0.5, -0.5], settings(grpo.GRPOConfig, micro_batch=2), 0)
    m.pop("sums")  # (5,) token sums: what evolve.py sums over ranks
    return m, [p.grad.clone() for p in adapter]


if __name__ == "__main__":
    torch.set_num_threads(1)
    model, _ = load(sys.argv[1])
    vocab = model.config.vocab_size
    held, grads_held = step(fsdp.wrap(model, torch.bfloat16), vocab)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sharded, grads_sharded = step(fsdp.shard(load(sys.argv[1])[0], torch.bfloat16), vocab)
    print(json.dumps(dict(held=held, sharded=sharded, dtype=str(model.lm_head_weight.dtype),
                          grad_diff=max(float((a - b).abs().max()) for a, b in zip(grads_held, grads_sharded)),
                          grad_max=max(float(a.abs().max()) for a in grads_held))))
    dist.destroy_process_group()
