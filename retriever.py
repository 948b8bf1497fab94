"""BM25 retrieval in numpy alone: the search engine the agent calls.

Scoring is Lucene's BM25 (Robertson et al.; the variant Pyserini runs, which Search-R1's BM25
setting used), with k1 = 0.9 and b = 0.4 by default:
    idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))
    s(t, d)     = idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * dl(d) / avgdl))
    score(q, d) = sum over distinct query terms t of count(t in q) * s(t, d)
(repeated query words count once per occurrence, as Pyserini's bag-of-words query does).

Analysis, identical for documents and queries, is Pyserini's default English analysis
(analysis.py: lowercase \\w+ words, Lucene's 33 stopwords, the Porter stem, each distinct word
analysed once). `stem=False` at build skips stemming; meta.json records the analysis, and search
applies the recorded one. dl counts the non-stopword tokens.

The index (index_build.py writes it, in bounded memory) is plain .npy arrays plus meta.json,
memory-mapped at load: postings by term in CSR form with each posting's s(t, d), and each term's
highest s(t, d), the bound that search's MaxScore pruning uses (see Index.search_one).

Defined behaviour: a query with only stopwords or unknown words returns []; only documents
that share a term with the query are returned, so k larger than the corpus returns fewer than k;
ties are broken by lower document index; a missing or inconsistent index file is an error that
names it. `search(queries, k, workers=N)` splits a batch over N worker processes.

Left out: phrase and field queries, dense retrieval, incremental index updates.

    python retriever.py build CORPUS.jsonl INDEX_DIR
    python retriever.py search INDEX_DIR "who founded the city of Paris" [-k 3]
"""

import argparse
import json
import multiprocessing
import os
import weakref

import numpy as np

from analysis import Analyzer
from index_build import FORMAT_VERSION, build_index


def format_docs(docs):
    """Search-R1's observation block for a list of (title, text)."""
    return "".join(f"Doc {i}(Title: {title}) {text}\n" for i, (title, text) in enumerate(docs, 1))


# ----------------------------------------------------------------------------------------------
# search

def kth_best(vals, k):
    """The k-th largest entry of vals (1 <= k <= len(vals)), by partition, without a sort."""
    return np.partition(vals, len(vals) - k)[len(vals) - k]


class Index:
    """A loaded, memory-mapped BM25 index; see `load_index`."""

    def __init__(self, index_dir):
        index_dir = index_dir.rstrip("/")
        meta_path = os.path.join(index_dir, "meta.json")
        if not os.path.exists(index_dir) and os.path.isfile(os.path.join(index_dir + ".old", "meta.json")):
            raise FileNotFoundError(
                f"{index_dir}: missing; a rebuild was interrupted between its renames: the previous index "
                f"is whole at {index_dir}.old (and the new one at {index_dir}.tmp when it holds meta.json): "
                f"rename one of them to {index_dir}")
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{index_dir}: not a BM25 index (meta.json missing)")
        try:
            with open(meta_path) as f:
                self.meta = meta = json.load(f)
            if meta.get("format") != FORMAT_VERSION:
                raise ValueError(f"index format {meta.get('format')}, expected {FORMAT_VERSION} (format 2 stored titles "
                                 "without their quotes, format 1 recorded no analysis): rebuild it with `python retriever.py build "
                                 f"{meta.get('corpus', 'CORPUS.jsonl')} {index_dir}`")
            if meta.get("analysis", {}).get("stemmer") not in ("porter", None):
                raise ValueError(f"unknown stemmer {meta['analysis'].get('stemmer')!r}")
            for key in ("n_terms", "n_postings", "n_docs"):
                if not isinstance(meta.get(key), int):
                    raise ValueError(f"field {key!r} missing or not an integer")
        except (json.JSONDecodeError, AttributeError, ValueError) as e:
            raise ValueError(f"{meta_path}: not a valid index meta.json ({e})") from None
        arrays = {}
        want = {"indptr": meta["n_terms"] + 1, "term_max": meta["n_terms"], "docs": meta["n_postings"], "scores": meta["n_postings"],
                "doc_offsets": 3 * meta["n_docs"] + 1, "vocab_offsets": meta["n_terms"] + 1}
        for name, n in want.items():
            path = os.path.join(index_dir, name + ".npy")
            try:
                arrays[name] = np.load(path, mmap_mode="r")
            except (OSError, ValueError, EOFError) as e:
                raise ValueError(f"{path}: missing or corrupt index array ({type(e).__name__}: {e})") from None
            if arrays[name].shape != (n,):
                raise ValueError(f"{path}: shape {arrays[name].shape}, meta.json says ({n},)")
        self.indptr = np.asarray(arrays["indptr"])
        self.term_max = np.asarray(arrays["term_max"]).tolist()  # floats: MaxScore's per-term bounds
        # plain ndarray views of the maps (no copy): slicing a np.memmap costs a subclass hook per call
        self.docs, self.scores = np.asarray(arrays["docs"]), np.asarray(arrays["scores"])
        self.doc_offsets = arrays["doc_offsets"]
        if self.indptr[-1] != meta["n_postings"]:
            raise ValueError(f"{index_dir}/indptr.npy: ends at {self.indptr[-1]}, expected {meta['n_postings']}")
        for name, off in (("docs.bin", self.doc_offsets[-1]), ("vocab.bin", arrays["vocab_offsets"][-1])):
            if os.path.getsize(os.path.join(index_dir, name)) != off:
                raise ValueError(f"{index_dir}/{name}: size {os.path.getsize(os.path.join(index_dir, name))}, expected {off}")
        self.blob = np.memmap(os.path.join(index_dir, "docs.bin"), dtype=np.uint8, mode="r")
        with open(os.path.join(index_dir, "vocab.bin"), "rb") as f:
            raw = f.read()
        vo = arrays["vocab_offsets"].tolist()
        self.vocab = {raw[vo[i]:vo[i + 1]].decode("utf-8"): i for i in range(meta["n_terms"])}
        self.n_docs = meta["n_docs"]
        self.index_dir = index_dir
        self._pool, self._pool_size = None, 0  # search worker processes, started on first use
        self.analyzer = Analyzer(stem=meta["analysis"]["stemmer"] == "porter")  # the build's analysis
        self._acc = np.zeros(self.n_docs)  # float64 score accumulator, all-zero between queries

    def __len__(self):
        return self.n_docs

    def _field(self, i, j):
        o = self.doc_offsets
        return bytes(self.blob[o[3 * i + j]:o[3 * i + j + 1]]).decode("utf-8")

    def doc(self, i):
        """(title, text) of document i."""
        return self._field(i, 1), self._field(i, 2)

    def doc_id(self, i):
        return self._field(i, 0)

    def search_one(self, query, k):
        """Top-k (doc index, score) for one query string, best first, ties to the lower index.

        Term at a time into a dense float64 accumulator, rarest term (highest bound) first, with
        MaxScore pruning (Turtle and Flood 1995) so that frequent words cost little: each term's
        bound is ub = count * its highest score; before a long postings list, theta = a score that
        at least k documents already reach (the k * terms-th best accumulated entry). Once the bounds of
        the terms left sum below theta, no document outside the candidates can enter the top k:
        those "lazy" terms are not scattered; the candidates that cannot reach theta even with
        them are dropped, and the rest look them up by binary search in the terms' doc-sorted
        postings. Bounds are strict (1e-6 of slack for float32 scores), so the top k is exact."""
        counts = {}
        for w in self.analyzer(query):
            t = self.vocab.get(w)
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
        if not counts or k <= 0:
            return []
        ub = {t: c * self.term_max[t] for t, c in counts.items()}  # the most a term adds to a score
        terms = sorted(counts.items(), key=lambda tc: -ub[tc[0]])  # highest bound (rarest) first
        acc, parts, lazy_ub, n_cand = self._acc, [], sum(ub.values()), 0
        for t, c in terms:
            lo, hi = self.indptr[t], self.indptr[t + 1]
            m = k * len(parts)  # a document repeats at most len(parts) times among the parts
            if parts and hi - lo > 2 * n_cand and n_cand >= m:  # a long list next: is it still needed?
                vals = acc.take(np.concatenate(parts))
                theta = kth_best(vals, m)  # >= k documents score at least this
                if lazy_ub < theta * (1 - 1e-6):  # the terms left cannot lift a new document to the top k
                    break
            d = self.docs[lo:hi].astype(np.intp)  # (df,) each document once; intp: 2x faster indexing
            np.add.at(acc, d, self.scores[lo:hi].astype(np.float64) * c)  # one dtype: ufunc.at's fast path
            parts.append(d)
            lazy_ub -= ub[t]
            n_cand += hi - lo
        lazy = terms[len(parts):]
        cand = parts[0] if len(parts) == 1 else np.concatenate(parts)  # (P,) docs, repeats allowed
        vals = acc.take(cand)
        acc[cand] = 0.0
        m = k * len(parts)
        if len(vals) > m:  # the m-th best entry: k documents score at least that
            thresh = kth_best(vals, m)
            keep = vals + lazy_ub >= thresh * (1 - 1e-6) if lazy else vals >= thresh  # ties stay in
            cand, vals = cand[keep], vals[keep]
        cand, first = np.unique(cand, return_index=True)
        vals = vals[first]
        for t, c in lazy:  # the survivors' lazy terms, by binary search in doc-sorted postings
            if len(vals) > k:  # drop what cannot reach the k-th best partial score, bounds left added
                keep = vals + lazy_ub >= kth_best(vals, k) * (1 - 1e-6)
                cand, vals = cand[keep], vals[keep]
            lo, hi = self.indptr[t], self.indptr[t + 1]
            # (C,) the needles in the postings' own dtype: mixed dtypes would cast the whole list
            i = np.minimum(np.searchsorted(self.docs[lo:hi], cand.astype(self.docs.dtype)), hi - lo - 1)
            hit = self.docs[lo:hi][i] == cand
            vals[hit] += c * self.scores[lo:hi][i[hit]].astype(np.float64)
            lazy_ub -= ub[t]
        if len(vals) > k:  # the k best and their ties, before the sort
            keep = vals >= kth_best(vals, k)
            cand, vals = cand[keep], vals[keep]
        order = np.lexsort((cand, -vals))[:k]
        return list(zip(cand[order].tolist(), vals[order].tolist()))

    def search(self, queries, k, workers=1):
        """Batch search: one list of (doc index, score) per query. workers > 1 splits the batch
        over that many worker processes (started once, kept; each maps the same index files, so
        the page cache is shared); the hits are the same as one worker's."""
        if workers <= 1 or len(queries) < 2 * workers:
            return [self.search_one(q, k) for q in queries]
        pool = self._workers(workers)
        step = -(-len(queries) // (4 * workers))  # 4 parts a worker: a slow part does not hold the batch up
        parts = [(queries[i:i + step], k) for i in range(0, len(queries), step)]
        return [hits for part in pool.imap(_search_part, parts) for hits in part]

    def _workers(self, n):
        if self._pool is None or self._pool_size != n:
            if self._pool is not None:
                self._pool.terminate()
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            self._pool = multiprocessing.get_context(method).Pool(n, _start_worker, (self.index_dir,))
            self._pool_size = n
            weakref.finalize(self, self._pool.terminate)
        return self._pool


_WORKER_INDEX = None  # the index a search worker process serves


def _start_worker(index_dir):
    global _WORKER_INDEX
    _WORKER_INDEX = Index(index_dir)


def _search_part(args):
    queries, k = args
    return [_WORKER_INDEX.search_one(q, k) for q in queries]


def load_index(index_dir):
    return Index(index_dir)


def main():
    ap = argparse.ArgumentParser(description="numpy BM25 (Lucene variant)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("corpus")
    b.add_argument("index_dir")
    b.add_argument("--k1", type=float, default=0.9)
    b.add_argument("--b", type=float, default=0.4)
    b.add_argument("--no-stem", action="store_true", help="no Porter stemming (recorded in meta.json)")
    s = sub.add_parser("search")
    s.add_argument("index_dir")
    s.add_argument("query")
    s.add_argument("-k", type=int, default=3)
    args = ap.parse_args()
    if args.cmd == "build":
        print(json.dumps(build_index(args.corpus, args.index_dir, args.k1, args.b, stem=not args.no_stem)))
    else:
        index = load_index(args.index_dir)
        hits = index.search([args.query], args.k)[0]
        for i, score in hits:
            print(f"[{score:.3f}] #{i} id={index.doc_id(i)}")
        print(format_docs([index.doc(i) for i, _ in hits]), end="")


if __name__ == "__main__":
    main()
