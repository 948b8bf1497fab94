"""Memory per GPU for Qwen2.5 0.5B / 3B / 7B: FSDP2 (fsdp.py) against every rank holding everything.

Three parts, printed as tables:
1. Measured state: `fsdp.state_bytes` after one GRPO step (parameters, gradients, AdamW state,
   the KL term's model) of the toy backbone and, given --checkpoint, a real Qwen2.5 checkpoint,
   on 1 process and on 2 gloo ranks, against the formula the table below uses.
2. Measured activations: the bytes autograd saves for backward (saved-tensor hooks, distinct
   storages) in `model.token_logprobs` through one decoder layer at each size's real dimensions,
   in bfloat16, with and without activation checkpointing: per token per layer, and per loss
   token at the LM head (log-softmax over the vocabulary, entropy).
3. The memory table: per GPU on 1 and 8 GPUs, from those formulas and measurements, for the
   docs/real-scale.md's settings (rollout_rows=64 trajectories decoded at once, KV cache in
   bfloat16; micro_batch=4 trajectories of 2,000 tokens, 600 of them the policy's).

    python bench/bench_memory.py [--checkpoint ~/.cache/qwen2.5-coder-0.5b-instruct]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp import shard, state_bytes, teardown  # noqa: E402
import grpo  # noqa: E402
from model import Qwen2, Qwen2Config, load  # noqa: E402
from rollout import RolloutConfig, Trajectory, max_response_tokens  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from common import SIZES, n_params, state_formula  # noqa: E402  (bench/common.py)
from grpo import GRPOConfig  # noqa: E402
from common import group  # noqa: E402
from model import token_logprobs  # noqa: E402

GB = 1e9
# docs/real-scale.md's rollout: 64 trajectories decoded at once, a 300-token prompt, 4 searching turns
ROLLOUT_ROWS, PROMPT, TURNS = 64, 300, dict(max_turns=4, max_turn_tokens=500, max_obs_tokens=500)
MICRO_TOKENS, LOSS_TOKENS = 4 * 2000, 4 * 600


# ----------------------------------------------------------------------------------------------
# 1. state_bytes, measured (a worker run by this script, alone or under torchrun)

def worker(model_dir, out):
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    policy, tok = load(model_dir)
    reference = load(model_dir)[0]
    if dist.is_initialized():
        shard(policy, torch.float32)
        shard(reference, torch.float32)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    t = Trajectory("q", 4)
    t.add([1, 2, 3, 4], sampled=False)
    t.add([5, 6, 7, 8], sampled=True, logprobs=[-1.0] * 4)
    grpo.grpo_step(policy, reference, opt, [t, t], [1.0, -1.0], group(GRPOConfig, micro_batch=2, clip_ratio=0.2, kl_coef=0.001, entropy_coef=0.0, temperature=1.0, max_grad_norm=1.0), 0)
    held = state_bytes(policy, opt, reference)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(held, f)
    teardown()


def measured_state(model_dir):
    rows = []
    with tempfile.TemporaryDirectory() as d:
        P = n_params(Qwen2Config.from_json(os.path.join(model_dir, "config.json")))
        for ranks in (1, 2):
            launch = ([sys.executable] if ranks == 1 else
                      [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"])
            out = os.path.join(d, f"{ranks}.json")
            subprocess.run(launch + [__file__, "--worker", model_dir, out], check=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
            held = json.load(open(out))[0]
            rows.append((ranks, P, held, state_formula(P, ranks)))
    return rows


# ----------------------------------------------------------------------------------------------
# 2. activations, measured: saved-for-backward bytes of one decoder layer and the LM head

def saved_bytes(fn, model):
    """Bytes of the distinct storages autograd saves while running fn(), the model's weights aside."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def measured_activations(size, T=256):
    """(bytes per token per decoder layer without / with checkpointing, bytes per loss token at the
    LM head), from a bfloat16 model of one decoder layer at the size's dimensions."""
    cfg = Qwen2Config(**dict(SIZES[size], num_hidden_layers=1), rope_theta=1e6)
    torch.manual_seed(0)
    model = Qwen2(cfg).to(torch.bfloat16).train()
    block = model.model.layers[0]
    x = torch.randn(1, T, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    emb = torch.randn(1, 1, T, cfg.head_dim, dtype=torch.bfloat16)  # stands for the rotary cos / sin
    layer, layer_ckpt = (saved_bytes(lambda: block(x, emb.cos(), emb.sin(), None, None, 0, None, r), model) / T
                         for r in (False, True))
    ids, valid = torch.randint(0, cfg.vocab_size, (1, T)), torch.ones(1, T, dtype=torch.bool)

    def head(n_loss):  # token_logprobs with n loss tokens: the layer's MLP and the head run only there
        mask = torch.zeros(1, T, dtype=torch.bool)
        mask[0, T - n_loss:] = True
        return saved_bytes(lambda: token_logprobs(model, ids, valid, mask, 1.0, entropy=True), model)

    return layer, layer_ckpt, (head(65) - head(33)) / 32


# ----------------------------------------------------------------------------------------------
# 3. the table

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=os.environ.get("QWEN_CHECKPOINT", ""))
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    print("\n1. state held per rank after one GRPO step, measured (fsdp.state_bytes) vs formula, MB\n")
    print("| model | params | ranks | parameters | gradients | AdamW | KL model | formula (each) |")
    print("|---|---|---|---|---|---|---|---|")
    models = [("toy backbone", os.path.join(ROOT, "cache", "toyworld", "backbone"))]
    models += [(os.path.basename(args.checkpoint.rstrip("/")), args.checkpoint)] if args.checkpoint else []
    for name, path in models:
        if not os.path.isdir(path):
            subprocess.run([sys.executable, "-m", "worlds.toyagent", "cache/toyworld", "--shipped"], cwd=ROOT, check=True)
        for ranks, P, held, f in measured_state(path):
            print(f"| {name} | {P / 1e6:.1f}M | {ranks} | {held['params'] / 1e6:.2f} | {held['grads'] / 1e6:.2f} | "
                  f"{held['optimizer'] / 1e6:.2f} | {held['reference'] / 1e6:.2f} | {f['params'] / 1e6:.2f} / "
                  f"{f['grads'] / 1e6:.2f} / {f['optimizer'] / 1e6:.2f} / {f['reference'] / 1e6:.2f} |")

    print("\n2. activations saved for backward, measured on one bfloat16 decoder layer at each size's dimensions\n")
    print("| model | per token per layer | with checkpointing | per loss token at the LM head |")
    print("|---|---|---|---|")
    acts = {}
    for size in SIZES:
        acts[size] = measured_activations(size)
        layer, ckpt, head = acts[size]
        print(f"| {size} | {layer / 1e3:.1f} KB | {ckpt / 1e3:.1f} KB | {head / 1e6:.2f} MB |")

    toy_tokenizer = Tokenizer(os.path.join(models[0][1], "tokenizer.json"))  # only the invalid-action message's length
    max_len = PROMPT + max_response_tokens(toy_tokenizer, RolloutConfig(**TURNS, top_k=3))  # the KV cache of one trajectory, as rollout sizes it
    print(f"\n3. per GPU, GB (rollout_rows={ROLLOUT_ROWS} x {max_len} KV slots; micro-batch {MICRO_TOKENS} tokens, "
          f"{LOSS_TOKENS} of them loss tokens); 'replicated' = every rank holds everything (before FSDP2)\n")
    print("| model | GPUs | layout | parameters | gradients | AdamW | KL model | rollout: gathered bf16 weights "
          "| rollout: KV cache | activations (no ckpt / ckpt) | peak (no ckpt / ckpt) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size, dims in SIZES.items():
        cfg = Qwen2Config(**dims, rope_theta=1e6)
        P, L = n_params(cfg), cfg.num_hidden_layers
        kv = 2 * L * cfg.num_key_value_heads * cfg.head_dim * 2 * ROLLOUT_ROWS * max_len  # bfloat16 K and V
        layer, ckpt, head = acts[size]
        act = MICRO_TOKENS * layer * L + LOSS_TOKENS * head
        act_ckpt = MICRO_TOKENS * ckpt * L + MICRO_TOKENS * layer + LOSS_TOKENS * head  # + one layer recomputed
        for gpus, layout in ((1, "replicated"), (1, "FSDP2"), (8, "replicated"), (8, "FSDP2")):
            fsdp = layout == "FSDP2"
            s = state_formula(P, gpus if fsdp else 1)
            states = sum(s.values())
            gathered = 2 * P if fsdp else 0  # replicated: the float32 weights are used as they are
            f32 = 1 if fsdp else 2  # replicated computes in float32 (the previous advice): twice the bytes
            kv_, act_, act_ckpt_ = kv * f32, act * f32, act_ckpt * f32
            peak = [max(states + gathered + kv_, states + a) for a in (act_, act_ckpt_)]
            print(f"| {size} | {gpus} | {layout} | {s['params'] / GB:.1f} | {s['grads'] / GB:.1f} | "
                  f"{s['optimizer'] / GB:.1f} | {s['reference'] / GB:.1f} | {gathered / GB:.1f} | {kv_ / GB:.1f} | "
                  f"{act_ / GB:.1f} / {act_ckpt_ / GB:.1f} | **{peak[0] / GB:.0f} / {peak[1] / GB:.0f}** |")


if __name__ == "__main__":
    main()
