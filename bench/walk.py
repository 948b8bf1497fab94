"""Follow the policy through one GRPO round (1 step, 2 questions x 5) and one ofsd.distill (the pairs of
8 questions) on the toy world, as a reader follows it (#69's walk): sys.setprofile records the first entry
into each repository function that receives the policy object (every function with `all`), and the
sequence of files; prints the distinct files visited and the returns into another file. Runs on a
checkout from before #69 too (settings by name), so a walk can be compared with ec249f5's.

    python3 bench/walk.py .            # or a worktree of another commit
"""
import os, sys, random
REPO = os.path.abspath(sys.argv[1]); ALL = len(sys.argv) > 2; sys.path.insert(0, REPO); os.chdir(REPO)
import torch
torch.set_num_threads(1)
import evolve, grpo, ofsd, lora
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from common import group as settings  # evolve.settings before it moved
try:
    from eval import read_questions
except ImportError:
    from toyworld import read_jsonl as read_questions
from retriever import load_index
from tokenizer import Tokenizer
try:
    from rollout import RolloutConfig
except ImportError:
    pass
W = "cache/toyworld"
load_policy = getattr(lora, "load_policy", None) or __import__("checkpoint").load_policy  # moved to checkpoint.py (#78)
pol = load_policy(os.path.join(W, "backbone"))[0]
tok = Tokenizer(os.path.join(W, "backbone", "tokenizer.json"))
index = load_index(os.path.join(W, "index"))
train = read_questions(os.path.join(W, "train.jsonl"))
files = {os.path.join(REPO, f) for f in os.listdir(REPO) if f.endswith(".py")}
def walk(fn):
    stack, seq, returns, seen = [], [], 0, set()
    def prof(frame, event, arg):
        nonlocal returns
        f = frame.f_code.co_filename
        if f not in files: return
        if event == "call":
            co = frame.f_code
            args = [frame.f_locals.get(n) for n in co.co_varnames[:co.co_argcount + co.co_kwonlyargcount]]
            if (ALL or any(a is pol for a in args)) and co not in seen and not co.co_name.startswith('<'):
                seen.add(co)
                stack.append((frame, f))
                if not seq or seq[-1] != f: seq.append(f)
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()
            if stack and stack[-1][1] != f:
                returns += 1
                if seq[-1] != stack[-1][1]: seq.append(stack[-1][1])
    sys.setprofile(prof)
    try: fn()
    finally: sys.setprofile(None)
    names = [os.path.basename(x) for x in seq]
    return len(set(names)), returns, names
gen = torch.Generator().manual_seed(0)
rng = random.Random(0)
qs = lambda n: [train[rng.randrange(len(train))] for _ in range(n)]
if hasattr(grpo, "explore"):  # #78: the loop's generator round; the adapter attached and merged by the loop
    import checkpoint
    gcfg = settings(grpo.GRPOConfig, grpo_steps=1, questions_per_step=2, ppo_mini_batch=2)
    ocfg = settings(ofsd.OFSDConfig, ofsd_epochs=1)
    g = lambda: list(evolve.grpo_round(pol, load_policy(os.path.join(W, "backbone"))[0], torch.optim.AdamW(pol.parameters(), lr=1e-4), tok, index, [qs(2)], gcfg, gen, 0))
    def o():
        lesson = ofsd.prepare(pol, tok, pairs, ocfg)
        adapter = lora.attach(pol, ocfg.ofsd_lora_rank, ocfg.ofsd_lora_alpha)
        ofsd.distill(pol, adapter, tok, lesson, ocfg, 0)
        checkpoint.merge_adapter(pol, adapter)
elif hasattr(grpo, "GRPOConfig"):
    gcfg = settings(grpo.GRPOConfig, grpo_steps=1, questions_per_step=2, ppo_mini_batch=2)
    ocfg = settings(ofsd.OFSDConfig, lora_epochs=1)
    g = lambda: grpo.grpo_round(pol, load_policy(os.path.join(W, "backbone"))[0], torch.optim.AdamW(pol.parameters(), lr=1e-4), tok, index, lambda: qs(2), gcfg, gen, 0, log=lambda m: None)
    def o():
        ofsd.distill(pol, tok, pairs, ocfg, seed=0)
else:
    E = evolve
    rollout_args = dict(max_turns=E.max_turns, max_turn_tokens=E.max_turn_tokens, max_obs_tokens=E.max_obs_tokens,
                        top_k=E.top_k, temperature=E.temperature, top_p=E.top_p)
    g = lambda: grpo.grpo_round(pol, load_policy(os.path.join(W, "backbone"))[0], torch.optim.AdamW(pol.parameters(), lr=1e-4), tok, index, lambda: qs(2),
        steps=1, first_step=0, lr=1e-4, warmup_steps=3, group_size=5, ppo_updates=1, micro_batch=20, clip_ratio=0.2, kl_coef=0.001,
        entropy_coef=0.001, max_grad_norm=1.0, rollout_args=rollout_args, generator=gen, log=lambda m: None)
    def o():
        ofsd.distill(pol, tok, pairs, ofsd_loss="kl", kl_weight=1.0, lora_rank=16, lora_alpha=32, lora_lr=2e-4, lora_epochs=1,
            ofsd_micro_batch=4, tau_clip=0.05, ofsd_clip="vocab", ofsd_context="full", ofsd_positions="policy", max_grad_norm=1.0, kl_chunk=256, seed=0)
rng2 = random.Random(1)
import rollout as _R
_qs = [train[rng2.randrange(len(train))] for _ in range(8)]
if hasattr(grpo, "GRPOConfig"):
    _t = _R.rollout(pol, tok, index, [q["question"] for q in _qs], 5, settings(RolloutConfig, temperature=1.0), torch.Generator().manual_seed(0))
else:
    _t = _R.rollout(pol, tok, index, [q["question"] for q in _qs], 5, generator=torch.Generator().manual_seed(0), **rollout_args)
pairs = ofsd.mine(_t, _qs, 5)
print("pairs", len(pairs))
walks = [("GRPO round", g), ("OFSD round", o)]
if hasattr(grpo, "explore"):  # #78: the method's own calls in a GRPO step, without the loop's generator around them
    def step():
        b = grpo.explore(pol, tok, index, qs(2), gcfg, gen)
        grpo.update(pol, load_policy(os.path.join(W, "backbone"))[0], torch.optim.AdamW(pol.parameters(), lr=1e-4), b,
                    b.token_counts(), gcfg, 1, tok.pad_id)
    walks.insert(1, ("GRPO step, the method's calls (explore, update)", step))
for name, fn in walks:
    n, r, seq = walk(fn)
    print(f"{name}: {n} files, {r} returns up: {' > '.join(seq)}")
