"""Pyserini's default English analysis (Lucene's EnglishAnalyzer as BM25 indexes use it), in Python.

text -> lowercase -> words (the unicode pattern \\w+) -> Lucene's 33 English stopwords removed ->
each word reduced to its Porter stem ("founder", "founded", "founding" -> "founder", "found",
"found"). The stemmer is Porter's 1980 algorithm with the two step-2 changes of Porter's
reference code that Lucene's PorterStemFilter keeps (-logi -> -log, -bli -> -ble):
  step 1a  plurals (sses -> ss, ies -> i, s -> "")       step 1b  -eed, -ed, -ing (then tidy)
  step 1c  y -> i after a vowel                          step 2   double suffixes (-ational -> -ate)
  step 3   -icate, -ful, -ness ...                       step 4   -al, -ance, -er ... (measure > 1)
  step 5   a final e, a double l (measure > 1)
where a word's measure m counts its vowel-consonant sequences. An `Analyzer` stems each distinct
word once (a cache).

Left out: Lucene's possessive filter ("paris's" gives the tokens paris and s here) and its
tokenizer's finer rules.

    python analysis.py "Who founded the founding cities?"     # the tokens BM25 sees
"""

import re
import sys

STOPWORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then "
    "there these they this to was will with".split())  # Lucene's EnglishAnalyzer list
WORD = re.compile(r"\w+")


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


if __name__ == "__main__":
    print(analyze(" ".join(sys.argv[1:]) or "Who founded the founding cities?"))
