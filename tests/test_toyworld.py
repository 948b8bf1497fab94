"""worlds/toyworld.py and worlds/toyagent.py: determinism, disjoint splits, answerability, the scripted agent, the backbone."""

import filecmp
import json
import os
import random

import pytest
import torch

from eval import evaluate, summarize
from model import load
import ofsd
import retriever
import rollout
from worlds import toyagent
from worlds import toyworld
from rollout import RolloutConfig


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("world"))
    toyworld.write_world(d, seed=3)
    return d


def test_same_seed_same_bytes(world, tmp_path):
    """The same seed writes byte-identical corpus and questions; another seed does not."""
    toyworld.write_world(str(tmp_path / "a"), seed=3)
    toyworld.write_world(str(tmp_path / "b"), seed=4)
    for f in ("corpus.jsonl", "train.jsonl", "test.jsonl"):
        assert filecmp.cmp(os.path.join(world, f), tmp_path / "a" / f, shallow=False)
        assert not filecmp.cmp(os.path.join(world, f), tmp_path / "b" / f, shallow=False)


def test_ensure_rebuilds_a_world_of_another_seed(tmp_path):
    """ensure() reuses a world built with the same seed and rewrites one built with another."""
    d = str(tmp_path / "w")
    toyagent.ensure(d, 3, 3, world_only=True)
    first = os.path.getmtime(os.path.join(d, "world.json"))
    toyagent.ensure(d, 3, 3, world_only=True)
    assert os.path.getmtime(os.path.join(d, "world.json")) == first
    toyagent.ensure(d, 4, 3, world_only=True)
    assert json.load(open(os.path.join(d, "world.json")))["seed"] == 4
    assert toyworld.read_jsonl(os.path.join(d, "test.jsonl")) == toyworld.make_questions(toyworld.make_world(4), 4)[1]


def test_splits_share_no_subject(world):
    """No subject entity appears in both train and test; every type is in the test split."""
    train, test = (toyworld.read_jsonl(os.path.join(world, f"{s}.jsonl")) for s in ("train", "test"))
    subj = lambda qs: {s for q in qs for s in q["subjects"]}  # noqa: E731
    assert not subj(train) & subj(test)
    assert {q["type"] for q in test} == set(toyworld.TYPES) and len(test) > 100


def test_every_question_is_answerable(world):
    """Each hop's canonical query (the entity's name) brings its passage, holding the hop's answer,
    into BM25's top 3; the last hop's answer is the gold answer (comparisons: the earlier-born)."""
    index = retriever.load_index(os.path.join(world, "index"))
    for split in ("train", "test"):
        for q in toyworld.read_jsonl(os.path.join(world, f"{split}.jsonl")):
            for entity, answer in q["hops"]:
                docs = [index.doc(i) for i, _ in index.search([entity], 3)[0]]
                assert any(t == entity and answer in x for t, x in docs), (q["question"], entity)
            if q["type"] == "comparison":
                (a, ya), (b, yb) = q["hops"]
                assert q["golden_answers"] == [a if int(ya) < int(yb) else b]
            else:
                assert q["golden_answers"] == [q["hops"][-1][1]]


def test_scripted_agent_uses_the_protocol(world):
    """Scripted trajectories use Search-R1's tags and document block, and are mostly correct."""
    index = retriever.load_index(os.path.join(world, "index"))
    rng = random.Random(0)
    train = toyworld.read_jsonl(os.path.join(world, "train.jsonl"))[:200]
    correct, searches = 0, 0
    for q in train:
        turns, obs = toyagent.scripted_turns(q, index, rng, 3)
        assert all("<search>" in t for t in turns[:-1]) and "<answer>" in turns[-1]
        assert all(o.startswith(rollout.INFO_OPEN + "Doc 1(Title: ") and o.endswith(rollout.INFO_CLOSE) for o in obs)
        correct += rollout.extract_answer(turns[-1]) in q["golden_answers"]
        searches += len(obs) - len(q["hops"])
    assert 0.6 < correct / len(train) < 0.95  # imperfect, as designed
    assert searches > 0  # some wasteful repeats


def test_scripted_agent_follows_its_plan(world):
    """The first think plans one step per hop (or only the first, on early multi-hop answers), and
    the agent takes exactly the planned steps, each quote naming the next one, then answers."""
    index = retriever.load_index(os.path.join(world, "index"))
    rng = random.Random(1)
    early = 0
    for q in toyworld.read_jsonl(os.path.join(world, "train.jsonl"))[:200]:
        turns, _ = toyagent.scripted_turns(q, index, rng, 3)
        plan = turns[0].split("<think> I need ", 1)[1].split(". </think>", 1)[0].split(", then ")
        assert len(plan) == len(q["hops"]) or (len(plan) == 1 and q["type"] in ("bridge", "three_hop"))
        early += len(plan) < len(q["hops"])
        nexts = [t.split(". </think>")[0] for t in "".join(turns).split(" Next: ")[1:]]
        assert nexts == plan[1:] + ["the answer"]
    assert early > 0


def test_reading_example_repeats_a_correct_sampled_reference(world):
    """reference="sampled" (the reading phase): the prompt shows a correct sample as a rollout records
    it (no end-of-turn id) in OFSD's teacher wording, and the agent's turns repeat it exactly."""
    _, tok = load(toyagent.SHIPPED)
    index = retriever.load_index(os.path.join(world, "index"))
    rng = random.Random(2)
    header = ofsd.FULL.split("{tau_ref}")[0]
    for q in toyworld.read_jsonl(os.path.join(world, "train.jsonl"))[:30]:
        ids, weight = toyagent.scripted_tokens(tok, q, index, rng, 3, reference="sampled")
        first = next(i for i, w in enumerate(weight) if w > 0)  # the agent's first token
        prompt, response = tok.decode(ids[:first]), tok.decode(ids[first:])
        ref = prompt.split(header, 1)[1].rsplit("\n<|im_end|>", 1)[0]
        assert response == ref + "<|im_end|>" and rollout.extract_answer(ref) in q["golden_answers"]


def test_backbone_loads_with_transformers(world, tmp_path):
    """The backbone folder (a 2-step build) is a Qwen2 checkpoint transformers loads identically."""
    transformers = pytest.importorskip("transformers")
    toyagent.build_backbone(world, str(tmp_path / "bb"), seed=0, top_k=3, steps=2, read_steps=2)
    ours, tok = load(str(tmp_path / "bb"))
    ref = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path / "bb"), dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(tok.chat_prompt(rollout.make_prompt("Who founded Kavo Works?")))])
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max() <= 1e-4
    assert tok.decode(ids[0].tolist()).endswith("<|im_start|>assistant\n")
    assert json.load(open(tmp_path / "bb" / "config.json"))["architectures"] == ["Qwen2ForCausalLM"]


# ----------------------------------------------------------------------------------------------
# the shipped backbone (world seed 0): every user starts from the same weights

def test_shipped_backbone_matches_its_hashes():
    """Every shipped backbone file has the sha256 recorded in toyagent.SHIPPED_SHA256."""
    assert set(toyagent.SHIPPED_SHA256) == set(os.listdir(toyagent.SHIPPED))
    for name, want in toyagent.SHIPPED_SHA256.items():
        assert toyagent.file_sha256(os.path.join(toyagent.SHIPPED, name)) == want, name


def test_ensure_copies_the_shipped_backbone(tmp_path):
    """ensure() on world seed 0 copies the shipped backbone (no build) and stamps it."""
    _, backbone = toyagent.ensure(str(tmp_path / "w"), 0, 3)
    assert sorted(os.listdir(backbone)) == sorted(toyagent.SHIPPED_SHA256)
    assert all(toyagent.file_sha256(os.path.join(backbone, n)) == h for n, h in toyagent.SHIPPED_SHA256.items())


def test_damaged_shipped_file_is_refused(tmp_path, monkeypatch):
    """A shipped file whose hash does not match is an error naming it; nothing is installed."""
    monkeypatch.setitem(toyagent.SHIPPED_SHA256, "model.safetensors", "0" * 64)
    with pytest.raises(ValueError, match="model.safetensors: sha256"):
        toyagent.install_shipped(str(tmp_path / "bb"))
    assert not (tmp_path / "bb").exists()


def test_shipped_backbone_gives_the_readme_start_row(tmp_path):
    """Greedy test EM of the shipped backbone is the README's starting row (0.379, +-2 questions)."""
    world, backbone = toyagent.ensure(str(tmp_path / "w"), 0, 3)
    model, tok = load(backbone)
    test = toyworld.read_jsonl(os.path.join(world, "test.jsonl"))
    res = evaluate(model, tok, retriever.load_index(os.path.join(world, "index")), test,
                   RolloutConfig(max_turns=4, max_turn_tokens=80, max_obs_tokens=256, top_k=3), 128)
    assert abs(summarize(res)["all"]["em"] - 0.379) <= 2 / len(test)


@pytest.mark.skipif(not os.environ.get("TOY_REBUILD"), reason="set TOY_REBUILD=1: a 5-minute backbone build")
def test_rebuild_matches_the_shipped_backbone(tmp_path):
    """build_backbone on world seed 0 gives greedy test EM within 0.03 of the shipped backbone's."""
    world, shipped = toyagent.ensure(str(tmp_path / "w"), 0, 3)
    toyagent.build_backbone(world, str(tmp_path / "built"), seed=0, top_k=3)
    test = toyworld.read_jsonl(os.path.join(world, "test.jsonl"))
    index = retriever.load_index(os.path.join(world, "index"))
    cfg = RolloutConfig(max_turns=4, max_turn_tokens=80, max_obs_tokens=256, top_k=3)
    em = [summarize(evaluate(*load(d), index, test, cfg, 128))["all"]["em"] for d in (shipped, str(tmp_path / "built"))]
    print(f"greedy test EM: shipped {em[0]:.3f}, rebuilt {em[1]:.3f}")
    assert abs(em[0] - em[1]) <= 0.03
