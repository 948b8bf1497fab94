"""BM25 retrieval in numpy alone: the search engine the agent calls.

Scoring is Lucene's BM25 (Robertson et al.; the variant Pyserini runs, which Search-R1's BM25
setting used), with k1 = 0.9 and b = 0.4 by default:
    idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))
    s(t, d)     = idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * dl(d) / avgdl))
    score(q, d) = sum over distinct query terms t of count(t in q) * s(t, d)
(repeated query words count once per occurrence, as Pyserini's bag-of-words query does).

Analysis, identical for documents and queries, Pyserini's default English analysis (Lucene's):
lowercase, words = the unicode pattern \\w+, Lucene's 33 English stopwords removed, each word
reduced to its Porter stem ("founder", "founded", "founding" -> "founder", "found", "found"; the
algorithm is Porter 1980 with the two step-2 changes of Porter's reference code that Lucene's
PorterStemFilter keeps). Each distinct word is analysed once (a cache), so a build costs about
what it cost without stemming. `stem=False` at build skips stemming; meta.json records the
analysis, and search applies the recorded one. dl counts the non-stopword tokens.

The index is plain .npy arrays plus meta.json, memory-mapped at load (no pickle):
    postings by term (CSR): indptr (n_terms + 1), docs (int32, ascending within a term),
    scores (float32, s(t, d) above); term_max (n_terms): each term's highest s(t, d), the bound
    that search's MaxScore pruning uses (see Index.search_one)
    vocabulary: one utf-8 blob + offsets; documents: one utf-8 blob (id, title, text) + offsets.
It is built in bounded memory: the corpus is streamed in chunks, each chunk's sorted postings
are spilled to disk, then merged into the CSR arrays; memory grows with the vocabulary and the
document count, never with the corpus text. Everything is written into INDEX_DIR.tmp, then
swapped in by renames (an existing index goes to INDEX_DIR.old until the new one is in place),
so a kill never leaves no whole index; a folder that holds anything but index files is never
replaced.

Defined behaviour: a query with only stopwords or unknown words returns []; only documents
that share a term with the query are returned, so k larger than the corpus returns fewer than k;
ties are broken by lower document index; an empty corpus, a malformed line (file:line named),
a duplicate document id (both lines named) and a missing or inconsistent index file are errors.

Left out: Lucene's possessive filter ("paris's" gives the tokens paris and s here) and its
tokenizer's finer rules, phrase and field queries, dense retrieval, incremental index updates.

    python retriever.py build CORPUS.jsonl INDEX_DIR
    python retriever.py search INDEX_DIR "who founded the city of Paris" [-k 3]
"""

import argparse
import array
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import weakref

import numpy as np
from tqdm import tqdm

STOPWORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then "
    "there these they this to was will with".split())  # Lucene's EnglishAnalyzer list
WORD = re.compile(r"\w+")
FORMAT_VERSION = 3  # 3: titles kept as the corpus writes them; 2 stripped their quotes; 1 recorded no analysis
CHUNK_DOCS = 100_000  # documents per spilled postings run
INDEX_FILES = {"meta.json", "indptr.npy", "term_max.npy", "docs.npy", "scores.npy", "doc_offsets.npy", "vocab_offsets.npy",
               "docs.bin", "vocab.bin", "runs"}  # everything an index folder (or its build) holds


# ----------------------------------------------------------------------------------------------
# analysis: Lucene's English analysis as Pyserini runs it: lowercase words, stopwords, Porter

def _consonant(w, i):
    """Porter's consonant: not a, e, i, o, u, and not a y that follows a consonant."""
    if w[i] in "aeiou":
        return False
    return w[i] != "y" or i == 0 or not _consonant(w, i - 1)


def _measure(stem):
    """m in Porter's [C](VC)^m[V]: the number of vowel-consonant sequences."""
    kinds = "".join("c" if _consonant(stem, i) else "v" for i in range(len(stem)))
    return kinds.count("vc")


def _has_vowel(stem):
    return any(not _consonant(stem, i) for i in range(len(stem)))


def _double_consonant(w):
    return len(w) >= 2 and w[-1] == w[-2] and _consonant(w, len(w) - 1)


def _cvc(w):
    """*o: ends consonant-vowel-consonant, the last not w, x or y (hop, not hoy)."""
    return (len(w) >= 3 and _consonant(w, len(w) - 3) and not _consonant(w, len(w) - 2)
            and _consonant(w, len(w) - 1) and w[-1] not in "wxy")


# (suffix, replacement): the first suffix a word ends with is the only one tried, and it is
# replaced when the measure of what precedes it is > 0 (step 2, 3) or > 1 (step 4). Lucene's
# PorterStemmer (Porter's reference C code) departs from the 1980 paper in step 2: "bli" -> "ble"
# (the paper: "abli" -> "able") and "logi" -> "log" (not in the paper).
STEP2 = (("ational", "ate"), ("tional", "tion"), ("enci", "ence"), ("anci", "ance"), ("izer", "ize"),
         ("bli", "ble"), ("alli", "al"), ("entli", "ent"), ("eli", "e"), ("ousli", "ous"),
         ("ization", "ize"), ("ation", "ate"), ("ator", "ate"), ("alism", "al"), ("iveness", "ive"),
         ("fulness", "ful"), ("ousness", "ous"), ("aliti", "al"), ("iviti", "ive"), ("biliti", "ble"),
         ("logi", "log"))
STEP3 = (("icate", "ic"), ("ative", ""), ("alize", "al"), ("iciti", "ic"), ("ical", "ic"), ("ful", ""),
         ("ness", ""))
STEP4 = ("al", "ance", "ence", "er", "ic", "able", "ible", "ant", "ement", "ment", "ent", "ion", "ou",
         "ism", "ate", "iti", "ous", "ive", "ize")


def _replace(w, rules, min_measure):
    for suffix, repl in rules:
        if w.endswith(suffix):
            stem = w[:-len(suffix)]
            if suffix == "ion" and not stem.endswith(("s", "t")):
                continue  # step 4 removes -ion only after s or t
            return stem + repl if _measure(stem) > min_measure else w
    return w


def porter_stem(w, step2=STEP2):
    """Porter (1980) as Lucene's PorterStemFilter runs it, on one lowercase word."""
    if len(w) <= 2:
        return w
    # step 1a: plurals
    if w.endswith("sses") or w.endswith("ies"):
        w = w[:-2]
    elif w.endswith("s") and not w.endswith("ss"):
        w = w[:-1]
    # step 1b: -eed, -ed, -ing
    if w.endswith("eed"):
        if _measure(w[:-3]) > 0:
            w = w[:-1]
    elif (w.endswith("ed") and _has_vowel(w[:-2])) or (w.endswith("ing") and _has_vowel(w[:-3])):
        w = w[:-2] if w.endswith("ed") else w[:-3]
        if w.endswith(("at", "bl", "iz")):
            w += "e"
        elif _double_consonant(w) and w[-1] not in "lsz":
            w = w[:-1]
        elif _measure(w) == 1 and _cvc(w):
            w += "e"
    # step 1c: y -> i after a vowel in the stem
    if w.endswith("y") and _has_vowel(w[:-1]):
        w = w[:-1] + "i"
    w = _replace(w, step2, 0)  # step 2: double suffixes
    w = _replace(w, STEP3, 0)  # step 3: -ic-, -full, -ness
    w = _replace(w, [(s, "") for s in STEP4], 1)  # step 4: -ant, -ence, ...
    # step 5: a final -e, a final -ll
    if w.endswith("e"):
        m = _measure(w[:-1])
        if m > 1 or (m == 1 and not _cvc(w[:-1])):
            w = w[:-1]
    if w.endswith("ll") and _measure(w) > 1:
        w = w[:-1]
    return w


class Analyzer:
    """text -> the tokens BM25 sees: lowercase \\w+ words, Lucene's 33 stopwords removed, then
    (stem=True) the Porter stem. Each distinct word is stemmed once (a cache)."""

    def __init__(self, stem=True):
        self.stem = stem
        self.cache = {}  # word -> stem, or None for a stopword

    def term(self, w):
        """One lowercase word's term, or None for a stopword (not cached)."""
        return None if w in STOPWORDS else porter_stem(w) if self.stem else w

    def word(self, w):
        t = self.cache.get(w, "")
        if t == "":
            t = self.cache[w] = self.term(w)
        return t

    def __call__(self, text):
        return [t for t in map(self.word, WORD.findall(text.lower())) if t is not None]

    def describe(self):
        """What the index records as its analysis."""
        return dict(lowercase=True, token=WORD.pattern, stopwords="lucene-english-33",
                    stemmer="porter" if self.stem else None)


def analyze(text, stem=True):
    """The tokens BM25 sees (see Analyzer); a new cache each call: use an Analyzer for many texts."""
    return Analyzer(stem)(text)


def format_docs(docs):
    """Search-R1's observation block for a list of (title, text)."""
    return "".join(f"Doc {i}(Title: {title}) {text}\n" for i, (title, text) in enumerate(docs, 1))


def read_corpus(path):
    """Yield (line_no, id, title, text) from FlashRAG JSON lines (`contents` or `title`/`text`)."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise TypeError("a corpus line must be a JSON object")
                if "contents" in rec:
                    title, _, text = rec["contents"].partition("\n")  # the first line, as written
                    # (wiki-18's `"Evan Morris"`, quotes included, as Search-R1 shows it)
                elif "title" in rec and "text" in rec:
                    title, text = rec["title"], rec["text"]
                else:
                    raise KeyError("no 'contents' field (nor 'title' and 'text')")
                if not isinstance(title, str) or not isinstance(text, str):
                    raise TypeError("'contents' (or 'title' and 'text') must be text")
                doc_id = str(rec.get("id", line_no))
                (title + text + doc_id).encode("utf-8")  # lone surrogates are valid JSON, not text
            except (UnicodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{line_no}: malformed corpus line ({type(e).__name__}: {e})") from None
            yield line_no, doc_id, title, text


# ----------------------------------------------------------------------------------------------
# build

def _spill(run_dir, k, term_ids, local_docs, doc_base, n_docs_chunk):
    """Sort one chunk's (term, doc) tokens into unique postings with tf; save as a run file."""
    key = term_ids.astype(np.int64) * n_docs_chunk + local_docs  # (n_tokens,)
    key, tf = np.unique(key, return_counts=True)  # sorted by term, then doc
    run = np.stack([key // n_docs_chunk, key % n_docs_chunk + doc_base, tf]).astype(np.int32)  # (3, P)
    np.save(os.path.join(run_dir, f"run{k}.npy"), run)


def _ours(path):
    """True when `path` is absent, or a folder holding nothing but index files (whole or partial)."""
    return not os.path.exists(path) or (os.path.isdir(path) and set(os.listdir(path)) <= INDEX_FILES)


def build_index(corpus_path, index_dir, k1=0.9, b=0.4, stem=True, chunk_docs=CHUNK_DOCS):
    """Stream `corpus_path` into a BM25 index folder `index_dir`: written as INDEX_DIR.tmp, then
    swapped in by renames (an old index goes to INDEX_DIR.old first, removed last), so at every
    instant a whole index is at INDEX_DIR or INDEX_DIR.old. A path holding anything but index
    files is refused, never deleted. stem=False: no Porter stemming (the analysis is recorded)."""
    index_dir = index_dir.rstrip("/")
    tmp, old = index_dir + ".tmp", index_dir + ".old"
    for path in (index_dir, tmp, old):
        if not _ours(path):
            what = sorted(os.listdir(path))[:4] if os.path.isdir(path) else "a file"
            raise ValueError(f"{path}: exists and is not an index folder ({what}); nothing was changed: "
                             "choose another output folder")
    if not os.path.isfile(corpus_path):
        raise FileNotFoundError(f"{corpus_path}: corpus file not found")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "runs"))
    analyzer = Analyzer(stem)
    vocab = {}  # term (a stem) -> id
    word_ids = dict.fromkeys(STOPWORDS, -1)  # word -> its term's id; -1: a stopword, dropped

    def new_word(w):  # once per distinct word: analyse it (word_ids is the cache here)
        t = analyzer.term(w)
        word_ids[w] = i = -1 if t is None else vocab.setdefault(t, len(vocab))
        return i
    doc_len, doc_off, id_hash = [], array.array("q", [0]), array.array("q")  # 8 bytes per entry
    n_runs, n_docs = 0, 0
    chunk_terms, chunk_lens = [], []
    with open(os.path.join(tmp, "docs.bin"), "wb") as store:
        for line_no, doc_id, title, text in tqdm(read_corpus(corpus_path), desc="index", unit=" docs"):
            for field in (doc_id, title, text):
                data = field.encode("utf-8")
                store.write(data)
                doc_off.append(doc_off[-1] + len(data))
            id_hash.append(int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little", signed=True))
            words = WORD.findall(f"{title} {text}".lower())
            ids = [word_ids[w] if w in word_ids else new_word(w) for w in words]
            ids = [i for i in ids if i >= 0]
            chunk_terms.extend(ids)
            chunk_lens.append(len(ids))
            n_docs += 1
            if len(chunk_lens) == chunk_docs:
                _flush(tmp, n_runs, chunk_terms, chunk_lens, n_docs, doc_len)
                n_runs, chunk_terms, chunk_lens = n_runs + 1, [], []
        if chunk_lens:
            _flush(tmp, n_runs, chunk_terms, chunk_lens, n_docs, doc_len)
            n_runs += 1
    if n_docs == 0:
        shutil.rmtree(tmp)
        raise ValueError(f"{corpus_path}: the corpus has no documents")
    _check_unique_ids(np.frombuffer(id_hash, dtype=np.int64), corpus_path, tmp, np.frombuffer(doc_off, dtype=np.int64))

    dl = np.concatenate(doc_len).astype(np.float32)  # (N,)
    n_terms = len(vocab)
    df = np.zeros(n_terms, dtype=np.int64)
    for k in range(n_runs):
        run = np.load(os.path.join(tmp, "runs", f"run{k}.npy"), mmap_mode="r")
        df += np.bincount(run[0], minlength=n_terms)
    indptr = np.zeros(n_terms + 1, dtype=np.int64)
    np.cumsum(df, out=indptr[1:])
    n_post = int(indptr[-1])
    avgdl = float(dl.mean())
    idf = np.log1p((n_docs - df + 0.5) / (df + 0.5)).astype(np.float32)  # (n_terms,)
    norm = (k1 * (1 - b + b * dl / avgdl)).astype(np.float32)  # (N,)
    docs = np.lib.format.open_memmap(os.path.join(tmp, "docs.npy"), "w+", np.int32, (n_post,))
    scores = np.lib.format.open_memmap(os.path.join(tmp, "scores.npy"), "w+", np.float32, (n_post,))
    fill = indptr[:-1].copy()  # next write position per term
    term_max = np.zeros(n_terms, dtype=np.float32)  # each term's highest score: MaxScore's bound
    for k in tqdm(range(n_runs), desc="merge", unit=" runs"):
        path = os.path.join(tmp, "runs", f"run{k}.npy")
        t, d, tf = np.load(path)  # each (P,), sorted by term
        counts = np.bincount(t, minlength=n_terms)
        starts = np.cumsum(counts) - counts  # first index of each term's group in this run
        pos = fill[t] + (np.arange(len(t)) - starts[t])  # (P,) destination in the CSR arrays
        tf = tf.astype(np.float32)
        docs[pos] = d
        scores[pos] = run_scores = idf[t] * tf * (k1 + 1) / (tf + norm[d])
        np.maximum.at(term_max, t, run_scores)
        fill += counts
        os.remove(path)
    docs.flush()
    scores.flush()
    del docs, scores
    os.rmdir(os.path.join(tmp, "runs"))
    np.save(os.path.join(tmp, "indptr.npy"), indptr)
    np.save(os.path.join(tmp, "term_max.npy"), term_max)
    np.save(os.path.join(tmp, "doc_offsets.npy"), np.frombuffer(doc_off, dtype=np.int64))
    terms = sorted((i, w) for w, i in vocab.items())
    blob = [w.encode("utf-8") for _, w in terms]
    np.save(os.path.join(tmp, "vocab_offsets.npy"), np.cumsum([0] + [len(x) for x in blob]).astype(np.int64))
    with open(os.path.join(tmp, "vocab.bin"), "wb") as f:
        f.write(b"".join(blob))
    meta = dict(format=FORMAT_VERSION, analysis=analyzer.describe(), k1=k1, b=b, n_docs=n_docs, n_terms=n_terms, n_postings=n_post,
                avgdl=avgdl, corpus=os.path.abspath(corpus_path))
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if os.path.exists(index_dir):
        shutil.rmtree(old, ignore_errors=True)  # a whole index is at index_dir: an older .old can go
        os.replace(index_dir, old)
    os.replace(tmp, index_dir)
    shutil.rmtree(old, ignore_errors=True)
    return meta


def _flush(tmp, k, chunk_terms, chunk_lens, n_docs, doc_len):
    lens = np.array(chunk_lens, dtype=np.int64)
    local = np.repeat(np.arange(len(lens)), lens)  # (n_tokens,) doc index within the chunk
    _spill(os.path.join(tmp, "runs"), k, np.array(chunk_terms, dtype=np.int64), local,
           n_docs - len(lens), len(lens))
    doc_len.append(lens)


def _check_unique_ids(h, corpus_path, tmp, doc_off):
    order = np.argsort(h, kind="stable")
    dup = np.nonzero(h[order][1:] == h[order][:-1])[0]
    blob = np.memmap(os.path.join(tmp, "docs.bin"), dtype=np.uint8, mode="r") if len(dup) else None
    for j in dup:
        a, c = order[j], order[j + 1]
        ida = bytes(blob[doc_off[3 * a]:doc_off[3 * a + 1]])
        if ida == bytes(blob[doc_off[3 * c]:doc_off[3 * c + 1]]):
            shutil.rmtree(tmp)
            raise ValueError(f"{corpus_path}: duplicate document id {ida.decode()!r} "
                             f"(documents {a + 1} and {c + 1}, counting non-empty lines)")


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
        if getattr(self, "_pool", None) is None or self._pool_size != n:
            if getattr(self, "_pool", None) is not None:
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
