"""retriever.py against a brute-force float64 BM25 written here, and bm25s when installed."""

import json
import math
import os
import random

import numpy as np
import pytest

import analysis

import index_build

import retriever

WORDS = [f"w{i}" for i in range(60)] + ["Paris", "paris", "Élodie", "river", "the", "of"]


def write_corpus(path, n=120, seed=0, title_text=False):
    rng = random.Random(seed)
    docs = []
    with open(path, "w") as f:
        for i in range(n):
            title = f"Title {rng.choice(WORDS)}"
            text = " ".join(rng.choice(WORDS[: 10 + i % 50]) for _ in range(rng.randint(1, 30)))
            docs.append((title, text))
            rec = {"id": str(i), "title": title, "text": text} if title_text else \
                {"id": str(i), "contents": f'"{title}"\n{text}'}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return docs


def brute_force(docs, query, k1=0.9, b=0.4):
    """Lucene BM25 in float64, straight from the formula, for every document."""
    toks = [analysis.analyze(f"{t} {x}") for t, x in docs]
    N, avgdl = len(toks), sum(map(len, toks)) / len(toks)
    out = []
    for d in toks:
        s = 0.0
        for q in analysis.analyze(query):
            df = sum(q in t for t in toks)
            tf = d.count(q)
            if tf:
                idf = math.log(1 + (N - df + 0.5) / (df + 0.5))
                s += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(d) / avgdl))
        out.append(s)
    return out


@pytest.fixture
def small(tmp_path):
    docs = write_corpus(tmp_path / "c.jsonl")
    index_build.build_index(str(tmp_path / "c.jsonl"), str(tmp_path / "idx"), chunk_docs=17)  # several runs
    return docs, retriever.load_index(str(tmp_path / "idx"))


QUERIES = ["w1 w2 w3", "paris river", "Élodie w40 w40", "w7", "the of w55 w12 w3 w9"]


def test_scores_equal_brute_force(small):
    """Every document's score equals float64 BM25 (<= 1e-5 relative); top-k order is exact."""
    docs, index = small
    for q in QUERIES:
        want = brute_force(docs, q)
        got = dict(index.search([q], len(docs))[0])
        for i, w in enumerate(want):
            assert abs(got.get(i, 0.0) - w) <= 1e-5 * max(1.0, abs(w))
        order = sorted((i for i, w in enumerate(want) if w > 0), key=lambda i: (-want[i], i))
        assert [i for i, _ in index.search([q], 10)[0]] == order[:10]


def test_title_text_lines_and_format_docs(tmp_path):
    """{"title","text"} lines index like "contents" lines; format_docs is Search-R1's block."""
    docs = write_corpus(tmp_path / "c.jsonl", n=30, title_text=True)
    index_build.build_index(str(tmp_path / "c.jsonl"), str(tmp_path / "idx"))
    index = retriever.load_index(str(tmp_path / "idx"))
    assert index.doc(3) == docs[3]
    assert retriever.format_docs([("A", "x y"), ("B", "z")]) == "Doc 1(Title: A) x y\nDoc 2(Title: B) z\n"


def test_stopword_and_unknown_queries_are_empty(small):
    """A query of only stopwords or unknown words returns no documents."""
    _, index = small
    assert index.search(["the of and", "zzzz qqqq", ""], 3) == [[], [], []]


def test_k_larger_than_corpus(small):
    """k beyond the corpus returns every matching document once, best first."""
    docs, index = small
    hits = index.search(["w1"], 10_000)[0]
    assert len(hits) == len({i for i, _ in hits}) == sum(s > 0 for s in brute_force(docs, "w1"))


def test_ties_break_to_lower_index(tmp_path):
    """Identical documents tie and come back in index order."""
    with open(tmp_path / "c.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"id": i, "contents": '"T"\nalpha beta' if i % 2 else '"U"\ngamma'}) + "\n")
    index_build.build_index(str(tmp_path / "c.jsonl"), str(tmp_path / "idx"))
    assert [i for i, _ in retriever.load_index(str(tmp_path / "idx")).search(["alpha"], 2)[0]] == [1, 3]


def test_empty_corpus_is_an_error(tmp_path):
    """An empty corpus fails naming the file and leaves no index behind."""
    (tmp_path / "c.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="c.jsonl: the corpus has no documents"):
        index_build.build_index(str(tmp_path / "c.jsonl"), str(tmp_path / "idx"))
    assert not os.path.exists(tmp_path / "idx") and not os.path.exists(tmp_path / "idx.tmp")


def test_malformed_line_names_file_and_line(tmp_path):
    """A broken JSON line is an error naming file:line."""
    write_corpus(tmp_path / "c.jsonl", n=5)
    with open(tmp_path / "c.jsonl", "a") as f:
        f.write('{"id": "x", "contents": \n')
    with pytest.raises(ValueError, match=r"c.jsonl:6: malformed"):
        index_build.build_index(str(tmp_path / "c.jsonl"), str(tmp_path / "idx"))


def test_duplicate_ids_are_an_error(tmp_path):
    """Two documents with one id fail naming the id and both documents."""
    write_corpus(tmp_path / "c.jsonl", n=5)
    with open(tmp_path / "c.jsonl", "a") as f:
        f.write(json.dumps({"id": "2", "contents": '"X"\ny'}) + "\n")
    with pytest.raises(ValueError, match=r"duplicate document id '2' \(documents 3 and 6"):
        index_build.build_index(str(tmp_path / "c.jsonl"), str(tmp_path / "idx"))


@pytest.mark.parametrize("damage", ["meta", "truncate", "remove"])
def test_corrupt_index_is_a_clear_error(small, tmp_path, damage):
    """A missing meta.json, a truncated array or a missing file is an error naming it."""
    idx = tmp_path / "idx"
    if damage == "meta":
        os.remove(idx / "meta.json")
        match = "meta.json"
    elif damage == "truncate":
        data = (idx / "scores.npy").read_bytes()
        (idx / "scores.npy").write_bytes(data[: len(data) // 2])
        match = "scores.npy"
    else:
        os.remove(idx / "docs.bin")
        match = "docs.bin"
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        retriever.load_index(str(idx))


def test_same_topk_as_bm25s(small):
    """bm25s (method lucene, same k1, b and tokens) ranks the same top-10."""
    bm25s = pytest.importorskip("bm25s")
    docs, index = small
    ref = bm25s.BM25(method="lucene", k1=0.9, b=0.4)
    ref.index([analysis.analyze(f"{t} {x}") for t, x in docs], show_progress=False)
    for q in QUERIES[:4]:
        want, s = ref.retrieve([analysis.analyze(q)], k=10, show_progress=False, n_threads=1)
        got = index.search([q], 10)[0]
        n = sum(s[0] > 0)
        # bm25s omits Lucene's constant (k1 + 1) factor; compare scores and the ranked set
        assert np.allclose([v for _, v in got][:n], s[0][:n] * 1.9, rtol=1e-5)
        assert sorted(i for i, _ in got[:n]) == sorted(want[0][:n].tolist())


def test_pruned_topk_equals_brute_force_on_random_queries(small):
    """MaxScore pruning never changes the top-k: 200 random queries, k = 1, 3 and 10."""
    docs, index = small
    rng = random.Random(1)
    vocab = [w.lower() for w in WORDS if w.lower() not in analysis.STOPWORDS] + ["title"]
    for n in range(200):
        q = " ".join(rng.choice(vocab[:12] if i % 2 else vocab) for i in range(rng.randint(1, 6)))
        want = brute_force(docs, q)
        order = sorted((i for i, w in enumerate(want) if w > 0), key=lambda i: (-want[i], i))
        for k in (1, 3, 10):
            got = index.search([q], k)[0]
            assert [i for i, _ in got] == order[:k], (q, k)
            assert all(abs(s - want[i]) <= 1e-5 * max(1, want[i]) for i, s in got)


def test_workers_give_the_same_hits(small):
    """A batch split over 2 worker processes returns exactly one worker's hits, in order."""
    _, index = small
    rng = random.Random(2)
    vocab = [w.lower() for w in WORDS if w.lower() not in analysis.STOPWORDS]
    queries = [" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 5))) for _ in range(57)] + ["the", ""]
    want = index.search(queries, 3)
    assert index._pool is None  # one worker: searched in this process
    assert index.search(queries, 3, workers=2) == want
    assert index._pool_size == 2 and index._pool._processes == 2  # the batch went to a pool of 2
    assert index.search(queries, 10, workers=3) == index.search(queries, 10)  # another pool size
    assert index._pool_size == 3 and index._pool._processes == 3
    assert index.search(queries[:3], 3, workers=2) == want[:3]  # a batch too small to split
