"""The built-in toy world that `python evolve.py` trains on: a generated knowledge world, its
corpus and questions (the tiny backbone that speaks the protocol is toyagent.py's).

World (deterministic from a seed): invented countries, cities, people and companies with
invented names and facts: a city's country, a person's birth city and birth year, a company's
founder, headquarters and founding year. Nothing can be known without searching, and every
relation has dozens of possible answers, so guessing is hopeless.

Corpus (FlashRAG JSON lines, `contents` = Title\\ntext: the toy world writes its titles without
wiki-18's quotes, so an observation reads "Doc 1(Title: Dorto) ..."): one passage per entity. Distractors:
every given name x family name is a person (21 x 20) and every stem x kind a company (30 x 6), so a
vague query (a family name alone) finds the wrong person, and passages mention other entities in
passing (a city lists people born there, a person's passage names a colleague, a company names
its founder). The full cross also means any family name can follow a given name, so a name in
an answer has to be copied from the question or a document: it cannot be recalled.

Questions (FlashRAG `question` / `golden_answers`, plus `type` and the canonical `hops`):
    single     "In which city was P born?"  "Who founded C?"  "In which country is the city X?"
    bridge     "In which country was P born?"  "In which city was the founder of C born?"
    comparison "Who was born first, P or Q?"
    three_hop  "In which country was the founder of C born?"
Train and test share no subject entity; the test split is the built-in benchmark.

Left out: natural-language variety (templates are fixed), numeric-reasoning questions.

    python -m worlds.toyworld OUT_DIR [--seed N]   # the world alone; its backbone: python -m worlds.toyagent
"""

import argparse
import json
import os
import random

import index_build
from checkpoint import write_atomic


SYLLABLES = ("ka ri to mo ne sa lu vi den bor tal mir gan sel dor fen kas lin tor var bel mon "
             "rus pel dan vor len tes kor zal nim ros").split()
OCCUPATIONS = ("painter", "engineer", "chemist", "poet", "merchant", "architect", "composer", "sailor")
N_COUNTRIES, N_CITIES, N_GIVEN, N_FAMILY, N_STEMS = 14, 56, 21, 20, 30  # 420 people, 180 companies
COMPANY_KINDS = ("Works", "Company", "Group", "Trading", "Mills", "Foundry")
TYPES = ("single", "bridge", "comparison", "three_hop")


# ----------------------------------------------------------------------------------------------
# world, corpus, questions

def _names(rng, n, parts):
    out = set()
    while len(out) < n:
        out.add("".join(rng.choice(SYLLABLES) for _ in range(rng.choice(parts))).capitalize())
    return sorted(out)


def make_world(seed):
    rng = random.Random(seed)
    pool = _names(rng, N_COUNTRIES + N_CITIES + N_GIVEN + N_FAMILY + N_STEMS, (2, 3))
    rng.shuffle(pool)
    countries, pool = pool[:N_COUNTRIES], pool[N_COUNTRIES:]
    cities = {c: rng.choice(countries) for c in pool[:N_CITIES]}
    given, pool = pool[N_CITIES:N_CITIES + N_GIVEN], pool[N_CITIES + N_GIVEN:]
    family, stems = pool[:N_FAMILY], pool[N_FAMILY:]
    # every given x family name is a person and every stem x kind a company: after a given name any
    # family name is as likely, so a name can only be copied from the question, never recalled
    people = {f"{g} {f}": dict(city=rng.choice(sorted(cities)), year=rng.randint(1700, 1999),
                               job=rng.choice(OCCUPATIONS)) for g in given for f in family}
    companies_names = [f"{s} {k}" for s in stems for k in COMPANY_KINDS]
    names = sorted(people)
    for p in names:
        people[p]["colleague"] = rng.choice(names)
    companies = {c: dict(founder=rng.choice(names), city=rng.choice(sorted(cities)),
                         year=rng.randint(1750, 2010)) for c in companies_names}
    return dict(countries=countries, cities=cities, people=people, companies=companies)


def corpus_records(world):
    """One FlashRAG record per entity, in a fixed order."""
    born_in = {}
    for p, f in world["people"].items():
        born_in.setdefault(f["city"], []).append(p)
    recs = []
    for c in world["countries"]:
        cs = sorted(x for x, k in world["cities"].items() if k == c)
        recs.append((c, f"{c} is a country. Its cities include {', '.join(cs)}."))
    for c, k in world["cities"].items():
        notable = born_in.get(c, [])[:2]
        extra = f" Notable people born here include {' and '.join(notable)}." if notable else ""
        recs.append((c, f"{c} is a city in the country of {k}.{extra}"))
    for p, f in world["people"].items():
        recs.append((p, f"{p} was born in the city of {f['city']}. {p} was born in the year {f['year']}. "
                        f"{p} worked as a {f['job']}. {p.split()[0]} often worked with {f['colleague']}."))
    for c, f in world["companies"].items():
        recs.append((c, f"{c} was founded by {f['founder']}. {c} was founded in the year {f['year']}. "
                        f"{c} is headquartered in the city of {f['city']}."))
    return [{"id": str(i), "contents": f"{t}\n{x}"} for i, (t, x) in enumerate(recs)]


def make_questions(world, seed):
    """All questions, then split so that train and test share no subject entity."""
    rng = random.Random(seed + 1)
    P, C, K = world["people"], world["companies"], world["cities"]
    subjects = sorted(P) + sorted(C) + sorted(K)
    test_subjects = set(rng.sample(subjects, len(subjects) // 5))
    qs = []

    def add(kind, q, answer, hops, subj):
        qs.append(dict(question=q, golden_answers=[str(answer)], type=kind, hops=hops, subjects=subj))

    for p, f in P.items():
        add("single", f"In which city was {p} born?", f["city"], [[p, f["city"]]], [p])
        add("bridge", f"In which country was {p} born?", K[f["city"]],
            [[p, f["city"]], [f["city"], K[f["city"]]]], [p])
    for c, f in C.items():
        fo = f["founder"]
        city = P[fo]["city"]
        add("single", f"Who founded {c}?", fo, [[c, fo]], [c])
        add("bridge", f"In which city was the founder of {c} born?", city, [[c, fo], [fo, city]], [c])
        add("three_hop", f"In which country was the founder of {c} born?", K[city],
            [[c, fo], [fo, city], [city, K[city]]], [c])
    for k, country in K.items():
        add("single", f"In which country is the city {k}?", country, [[k, country]], [k])
    for side in (sorted(p for p in P if p not in test_subjects), sorted(p for p in P if p in test_subjects)):
        for _ in range(len(side)):  # comparisons pair two people of the same split
            a, b = rng.sample(side, 2)
            if P[a]["year"] != P[b]["year"]:
                first = a if P[a]["year"] < P[b]["year"] else b
                add("comparison", f"Who was born first, {a} or {b}?", first,
                    [[a, str(P[a]["year"])], [b, str(P[b]["year"])]], [a, b])
    train = [q for q in qs if not set(q["subjects"]) & test_subjects]
    test = [q for q in qs if set(q["subjects"]) <= test_subjects]
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def write_world(out_dir, seed):
    """corpus.jsonl, train.jsonl, test.jsonl (byte-identical for a seed) and the BM25 index."""
    world = make_world(seed)
    os.makedirs(out_dir, exist_ok=True)
    train, test = make_questions(world, seed)
    for name, rows in (("corpus", corpus_records(world)), ("train", train), ("test", test)):
        write_atomic(os.path.join(out_dir, name + ".jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    # no stemming: the analysis the shipped backbone was trained with (its warm-start trajectories
    # hold this index's search results)
    index_build.build_index(os.path.join(out_dir, "corpus.jsonl"), os.path.join(out_dir, "index"), stem=False)
    write_atomic(os.path.join(out_dir, "world.json"), json.dumps(dict(seed=seed)))  # last: marks a finished world
    return world, train, test


def stamped(path, **fields):
    """True when the stamp file exists and records these field values."""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        got = json.load(f)
    return all(got.get(k) == v for k, v in fields.items())


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description="write the toy world: corpus, questions and BM25 index")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    _, train, test = write_world(args.out_dir, args.seed)
    print(f"{args.out_dir}: {len(train)} train and {len(test)} test questions, corpus and index")


if __name__ == "__main__":
    main()
