"""The BM25 index build: a FlashRAG corpus streamed into memory-mapped arrays in bounded memory.

For each passage, analysis.py's tokens; per term t and passage d the BM25 weight (retriever.py
gives the formula) s(t, d) = idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * dl(d) / avgdl)).
The index folder holds plain .npy arrays plus meta.json (no pickle):
    postings by term (CSR): indptr (n_terms + 1), docs (int32, ascending within a term),
    scores (float32, s(t, d)); term_max (n_terms): each term's highest s(t, d), MaxScore's bound
    vocabulary: one utf-8 blob + offsets; documents: one utf-8 blob (id, title, text) + offsets.
The corpus is streamed in chunks of CHUNK_DOCS passages; each chunk's sorted postings are spilled
to disk, then merged into the CSR arrays, so memory grows with the vocabulary and the document
count, never with the corpus text. Everything is written into INDEX_DIR.tmp, then swapped in by
renames (an existing index goes to INDEX_DIR.old until the new one is in place), so a kill never
leaves no whole index; a folder that holds anything but index files is never replaced. An empty
corpus, a malformed line (file:line named) and a duplicate document id (both lines named) are errors.

Left out: incremental updates, sharded (multi-machine) indexes.

    python retriever.py build CORPUS.jsonl INDEX_DIR      # the command line is retriever.py's
"""

import array
import hashlib
import json
import os
import shutil

import numpy as np
from tqdm import tqdm

from analysis import STOPWORDS, WORD, Analyzer

FORMAT_VERSION = 3  # what the files mean; an index of another version is refused with the rebuild command
CHUNK_DOCS = 100_000  # documents per spilled postings run
INDEX_FILES = {"meta.json", "indptr.npy", "term_max.npy", "docs.npy", "scores.npy", "doc_offsets.npy", "vocab_offsets.npy",
               "docs.bin", "vocab.bin", "runs"}  # everything an index folder (or its build) holds


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
