"""BM25 retrieval: retriever.py against bm25s (numpy and numba backends) on the same tokens.

Synthetic corpus: a Zipfian vocabulary (word ranks 1..V drawn with p ~ 1/rank^1.07, V = 300,000
random lowercase strings, Lucene's 33 stopwords as the most frequent words), passages of 80-120
words, FlashRAG JSON lines. Queries: 1,000, each 4-8 words drawn from a random passage (so they
match documents the way questions do). Each system runs in its own process; the table gives
index build time, peak resident memory of that process, and single-process queries/s for top-10
(one thread; the fastest of --repeat passes over all the queries). bm25s is handed the tokens of
retriever.py's analysis (Porter stems), untimed; ours is timed from the query strings with every
query word's stem already cached, so it pays only the lowercasing, the word split and the cache
lookups, which bm25s does not. Then the top-10 of each system is checked against a float64
brute-force BM25 written here (the first --check queries).

With --heavy-head the 50 most frequent words are not stopwords (real questions keep frequent
non-stopwords such as "what", "who", "first", whose postings cover much of the corpus).

With --real, real text from two registry packages instead: the passages are gensim's test copy
of an English Wikipedia dump (206 articles), its markup removed by gensim's own `filter_wiki`,
cut into 100-word passages titled by their article as wiki-18's are; the queries are the 2,503
questions of FanOutQA's dev set (each question and every sub-question of its decomposition),
which the `fanoutqa` package ships.

    pip install bm25s numba gensim && pip install --no-deps fanoutqa   # the peers and the real text
    python bench/bench_retriever.py [--docs 225000] [--queries 1000] [--skip-bm25s] [--heavy-head]
    python bench/bench_retriever.py --real --check 2503
    python bench/bench_retriever.py --docs 2000000 --heavy-head --skip-bm25s-numpy --check 0
"""

import argparse
import bz2
import importlib.util
import json
import math
import multiprocessing as mp
import os
import resource
import string
import sys
import tempfile
import time
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import analysis  # noqa: E402
import index_build  # noqa: E402
import retriever  # noqa: E402


def make_corpus(path, n_docs, seed=0, vocab_size=300_000, heavy_head=False):
    rng = np.random.default_rng(seed)
    letters = np.array(list(string.ascii_lowercase))
    lens = rng.integers(3, 11, vocab_size)
    words = ["".join(rng.choice(letters, n)) for n in lens]
    at = 50 if heavy_head else 0  # heavy head: the 50 most frequent words are not stopwords
    words = words[:at] + sorted(analysis.STOPWORDS) + words[at:]
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.07
    p /= p.sum()
    n_words = rng.integers(80, 121, n_docs)
    ids = rng.choice(len(words), size=int(n_words.sum()), p=p)
    bounds = np.concatenate([[0], np.cumsum(n_words)])
    with open(path, "w") as f:
        for i in range(n_docs):
            ws = [words[j] for j in ids[bounds[i]:bounds[i + 1]]]
            f.write(json.dumps({"id": str(i), "contents": f'"{ws[0].title()} {ws[1]}"\n' + " ".join(ws[2:])}) + "\n")
    queries = []
    for _ in range(1000 * 4):
        d = rng.integers(n_docs)
        seg = ids[bounds[d]:bounds[d + 1]]
        queries.append(" ".join(words[j] for j in rng.choice(seg, rng.integers(4, 9), replace=False)))
    return queries


def real_corpus(path):
    """Wikipedia passages (gensim's test dump) and FanOutQA's dev questions, both from packages."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki
    where = {m: importlib.util.find_spec(m).submodule_search_locations[0] for m in ("gensim", "fanoutqa")}
    dump = os.path.join(where["gensim"], "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
    n = 0
    with open(path, "w") as f:
        for title, text, page in extract_pages(bz2.open(dump), filter_namespaces=("0",)):
            if text.lower().startswith("#redirect"):
                continue
            words = filter_wiki(text).split()
            for i in range(0, len(words), 100):  # 100-word passages, as wiki-18's
                f.write(json.dumps({"id": f"{page}-{i // 100}", "contents": f'"{title}"\n' + " ".join(words[i:i + 100])}) + "\n")
                n += 1
    questions = []

    def walk(q):  # a question, then each sub-question of its decomposition
        questions.append(q["question"])
        for sub in q.get("decomposition") or []:
            walk(sub)

    with open(os.path.join(where["fanoutqa"], "data/fanout-final-dev.json")) as f:
        for q in json.load(f):
            walk(q)
    return n, questions


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best_qps(search, n_queries, repeat):
    """Queries/s of the fastest of `repeat` timed passes over all the queries, and its result."""
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = search()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return n_queries / best, out


def run_ours(corpus, queries, repeat, workers, q):
    idx_dir = os.path.join(os.path.dirname(corpus), "index")
    t0 = time.perf_counter()
    index_build.build_index(corpus, idx_dir)
    build = time.perf_counter() - t0
    index = retriever.load_index(idx_dir)
    index.search(queries[:50], 10)  # warm the page cache
    for s in queries:  # every query word's stem cached, as bm25s is handed the stems untimed
        index.analyzer(s)
    rows = []
    for n in workers:  # worker processes: each maps the index and warms its own stem cache first
        index.search(queries, 10, workers=n)
        qps, hits = best_qps(lambda: index.search(queries, 10, workers=n), len(queries), repeat)
        rows.append((f"ours (numpy), {n} worker{'s' * (n > 1)}", build, peak_rss_mb(), qps,
                     [[i for i, _ in h] for h in hits], index.meta["n_postings"]))
    q.put(rows)


def run_bm25s(corpus, queries, backend, repeat, workers, q):
    import bm25s
    analyze = analysis.Analyzer()  # one cache of stems for the whole corpus
    tokens = [analyze(f"{t} {x}") for _, _, t, x in index_build.read_corpus(corpus)]
    t0 = time.perf_counter()
    ret = bm25s.BM25(method="lucene", k1=0.9, b=0.4, backend=backend)
    ret.index(tokens, show_progress=False)
    build = time.perf_counter() - t0
    del tokens
    qt = [analyze(s) for s in queries]  # our analysis's tokens, untimed
    rows = []
    for n in workers if backend == "numba" else [1]:
        ret.retrieve(qt[:50], k=10, show_progress=False, n_threads=n)  # warm-up (numba compiles)
        qps, (docs, _) = best_qps(lambda: ret.retrieve(qt, k=10, show_progress=False, n_threads=n), len(queries),
                                  repeat)
        rows.append((f"bm25s ({backend}), {n} thread{'s' * (n > 1)}", build, peak_rss_mb(), qps, docs.tolist(), None))
    q.put(rows)


def brute_force_top10(corpus, queries, k1=0.9, b=0.4):
    """Float64 BM25 written from the formula: two streaming passes over the corpus (document
    lengths and document frequencies, then every document's score for every query), then a full
    sort per query. Memory is one float64 per (query, document), never the corpus."""
    analyze = analysis.Analyzer()
    holders = {}  # query word -> [(query, how often it occurs there)]
    for i, s in enumerate(queries):
        for w, c in Counter(analyze(s)).items():
            holders.setdefault(w, []).append((i, c))
    wanted = set(holders)
    dl, df = [], Counter()
    for _, _, t, x in index_build.read_corpus(corpus):
        toks = analyze(f"{t} {x}")
        dl.append(len(toks))
        df.update(wanted.intersection(toks))
    n, avgdl = len(dl), sum(dl) / len(dl)
    idf = {w: math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5)) for w in wanted}
    score = np.zeros((len(queries), n))
    for d, (_, _, t, x) in enumerate(index_build.read_corpus(corpus)):
        tf = Counter(w for w in analyze(f"{t} {x}") if w in wanted)
        for w, f in sorted(tf.items()):  # one order for every document: true ties stay exact ties
            s = idf[w] * f * (k1 + 1) / (f + k1 * (1 - b + b * dl[d] / avgdl))
            for i, c in holders[w]:
                score[i, d] += c * s
    out = []
    for row in score:
        top = np.lexsort((np.arange(n), -row))[:10]
        out.append([int(i) for i in top if row[i] > 0])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=225_000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--skip-bm25s", action="store_true")
    ap.add_argument("--skip-bm25s-numpy", action="store_true", help="bm25s-numba only (numpy takes long at 2M)")
    ap.add_argument("--heavy-head", action="store_true", help="the 50 most frequent words are not stopwords")
    ap.add_argument("--real", action="store_true", help="Wikipedia passages and FanOutQA questions (see above)")
    ap.add_argument("--check", type=int, default=200, help="queries checked against brute force")
    ap.add_argument("--repeat", type=int, default=3, help="timed passes over the queries; the fastest counts")
    ap.add_argument("--workers", default="1", help="ours: search worker processes; bm25s-numba: n_threads (e.g. 1,2)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    corpus = os.path.join(tmp, "corpus.jsonl")
    t0 = time.perf_counter()
    if args.real:
        args.docs, queries = real_corpus(corpus)
    else:
        queries = make_corpus(corpus, args.docs, heavy_head=args.heavy_head)[: args.queries]
    print(f"corpus: {args.docs:,} passages, {os.path.getsize(corpus) / 1e6:.0f} MB, made in "
          f"{time.perf_counter() - t0:.0f}s", file=sys.stderr)
    ctx = mp.get_context("spawn")
    workers = [int(n) for n in args.workers.split(",")]
    jobs = [(run_ours, (corpus, queries, args.repeat, workers))]
    if not args.skip_bm25s:
        if not args.skip_bm25s_numpy:
            jobs.append((run_bm25s, (corpus, queries, "numpy", args.repeat, workers)))
        try:
            import numba  # noqa: F401
            jobs.append((run_bm25s, (corpus, queries, "numba", args.repeat, workers)))
        except ImportError:
            print("numba not installed: bm25s-numba skipped", file=sys.stderr)
    results = []
    for fn, a in jobs:
        q = ctx.Queue()
        p = ctx.Process(target=fn, args=(*a, q))
        p.start()
        results += q.get()
        p.join()
        print(f"  {results[-1][0]} done", file=sys.stderr)
    bf = brute_force_top10(corpus, queries[: args.check]) if args.check else []
    ours = results[0]
    print(f"\n{args.docs:,} passages, {ours[5]:,} postings, {len(queries)} queries, top-10\n")
    print("| system | build s | peak RSS MB | queries/s | top-10 = brute force |")
    print("|---|---|---|---|---|")
    for name, build, rss, qps, top, _ in results:
        same = sum(t[:len(w)] == w for t, w in zip(top, bf))
        print(f"| {name} | {build:.1f} | {rss:.0f} | {qps:,.0f} | {same}/{len(bf)} |")
    for mine in (r for r in results if r[0].startswith("ours")):
        n = mine[0].split(", ")[1].split()[0]  # worker count: compared with the peers' same thread count
        for name, _, _, qps, _, _ in results:
            if not name.startswith("ours") and (name.endswith(f", {n} thread{'s' * (n != '1')}")):
                print(f"{mine[0]} / {name} queries/s: {mine[3] / qps:.2f}x")
    ours_by_n = {r[0]: r[3] for r in results if r[0].startswith("ours")}
    if len(ours_by_n) > 1:
        base = results[0][3]
        print("ours, speed-up over 1 worker: " + ", ".join(f"{k.split(', ')[1]} {v / base:.2f}x" for k, v in ours_by_n.items()))


if __name__ == "__main__":
    main()
