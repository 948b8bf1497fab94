"""Batched KV-cache generation: model.generate against transformers' generate, same weights.

Random models shaped like Qwen2.5-0.5B (24 layers, d 896, 14/2 heads, V 151,936) and a tiny
one; CPU float32; prompt 256 tokens, 128 new tokens, greedy; batch 1 and 8. Prints tokens/s
(new tokens over the whole call, prefill included) and whether both produced the same tokens.

    python bench/bench_generate.py [--shapes 0.5b,tiny] [--batches 1,8] [--new 128] [--prompt 256]
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from generate import generate  # noqa: E402
from common import SHAPES  # noqa: E402  (bench/common.py)
from model import Qwen2, Qwen2Config, save  # noqa: E402
import tokenizer  # noqa: E402

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0.5b,tiny")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    args = ap.parse_args()
    import transformers

    tmp = tempfile.mkdtemp()
    tok = tokenizer.Tokenizer.train(["the search engine returns documents"] * 10, 300, os.path.join(tmp, "tok.json"))
    rows = []
    for shape in args.shapes.split(","):
        torch.manual_seed(0)
        ours = Qwen2(Qwen2Config(**SHAPES[shape]))
        with torch.no_grad():
            for n, p in ours.named_parameters():
                if not n.endswith("norm.weight"):
                    p.normal_(0, 0.02)
        ours.eval()
        folder = os.path.join(tmp, shape)
        save(ours, tok, folder)
        ref = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for b in map(int, args.batches.split(",")):
            prompts = torch.randint(0, SHAPES[shape]["vocab_size"], (b, args.prompt),
                                    generator=torch.Generator().manual_seed(b))
            t0 = time.perf_counter()
            got, _, _ = generate(ours, tok, prompts.tolist(), args.new, stop_ids=[])
            t_ours = time.perf_counter() - t0
            t0 = time.perf_counter()
            with torch.no_grad():
                want = ref.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                    max_new_tokens=args.new, min_new_tokens=args.new,
                                    eos_token_id=None, pad_token_id=0)
            t_ref = time.perf_counter() - t0
            same = got == want[:, args.prompt:].tolist()
            rows.append((shape, b, b * args.new / t_ours, b * args.new / t_ref, same))
            print(f"  {shape} batch {b}: ours {t_ours:.1f}s, transformers {t_ref:.1f}s", file=sys.stderr)
    print(f"\nCPU float32, {torch.get_num_threads()} threads, prompt {args.prompt}, {args.new} new tokens, greedy\n")
    print("| model | batch | ours tok/s | transformers tok/s | speed-up | same tokens |")
    print("|---|---|---|---|---|---|")
    for shape, b, a, r, same in rows:
        print(f"| {shape} | {b} | {a:.1f} | {r:.1f} | {a / r:.2f}x | {same} |")


if __name__ == "__main__":
    main()
