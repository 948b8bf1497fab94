"""Multi-turn search rollouts: rollout.rollout (one KV cache, prefix kept) against a baseline that
re-runs the whole prefix every turn with transformers' generate (how a plain HF loop does it).

Same weights, same questions, same turn structure: B questions x G samples, sampled at
temperature 1, up to --turns searching turns plus a final one, --cap tokens per turn, a real BM25
index over a small generated corpus. Random weights rarely write a closed tag, so most turns end
as invalid actions and get the injected message: the same cache-extension path as the retrieved
documents. The baseline runs the identical protocol loop (rollout.py's parsing, retrieval and
message) around transformers' generate. Generated tokens/s counts policy tokens only.

    python bench/bench_rollout.py --tokenizer PATH/tokenizer.json [--shapes tiny,0.5b]
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import Qwen2, Qwen2Config, save  # noqa: E402
from tokenizer import QWEN2_CHAT_TEMPLATE, Tokenizer  # noqa: E402
import index_build  # noqa: E402
import retriever  # noqa: E402
from rollout import ACTION, INVALID, STOP_STRINGS, make_prompt, observation, rollout  # noqa: E402
from common import SHAPES  # noqa: E402  (bench/common.py)
from rollout import RolloutConfig  # noqa: E402

QUESTIONS = ["who founded the city of paris", "where was ada lovelace born", "which river flows through tokyo",
             "when was the company founded", "who wrote the book about rivers", "what is the capital of the country",
             "in which year was alan turing born", "which mountain is the highest in the world"]


def baseline(hf, hf_tok, tok, index, questions, G, turns, cap, max_obs):
    """The protocol loop with the whole prefix re-encoded by transformers' generate every turn."""
    rows = [tok.encode(tok.chat_prompt(make_prompt(q))) for q in questions for _ in range(G)]
    active, n_gen = list(range(len(rows))), 0
    for turn in range(turns + 1):
        if not active:
            break
        T = max(len(rows[i]) for i in active)
        ids = torch.zeros(len(active), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, i in enumerate(active):
            ids[j, T - len(rows[i]):] = torch.tensor(rows[i])
            mask[j, T - len(rows[i]):] = 1
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=True, top_k=0, temperature=1.0,
                              max_new_tokens=cap, eos_token_id=tok.eos_ids, pad_token_id=tok.pad_id,
                              stop_strings=list(STOP_STRINGS), tokenizer=hf_tok)
        still = []
        for j, i in enumerate(active):
            new = out[j, T:].tolist()
            while new and new[-1] == tok.pad_id:
                new.pop()
            n_gen += len(new)
            rows[i] = rows[i] + new
            m = ACTION.search(tok.decode(new))
            if (m and m.group(1) == "answer") or turn == turns:
                continue
            if m:
                hits = index.search([m.group(2)], 3)[0]
                rows[i] += tok.encode(observation([index.doc(d) for d, _ in hits]))[:max_obs]
            else:
                rows[i] += tok.encode(INVALID)
            still.append(i)
        active = still
    return n_gen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=os.environ.get("QWEN_TOKENIZER"))
    ap.add_argument("--shapes", default="tiny,0.5b")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--G", type=int, default=5)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--cap", type=int, default=32)
    args = ap.parse_args()
    import transformers
    tok = Tokenizer(args.tokenizer, chat_template=QWEN2_CHAT_TEMPLATE)  # random weights: any template
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=args.tokenizer)
    tmp = tempfile.mkdtemp()
    with open(os.path.join(tmp, "c.jsonl"), "w") as f:
        for i in range(2000):
            f.write(json.dumps({"id": i, "contents": f'"Doc {i}"\n' + " ".join(QUESTIONS[i % 8].split()[j % 5] for j in range(i % 50 + 20))}) + "\n")
    index_build.build_index(os.path.join(tmp, "c.jsonl"), os.path.join(tmp, "idx"))
    index = retriever.load_index(os.path.join(tmp, "idx"))
    table = []
    for shape in args.shapes.split(","):
        cfg = dict(SHAPES[shape], vocab_size=151936)
        torch.manual_seed(0)
        ours = Qwen2(Qwen2Config(**cfg)).eval()
        folder = os.path.join(tmp, shape)
        save(ours, tok, folder)
        hf = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        qs = QUESTIONS[:args.B]
        t0 = time.perf_counter()
        trajs = rollout(ours, tok, index, qs, args.G, RolloutConfig(max_turns=args.turns, max_turn_tokens=args.cap, max_obs_tokens=500, top_k=3, temperature=1.0, top_p=1.0), generator=torch.Generator().manual_seed(0))
        t_ours = time.perf_counter() - t0
        n_ours = sum(sum(t.loss_mask) for t in trajs)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        n_ref = baseline(hf, hf_tok, tok, index, qs, args.G, args.turns, args.cap, 500)
        t_ref = time.perf_counter() - t0
        table.append((shape, n_ours, n_ours / t_ours, n_ref, n_ref / t_ref, sum(t.n_search for t in trajs)))
        print(f"  {shape}: ours {t_ours:.1f}s, baseline {t_ref:.1f}s", file=sys.stderr)
    print(f"\nB={args.B}, G={args.G}, {args.turns} turns + final, cap {args.cap} tokens/turn, CPU float32, "
          f"{torch.get_num_threads()} threads\n")
    print("| model | ours tokens | ours tok/s | baseline tokens | baseline tok/s | speed-up | searches (ours) |")
    print("|---|---|---|---|---|---|---|")
    for shape, n1, r1, n2, r2, ns in table:
        print(f"| {shape} | {n1} | {r1:.1f} | {n2} | {r2:.1f} | {r1 / r2:.2f}x | {ns} |")


if __name__ == "__main__":
    main()
