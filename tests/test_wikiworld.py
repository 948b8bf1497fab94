"""worlds/wikiworld.py: real FanOutQA questions over real Wikipedia lead sections, from the two data packages."""

import json
import os

import pytest

import rollout
from conftest import needs_wiki_packages
from worlds import wikiworld
from retriever import load_index



@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("wiki"))
    return d, wikiworld.write_wiki_world(d)


@needs_wiki_packages
def test_counts_and_files(world):
    """10,033 articles in ~100-word passages, 132 standalone string-answer questions, world.json last."""
    d, info = world
    assert info["articles"] == 10033 and info["passages"] >= info["articles"] and info["questions"] == 132
    assert json.load(open(os.path.join(d, "world.json"))) == json.loads(json.dumps(info))
    lengths = [len(json.loads(line)["contents"].split("\n", 1)[1].split()) for line in open(os.path.join(d, "corpus.jsonl"))]
    assert max(lengths) < wikiworld.PASSAGE_WORDS + wikiworld.PASSAGE_WORDS // 2  # what passages() promises


@pytest.mark.parametrize("n", [0, 1, 49, 50, 99, 100, 101, 149, 150, 151, 249, 250, 333])
def test_passages_keep_every_word_within_their_bound(n):
    """passages(): every word kept in order; each passage under 1.5x the length, all but the last
    exactly the length, and a short tail joins the passage before it."""
    words = [f"w{i}" for i in range(n)]
    got = wikiworld.passages(" ".join(words), words=100)
    assert " ".join(got).split() == words
    lengths = [len(p.split()) for p in got]
    assert all(x == 100 for x in lengths[:-1]) and all(0 < x < 150 for x in lengths)
    assert len(got) == (0 if n == 0 else max(1, n // 100 + (n % 100 >= 50)))


@needs_wiki_packages
def test_questions_stand_alone(world):
    """Every test question is FlashRAG-shaped with one gold string and its evidence page named."""
    d, info = world
    qs = [json.loads(line) for line in open(os.path.join(d, "test.jsonl"))]
    assert len(qs) == info["questions"] and len({q["question"] for q in qs}) == len(qs)
    assert all(len(q["golden_answers"]) == 1 and q["golden_answers"][0] for q in qs)
    assert sum(q["evidence_title"] is None for q in qs) <= 3  # FanOutQA names the evidence of all but 3
    assert sum(q["evidence_in_corpus"] for q in qs) == info["evidence_in_corpus"] > 0


@needs_wiki_packages
def test_followups_are_the_other_sub_questions(world):
    """followups.jsonl holds the 1,115 dependent string-answer sub-questions, none of them a test question."""
    d, info = world
    test = {json.loads(line)["question"] for line in open(os.path.join(d, "test.jsonl"))}
    more = [json.loads(line) for line in open(os.path.join(d, "followups.jsonl"))]
    assert len(more) == info["followups"] == 1115 and {q["type"] for q in more} == {"fanoutqa-followup"}
    assert len({q["question"] for q in more}) == len(more) and not test & {q["question"] for q in more}
    assert all(len(q["golden_answers"]) == 1 and q["golden_answers"][0] for q in more)


@needs_wiki_packages
def test_titles_are_written_as_wiki18_writes_them(world):
    """A passage's first line is its quoted title, and an observation shows it as the corpus writes it."""
    d, _ = world
    first = json.loads(open(os.path.join(d, "corpus.jsonl")).readline())["contents"]
    assert first.startswith('"') and first.split("\n")[0].endswith('"')
    index = load_index(os.path.join(d, "index"))
    hits = index.search(["Which is the largest continent"], 3)[0]
    obs = rollout.observation([index.doc(i) for i, _ in hits])
    assert obs.startswith(rollout.INFO_OPEN + 'Doc 1(Title: "')


@needs_wiki_packages
def test_bm25_finds_the_evidence(world):
    """BM25 puts the evidence page in the top 3 for most questions whose page the corpus holds."""
    assert world[1]["evidence_at_3"] >= 0.6  # measured 0.825 (33 of 40)
